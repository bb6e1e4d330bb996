"""EAP / EAP-IG without held activation differences (`eap_chunk_lean`) equal `eap_chunk` and one
backward through the whole model: the oracle and the pairs are test_eap_layerwise's (the dense
product of every upstream difference with every input gradient of one `torch.autograd.grad`).
Checked with several segment / block sizes on a 4-layer GQA model (EAP and EAP-IG), on a
post-norm family (Gemma-2) and on sliding-window families with prompts longer than the window."""

from __future__ import annotations

import pytest
import torch

from heads.scorers.circuits import graph_of
from heads.scorers.circuits.eap import eap_chunk
from heads.scorers.circuits.eap_lean import eap_chunk_lean
from tests.heads.circuits.test_eap_layerwise import _loss, _oracle, _pairs
from tests.support.families import WINDOW, tiny_family_model

torch.set_num_threads(1)


def _both(m, p, **kw):
    args = (m, graph_of(m), p.clean_ids, p.corrupted_ids, p.attention_mask, _loss(p))
    return eap_chunk_lean(*args, **kw)


@pytest.mark.parametrize("steps", [None, 2])
def test_lean_equals_one_backward_and_eap_chunk(steps):
    m = tiny_family_model("llama", num_hidden_layers=4)
    assert m.n_kv_heads < m.n_heads  # GQA
    p = _pairs(7)
    want = _oracle(m, p, steps)
    scale = float(want.abs().max())
    assert scale > 1e-3
    today = eap_chunk(m, graph_of(m), p.clean_ids, p.corrupted_ids, p.attention_mask, _loss(p), steps=steps)
    for every, block in ((1, 1), (2, 1), (2, 3), (4, 4)):
        got = _both(m, p, steps=steps, every=every, block=block)
        assert float((got - want).abs().max()) <= 1e-5 * scale, (every, block)
        assert float((got - today).abs().max()) <= 1e-6 * scale, (every, block)


@pytest.mark.parametrize("kind", ["gemma2", "mistral", "gemma3_text"])
def test_lean_post_norm_and_sliding_window(kind):
    """Gemma-2 / 3: post-norm (the heads' differences scaled by the frozen norm scale); prompts
    of 3 x the window on the sliding-window families."""
    m = tiny_family_model(kind)
    p = _pairs(3 * WINDOW)
    want = _oracle(m, p, None)
    scale = float(want.abs().max())
    assert scale > 1e-3
    got = _both(m, p, every=2, block=1)
    assert float((got - want).abs().max()) <= 1e-5 * scale
    today = eap_chunk(m, graph_of(m), p.clean_ids, p.corrupted_ids, p.attention_mask, _loss(p), every=2)
    assert float((got - today).abs().max()) <= 1e-6 * scale


def test_memory_budget_takes_the_lean_path_only_when_the_default_does_not_fit(monkeypatch):
    """`max_memory` the default path's plan fits: `eap_chunk`; one pair over it but within the
    lean plan: `eap_chunk_lean` (the same scores); below the lean plan's one pair: refused before
    any forward, naming that minimum. (A budget used to send every run down the slower path.)"""
    import pytest

    from heads import SweepOptions
    from heads.errors import HeadsteerValueError
    from heads.planning import plan_memory
    from heads.scorers.circuits import edge_scores
    from heads.scorers.circuits import scores as scores_module

    m = tiny_family_model("llama", num_hidden_layers=2)
    p = _pairs(7)
    T = p.clean_ids.shape[1]
    calls: list[str] = []

    def spy(name, fn):
        def run(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(scores_module, "eap_chunk_lean", spy("lean", eap_chunk_lean))
    monkeypatch.setattr(scores_module, "eap_chunk", spy("default", eap_chunk))
    default_one = plan_memory(m, "eap", T, 1).peak
    lean_one = plan_memory(m, "eap_lean", T, 1).peak
    assert lean_one < default_one
    plain = edge_scores(m, p, method="eap", options=SweepOptions(progress=False))
    assert set(calls) == {"default"}
    calls.clear()
    roomy = edge_scores(m, p, method="eap", options=SweepOptions(progress=False, max_memory="4GB"))
    assert set(calls) == {"default"}
    assert torch.equal(roomy.scores.nan_to_num(), plain.scores.nan_to_num())
    calls.clear()
    tight = SweepOptions(progress=False, max_memory=(lean_one + default_one) // 2)
    lean = edge_scores(m, p, method="eap", options=tight)
    assert set(calls) == {"lean"} and len(calls) == p.n  # one pair per chunk within the budget
    ok = ~torch.isnan(plain.scores)
    scale = float(plain.scores[ok].abs().max())
    assert scale > 1e-3
    assert float((lean.scores[ok] - plain.scores[ok]).abs().max()) <= 1e-6 * scale
    calls.clear()
    with pytest.raises(HeadsteerValueError, match="max_memory"):
        edge_scores(m, p, method="eap", options=SweepOptions(progress=False, max_memory=lean_one - 1))
    assert not calls
