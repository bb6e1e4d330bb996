"""`circuit_qk`: a circuit's query / key edges read through QK attribution."""

from __future__ import annotations

import pytest
import torch

from heads.scorers.circuits import edge_scores, select
from heads.scorers.patching import pairs_from_tokens
from heads.scorers.qk import circuit_qk
from tests.support.families import tiny_family_model


def test_every_q_and_k_edge_is_read_from_its_heads_marginals():
    hm = tiny_family_model("llama", "eager", initializer_range=0.2)  # 2 layers, 4 heads, 2 KV heads
    g = torch.Generator().manual_seed(2)
    clean = torch.randint(10, 300, (3, 6), generator=g).tolist()
    corr = torch.randint(10, 300, (3, 6), generator=g).tolist()
    pairs = pairs_from_tokens(clean, corr, [5, 6, 7], [40, 41, 42])
    sc = edge_scores(hm, pairs, method="eap", progress=False)
    c = select(sc, 60)
    out = circuit_qk(hm, c, pairs)
    df = out.to_frame()
    names = c.edge_names()
    qk_edges = [e for e in names if e.endswith("<q>") or e.endswith("<k>")]
    assert qk_edges and set(df.edge) == set(qk_edges)
    for e in qk_edges:  # a key edge goes to the KV head: one row per query head of its group
        want = 1 if e.endswith("<q>") else 2
        assert (df.edge == e).sum() == want, e
    for _, row in df.iterrows():
        la, h = (int(x) for x in row["head"][1:].split("H"))
        r = out.attributions[(la, h)]
        m = r.marginals(row["side"])
        idx = [r.names.index(n) for n in row["component"].split("+")]
        top = torch.where(r.valid, r.pattern.nan_to_num(-1.0), -1.0).argmax(-1)
        want = m[..., idx].sum(-1).gather(-1, top[..., None]).mean()
        assert row["at_top_key"] == pytest.approx(float(want), abs=1e-9)
        score = float(c.scores[c.graph.parse_edge(row["edge"])])
        assert row["edge_score"] == pytest.approx(score)
    assert df.at_top_key.abs().is_monotonic_decreasing
    assert len(circuit_qk(hm, c, pairs, max_heads=1).attributions) == 1
    with pytest.raises(TypeError, match="Circuit"):
        circuit_qk(hm, "circuit", pairs)
    with pytest.raises(ValueError, match="max_heads"):
        circuit_qk(hm, c, pairs, max_heads=0)
