"""The circuit-reuse study's pieces: circuit overlap, role overlap, the distractor markup."""

from __future__ import annotations

import pytest

from heads.scorers.circuits import edge_scores, select
from heads.scorers.patching.pairs import encode_pairs
from probes.datasets.pairs import load_task_pairs
from probes.studies.circuit_reuse import _co_colours, _co_marked, _ioi_marked, circuit_overlap, role_overlap


@pytest.fixture(scope="module")
def circuits(tiny_llama):
    pairs = encode_pairs(tiny_llama, load_task_pairs("ioi", "test", n=2))
    scores = edge_scores(tiny_llama, pairs, method="eap", progress=False)
    small, big = select(scores, 40), select(scores, 80)  # no edge pruned away at these sizes
    assert small.n_edges == 40 and big.n_edges == 80
    return small, big


def test_a_circuit_overlaps_itself_fully_and_a_sub_circuit_by_its_share(circuits):
    small, big = circuits
    same = circuit_overlap(small, small)
    assert same["edges_jaccard"] == 1.0 and same["edges_weighted"] == pytest.approx(1.0)
    assert same["heads_jaccard"] == 1.0
    o = circuit_overlap(small, big)
    fs, fb = small.to_frame(), big.to_frame()
    assert set(fs["edge"]) <= set(fb["edge"])  # the top 40 edges are among the top 80
    assert o["edges_jaccard"] == pytest.approx(len(fs) / len(fb))
    assert o["edges_weighted"] == pytest.approx(fs["score"].abs().sum() / fb["score"].abs().sum(), rel=1e-6)


def test_role_overlap_counts_heads_per_role(circuits):
    small, big = circuits
    roles = {f"L{la}.H{h}": ("induction" if h == 0 else "none") for la in range(3) for h in range(4)}
    rows = {r["role"]: r for r in role_overlap(roles, small, big)}
    n_small = sum(1 for _, h in small.heads if h == 0)
    n_big = sum(1 for _, h in big.heads if h == 0)
    assert rows["induction"]["a"] == n_small and rows["induction"]["b"] == n_big


def test_distractors_are_marked():
    co = load_task_pairs("colored_objects", "test", n=3)
    for p in co:
        marked = _co_marked(p)
        colours = _co_colours(p.clean)
        assert len(colours) == 3 and p.answer.strip() in colours
        for c in colours:
            assert (f"**{c}**" in marked) == (c != p.answer.strip())
    ioi = load_task_pairs("ioi", "test", n=1)[0]
    s = ioi.meta["s"]
    assert _ioi_marked(ioi).endswith(ioi.clean[ioi.clean.rfind(s) + len(s) :])
    assert _ioi_marked(ioi).count(f"**{s}**") == 1 and ioi.clean.count(s) == 2
