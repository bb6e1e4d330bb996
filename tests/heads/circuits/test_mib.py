"""MIB format in and out, and MIB's CPR / CMD, against MIB's own code re-implemented as an oracle
(`tests/support/mib_reference.py`, cited there) on a tiny Llama without GQA."""

from __future__ import annotations

import json

import pytest
import torch

from heads.errors import HeadsteerValueError
from heads.scorers.circuits import Circuit, EdgeScores, graph_of, select
from heads.scorers.circuits.mib import SUBMISSION_SIZES, mib_curve, mib_edge_names
from heads.scorers.patching import pairs_from_tokens
from tests.support import mib_reference as ref
from tests.support.families import tiny_family_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llama():
    return tiny_family_model("llama", num_key_value_heads=4)


def _pairs(n: int = 4, t: int = 6):
    g = torch.Generator().manual_seed(11)
    clean = torch.randint(3, 300, (n, t), generator=g)
    corr = torch.randint(3, 300, (n, t), generator=g)
    ans, cf = torch.randint(3, 300, (n,), generator=g), torch.randint(3, 300, (n,), generator=g)
    return pairs_from_tokens(clean.tolist(), corr.tolist(), ans.tolist(), cf.tolist())


def _random_scores(model, seed: int = 0) -> EdgeScores:
    g = graph_of(model)
    s = torch.randn(g.n_upstream, g.n_downstream, generator=torch.Generator().manual_seed(seed))
    return EdgeScores(g, s.masked_fill(~g.valid, float("nan")), "eap", params={"d_model": model.d_model})


def test_reference_forward_is_the_model(llama):
    p = _pairs()
    with torch.no_grad():
        own = llama.model(input_ids=p.clean_ids).logits[:, -1]
    got, _ = ref._run(llama.model, p.clean_ids, None, None)
    torch.testing.assert_close(got, own, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("absolute", [True, False])
def test_cpr_cmd_equal_mib_evaluation(llama, tmp_path, absolute):
    p = _pairs()
    sc = _random_scores(llama)
    ours = mib_curve(llama, p, sc, absolute=absolute)
    circuit = select(sc, 10)
    (path,) = circuit.to_mib(tmp_path / "importances.json")
    mg = ref.MibGraph.from_json(path)
    assert len(mg.edges) == len(mib_edge_names(sc.graph))
    faith, cpr, cmd, counts = ref.evaluate_area_under_curve(
        llama.model, mg, p.clean_ids, p.corrupted_ids, p.answers[:, 0], p.counterfactuals[:, 0], absolute
    )
    assert ours["weighted_edge_counts"] == counts
    assert ours["n_edges"] == [int(x * len(mg.edges)) for x in ref.PERCENTAGES]
    torch.testing.assert_close(torch.tensor(ours["faithfulness"]), torch.tensor(faith), atol=2e-4, rtol=0)
    assert ours["cpr"] == pytest.approx(cpr, abs=2e-4)
    assert ours["cmd"] == pytest.approx(cmd, abs=2e-4)
    assert ours["faithfulness"][-1] == pytest.approx(1.0, abs=1e-5)


def test_importances_file_is_mibs_layout(llama, tmp_path):
    sc = _random_scores(llama, seed=3)
    c = select(sc, 25)
    (path,) = c.to_mib(tmp_path / "c.json")
    d = json.loads(path.read_text())
    assert set(d) == {"cfg", "nodes", "edges"}
    assert d["cfg"] == {"n_layers": 2, "n_heads": 4, "parallel_attn_mlp": False, "d_model": 64}
    mg = ref.MibGraph.from_json(path)
    # every MIB edge has minus headsteer's score; the circuit's edges are in the graph
    g = sc.graph
    for name, u, v, _ in mib_edge_names(g):
        assert mg.scores[mg.edges[name]] == pytest.approx(-float(sc.scores[u, v]), abs=1e-6)
        assert bool(mg.in_graph[mg.edges[name]]) == bool(c.mask[u, v])
    assert "a0.h1->a1.h2<k>" in d["edges"] and "m1->logits" in d["edges"]
    back = Circuit.from_mib(path, llama)
    assert torch.equal(back.mask, c.mask)
    torch.testing.assert_close(back.scores, sc.scores, equal_nan=True)


def test_gqa_round_trip_and_nine_binary_circuits(tmp_path):
    gqa = tiny_family_model("llama")  # 4 query heads, 2 KV heads
    sc = _random_scores(gqa, seed=5)
    c = select(sc, 40)
    (path,) = c.to_mib(tmp_path / "gqa.json")
    d = json.loads(path.read_text())
    assert len(d["edges"]) == len(mib_edge_names(sc.graph)) > sc.graph.n_edges  # un-grouped k / v
    back = Circuit.from_mib(path, gqa)
    torch.testing.assert_close(back.scores, sc.scores, equal_nan=True, atol=1e-6, rtol=1e-6)
    assert torch.equal(back.mask, c.mask)
    files = c.to_mib(tmp_path / "nine", binary=True)
    assert [f.name for f in files] == [f"edges_{s:g}.json" for s in SUBMISSION_SIZES]
    n_mib = len(d["edges"])
    for size, f in zip(SUBMISSION_SIZES, files, strict=True):
        kept = sum(e["in_graph"] for e in json.loads(f.read_text())["edges"].values())
        assert kept <= int(size / 100 * n_mib) * 2  # a KV edge counts once per query head of its group


def test_bad_input(llama, tmp_path):
    sc = _random_scores(llama)
    c = select(sc, 5)
    c.to_mib(tmp_path / "a.json")
    with pytest.raises(HeadsteerValueError, match="exists"):
        c.to_mib(tmp_path / "a.json")
    bare = Circuit(c.graph, c.mask, c.scores)
    with pytest.raises(HeadsteerValueError, match="d_model"):
        bare.to_mib(tmp_path / "b.json")
    d = json.loads((tmp_path / "a.json").read_text())
    del d["edges"]["input->a0.h0<q>"]
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(HeadsteerValueError, match="input->a0.h0<q>"):
        Circuit.from_mib(tmp_path / "bad.json", llama)
    with pytest.raises(HeadsteerValueError, match="does not exist"):
        Circuit.from_mib(tmp_path / "none.json")
    with pytest.raises(HeadsteerValueError, match="layers"):
        Circuit.from_mib(tmp_path / "a.json", tiny_family_model("llama", num_hidden_layers=3))
