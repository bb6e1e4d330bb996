"""EAP and EAP-IG edge scores against the EAP-IG reference code's scoring, re-implemented in
tests/support/eap_reference.py (hannamw/EAP-IG, cited there), on the same graph and pairs of a
tiny GQA Llama and a tiny Qwen2 (q / k / v biases)."""

from __future__ import annotations

import pytest
import torch

from heads.scorers.circuits import edge_scores, graph_of
from heads.scorers.patching import pairs_from_tokens
from tests.support.eap_reference import fold_to_kv_heads, reference_scores, split_forward
from tests.support.families import tiny_family_model

N_PAIRS, LENGTH, STEPS = 3, 6, 3


def _model(kind):
    extra = {"use_sliding_window": False} if kind == "qwen2" else {}
    return tiny_family_model(kind, **extra)


def _tokens():
    g = torch.Generator().manual_seed(3)
    clean = torch.randint(3, 300, (N_PAIRS, LENGTH), generator=g)
    corrupted = clean.clone()
    corrupted[:, 1:3] = torch.randint(3, 300, (N_PAIRS, 2), generator=g)  # two tokens differ
    answers, counterfactuals = torch.tensor([5, 6, 7]), torch.tensor([40, 41, 42])
    return clean, corrupted, answers, counterfactuals


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_oracle_forward_is_the_model(kind):
    m = _model(kind)
    clean = _tokens()[0]
    with torch.no_grad():
        logits, _, _ = split_forward(m.model, m.model.model.embed_tokens(clean))
        torch.testing.assert_close(logits, m.model(clean).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_edge_scores_equal_the_reference(kind, method):
    m = _model(kind)
    clean, corrupted, answers, counterfactuals = _tokens()
    pairs = pairs_from_tokens(clean.tolist(), corrupted.tolist(), answers.tolist(), counterfactuals.tolist())
    got = edge_scores(m, pairs, method=method, steps=STEPS if method == "eap-ig" else 5, progress=False)
    # the paper's points k = 1..m (Eq. 3), which headsteer follows; the reference loops k = 0..m-1
    ks = range(1, STEPS + 1) if method == "eap-ig" else None
    ref = reference_scores(
        m.model, clean, corrupted, answers, counterfactuals, method=method, steps=STEPS, ks=ks
    )
    want = fold_to_kv_heads(ref, m.n_layers, m.n_heads, m.n_kv_heads)
    valid = graph_of(m).valid
    assert want.shape == got.scores.shape
    scale = float(want[valid].abs().max())
    assert scale > 1e-2  # the corruption moves the metric through the graph
    assert float((got.scores[valid] - want[valid]).abs().max()) <= 1e-5 * scale
    assert torch.isnan(got.scores[~valid]).all() and bool((want[~valid] == 0).all())
