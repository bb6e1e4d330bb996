"""Known-circuit recovery: the hand-built models do what they are built to do (read from the
model's own attention weights), and EAP-IG recovers their known edges (ROC-AUC >= 0.95).

Oracles: `transformers`' own `output_attentions` (the previous-token / induction / mover
patterns), the model's own logits, and a Mann-Whitney count for the ROC-AUC.
"""

from __future__ import annotations

import pytest
import torch

from heads.errors import HeadsteerValueError
from probes.known_circuits import known_circuit, recovery, recovery_auc, save_known_circuit

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["induction", "two_hop"])
def kc(request):
    return known_circuit(request.param, n_pairs=8)


def test_the_model_runs_the_circuit_it_is_built_with(kc):
    m, p = kc.model.model, kc.pairs
    m.set_attn_implementation("eager")  # transformers returns the patterns on its eager path
    try:
        with torch.no_grad():
            out = m(input_ids=p.clean_ids, attention_mask=p.attention_mask, output_attentions=True)
            bad = m(input_ids=p.corrupted_ids, attention_mask=p.attention_mask)
    finally:
        m.set_attn_implementation("sdpa")
    assert torch.equal(out.logits[:, -1].argmax(-1), p.answers[:, 0])
    assert torch.equal(bad.logits[:, -1].argmax(-1), p.counterfactuals[:, 0])
    a0, a1 = out.attentions[0][:, 0], out.attentions[1][:, 0]  # head 0 of each layer [N, T, T]
    t = p.width
    if kc.kind == "induction":
        prev = torch.stack([a0[:, i, i - 1] for i in range(1, t)], 1)
        assert float(prev.min()) > 0.9  # previous-token head
        ids = p.clean_ids
        m_pos = [row[:-1].tolist().index(int(row[-1])) for row in ids]
        ind = torch.stack([a1[n, -1, m_pos[n] + 1] for n in range(p.n)])
        assert float(ind.min()) > 0.9  # induction: the token after the earlier occurrence
    else:
        assert float(a0[:, :, 0].min()) > 0.9  # every position reads the name at position 0
        assert float(a1[:, -1, -2].min()) > 0.9  # the mover reads the previous position


def test_recovery_auc_is_the_mann_whitney_share():
    labels = torch.tensor([True, False, True, False, False])
    scores = torch.tensor([0.9, -0.95, 0.2, 0.1, float("nan")])
    pos, neg = [0.9, 0.2], [0.95, 0.1, 0.0]  # |score|, NaN as 0
    share = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg) / (len(pos) * len(neg))
    assert recovery_auc(labels, scores) == pytest.approx(share)
    with pytest.raises(HeadsteerValueError, match="both"):
        recovery_auc(torch.ones(3, dtype=torch.bool), torch.ones(3))


def test_eap_ig_and_exact_recover_the_known_edges(kc):
    auc = recovery(kc, ("eap-ig", "exact"))
    assert auc["eap-ig"] >= 0.95
    assert auc["exact"] >= 0.95
    assert int(kc.labels().sum()) == len(kc.edges)  # every known edge is an edge of the graph


def test_saved_folder_loads_as_an_ordinary_model(tmp_path):
    from heads import load_model

    kc = known_circuit("induction", n_pairs=2)
    folder = save_known_circuit("induction", tmp_path / "m")
    hm = load_model(folder)
    ids = kc.pairs.clean_ids
    with torch.no_grad():
        a = hm.model(input_ids=ids).logits
        b = kc.model.model(input_ids=ids).logits
    torch.testing.assert_close(a, b)
    assert hm.tokenizer("t3 t5")["input_ids"] == [3, 5]
    with pytest.raises(HeadsteerValueError, match="not empty"):
        save_known_circuit("induction", folder)


@pytest.mark.parametrize(
    "kw, match",
    [({"kind": "ioi"}, "kind"), ({"n_pairs": 0}, "n_pairs"), ({"seed": -1}, "seed")],
)
def test_bad_input(kw, match):
    with pytest.raises(HeadsteerValueError, match=match):
        known_circuit(**kw)
