"""`Circuit.select`: re-cutting a saved circuit without rescoring (issue 40, item 3), and the
default circuit size read from the faithfulness curve (item 4)."""

from __future__ import annotations

import pytest
import torch

from heads.scorers.circuits import Circuit, evaluate, find_circuit, graph_of, select
from heads.scorers.circuits.circuit import size_for_faithfulness
from heads.scorers.circuits.scores import EdgeScores
from heads.scorers.patching import pairs_from_tokens
from tests.support.families import tiny_family_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def qwen2():
    return tiny_family_model("qwen2")


def _pairs():
    g = torch.Generator().manual_seed(3)
    clean = torch.randint(3, 300, (2, 5), generator=g).tolist()
    corr = torch.randint(3, 300, (2, 5), generator=g).tolist()
    return pairs_from_tokens(clean, corr, [5, 6], [40, 41])


@pytest.fixture(scope="module")
def found(qwen2):
    return find_circuit(qwen2, _pairs(), method="eap", size=20, sizes=(2, 20, 50, 100), progress=False)


def test_select_recuts_like_a_fresh_selection(qwen2, found, tmp_path):
    g = graph_of(qwen2)
    sc = EdgeScores(g, found.scores, "eap", found.metric, 2)
    again = Circuit.load(found.save(tmp_path / "c.json"), qwen2)
    for kw, n in (({"edges": 30}, 30), ({"fraction": 0.5}, round(0.5 * g.n_edges))):
        cut = again.select(**kw)
        assert torch.equal(cut.mask, select(sc, n).mask)  # the oracle: a fresh selection from the scores
        assert cut.curve == found.curve and cut.method == "eap" and cut.params["n"] == n
    # at a size of the curve its faithfulness is the curve's point, which an exact evaluation confirms
    at50 = again.select(fraction=0.5)
    assert at50.faithfulness == pytest.approx(float(evaluate(qwen2, _pairs(), at50)[0]), abs=1e-4)
    assert again.select(edges=30).faithfulness is None  # not a curve size: unknown until evaluated
    thr = float(found.scores.nan_to_num(0).abs().flatten().topk(10).values[-1])
    assert torch.equal(again.select(threshold=thr).mask, select(sc, threshold=thr).mask)


def test_select_by_faithfulness_takes_the_smallest_size_reaching_it(found):
    curve = found.curve
    for target in (0.0, 0.5, 0.99, 1.0):
        want = min(n for n, f in zip(curve["n_edges"], curve["faithfulness"], strict=True) if f >= target)
        cut = found.select(faithfulness=target)
        assert cut.params["n"] == want and cut.faithfulness >= target
    with pytest.raises(ValueError, match="no circuit of the curve reaches faithfulness 1.5: the best is"):
        found.select(faithfulness=1.5)
    with pytest.raises(ValueError, match="exactly one of"):
        found.select(edges=3, fraction=0.1)
    with pytest.raises(ValueError, match="exactly one of"):
        found.select()
    with pytest.raises(ValueError, match="fraction"):
        found.select(fraction=1.5)
    bare = Circuit(found.graph, found.mask, found.scores, "eap")
    with pytest.raises(ValueError, match="faithfulness curve"):
        bare.select(faithfulness=0.5)
    assert size_for_faithfulness({"n_edges": [5, 9], "faithfulness": [0.7, 0.4], "sizes": [1, 2]}, 0.5) == 5


def test_default_circuit_is_the_smallest_reaching_the_documented_faithfulness(qwen2):
    from heads.scorers.circuits import DEFAULT_FAITHFULNESS, faithfulness_curve
    from heads.scorers.circuits.scores import edge_scores

    p = _pairs()
    sizes = (2, 20, 50, 100)
    c = find_circuit(qwen2, p, method="eap", sizes=sizes, progress=False)
    curve = faithfulness_curve(qwen2, p, edge_scores(qwen2, p, method="eap", progress=False), sizes=sizes)
    want = min(
        n for n, f in zip(curve["n_edges"], curve["faithfulness"], strict=True) if f >= DEFAULT_FAITHFULNESS
    )
    assert c.params["n"] == want and c.faithfulness >= DEFAULT_FAITHFULNESS
    assert c.faithfulness == pytest.approx(float(evaluate(qwen2, p, c)[0]), abs=1e-4)
    assert c.params["faithfulness_target"] == DEFAULT_FAITHFULNESS
    quiet = find_circuit(qwen2, p, method="eap", sizes=sizes, curve=False, faithfulness=0.9, progress=False)
    assert quiet.curve is None and quiet.faithfulness >= 0.9
    # the request form carries the same target to find_circuit
    from heads import CircuitRequest, SweepOptions, run

    req = CircuitRequest.from_json(
        CircuitRequest(method="eap", sizes=sizes, curve=False, faithfulness=0.9).to_json()
    )
    assert torch.equal(run(qwen2, req, p, options=SweepOptions(progress=False)).mask, quiet.mask)
    with pytest.raises(ValueError, match="at most one of"):
        CircuitRequest(size=5, faithfulness=0.5)
    with pytest.raises(ValueError, match="at most one of"):
        find_circuit(qwen2, p, size=5, faithfulness=0.5, progress=False)


def test_a_circuit_holding_most_heads_warns(found):
    g = found.graph
    with pytest.warns(UserWarning, match=rf"holds \d+ of the model's {g.n_layers * g.n_heads} heads"):
        big = found.select(fraction=1.0)
    assert len(big.heads) > g.n_layers * g.n_heads / 2
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found.select(edges=1)  # one edge: one head at most, no warning


def test_find_circuit_rows_per_forward_follow_the_memory_budget(qwen2, monkeypatch):
    """Without `batch_rows`, the exact runs take as many rows as `MAX_MEMORY_GB` allows
    (`circuit_rows`; issue 40, item 6), and the rows per forward never change the circuit."""
    import heads.scorers.circuits.circuit as mod

    seen = []
    curve, ev = mod.faithfulness_curve, mod.evaluate
    monkeypatch.setattr(
        mod, "faithfulness_curve", lambda *a, **k: seen.append(k["options"].max_rows) or curve(*a, **k)
    )
    monkeypatch.setattr(mod, "evaluate", lambda *a, **k: seen.append(k["options"].max_rows) or ev(*a, **k))
    p = _pairs()
    g = graph_of(qwen2)
    # a row as large as a quarter of the budget: 4 rows per forward on the tiny model
    import heads.planning.eap as eap_plan

    per_node = mod.MAX_MEMORY_GB * 2**30 / (4 * g.n_upstream * qwen2.d_model * p.width)
    monkeypatch.setattr(eap_plan, "CIRCUIT_ROW_BYTES_PER_NODE", per_node * 0.999)
    assert mod.circuit_rows(g, qwen2.d_model, p.width, d_head=qwen2.d_head) == 4
    c = find_circuit(qwen2, p, method="eap", size=20, sizes=(2, 20, 50, 100), progress=False)
    assert seen and set(seen) == {4}
    same = find_circuit(
        qwen2, p, method="eap", size=20, sizes=(2, 20, 50, 100), progress=False, batch_rows=64
    )
    assert torch.equal(c.mask, same.mask) and c.faithfulness == pytest.approx(same.faithfulness, abs=1e-5)
    # the request form: no options -> the same budget; SweepOptions(max_memory=...) -> rows within it
    from heads import CircuitRequest, SweepOptions, run

    req = CircuitRequest(method="eap", size=20, sizes=(2, 20, 50, 100))
    seen.clear()
    run(qwen2, req, p)
    assert set(seen) == {4}
    seen.clear()
    run(qwen2, req, p, options=SweepOptions(progress=False, max_memory=int(mod.MAX_MEMORY_GB * 2**30) // 2))
    assert set(seen) == {2}


def test_select_refuses_a_cut_that_keeps_no_edge(found):
    with pytest.raises(ValueError, match=r"select\(threshold=1e\+30\) keeps no edge"):
        found.select(threshold=1e30)
    smallest = found.curve["n_edges"][0]
    cut = found.select(faithfulness=-1e30)  # the smallest circuit of the curve, which has edges
    assert cut.params["n"] == smallest and cut.n_edges > 0


def test_a_one_point_curve_saves_nan_as_null_and_loads_it_back(qwen2, tmp_path):
    import json
    import math

    c = find_circuit(qwen2, _pairs(), method="eap", sizes=[5.0], progress=False)
    assert math.isnan(c.curve["cpr"])  # one point: no area under the curve
    path = c.save(tmp_path / "c.json")
    assert json.loads(path.read_text())["curve"]["cpr"] is None  # JSON has no NaN
    back = Circuit.load(path, qwen2)
    assert math.isnan(back.curve["cpr"]) and back.curve["n_edges"] == c.curve["n_edges"]
    assert torch.equal(back.mask, c.mask)


def test_a_budget_below_one_exact_evaluation_row_is_refused_before_any_score(qwen2, monkeypatch):
    """`find_circuit(options=SweepOptions(max_memory=...))`: the exact evaluations (the curve, the
    circuit's faithfulness) need `circuit_eval_bytes` for one pair (its recorded runs and one row)
    beside the weights and a forward; a budget below that, or below the edge scores' own minimum
    plan, is refused naming the larger before the edge scores run (it took 1 row and went over the
    budget: 6.8 GB against 1.5 GiB at 977 tokens on SmolLM2; then it named a minimum the edge
    scores refused again)."""
    import heads.scorers.circuits.circuit as mod
    from heads import SweepOptions
    from heads.errors import HeadsteerValueError

    p = _pairs()
    g = graph_of(qwen2)
    from heads.planning.eap import circuit_eval_bytes
    from heads.planning.plan import geometry

    per_row = circuit_eval_bytes(geometry(qwen2.model.config), p.width)  # one pair's runs + one row
    assert mod.circuit_rows(g, qwen2.d_model, p.width, (per_row - 1) / 2**30, d_head=qwen2.d_head) == 1

    def no_scores(*a, **k):
        raise AssertionError("the edge scores ran")

    monkeypatch.setattr(mod, "chunked_edge_scores", no_scores)
    with pytest.raises(
        HeadsteerValueError,
        match=r"needs at least \S+ \wB for one pair of 5 tokens \(the weights and a forward, the edge "
        r"scores, and the exact evaluations.*max_memory",
    ):
        find_circuit(qwen2, p, method="eap", options=SweepOptions(progress=False, max_memory=per_row - 1))
    assert mod.circuit_rows(g, qwen2.d_model, p.width, per_row / 2**30, strict=True, d_head=qwen2.d_head) == 1


def test_the_circuit_plan_counts_the_exact_evaluations():
    """`plan_memory` / `minimum_plan` of a `CircuitRequest`: at least a forward plus one row of the
    exact evaluations (`circuit_eval_bytes`), which on SmolLM2's geometry at 1k tokens is far above
    the EAP scores' own plan; the scores alone (`"eap"`) stay below it."""
    from transformers import LlamaConfig

    from heads import CircuitRequest
    from heads.planning import plan_memory
    from heads.planning.budget import check_budget, minimum_plan
    from heads.planning.eap import circuit_eval_bytes
    from heads.planning.plan import geometry

    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    )  # fmt: skip
    req = CircuitRequest(method="eap")
    evals = circuit_eval_bytes(geometry(cfg), 1024)
    # 1,024 tokens: a row's 301 full differences (710 MB) pass 512 MiB, so the row is compact:
    # the corrupted run's recorded activations (121 streams; the clean run keeps its logits only)
    # plus input + MLPs + head outputs (61) and the working set: 15 deltas, 9 heads, 4 x 3 norms
    assert evals == int(121 * 576 * 1024 * 4 + 4 * (1 + 30 * 2 + 15 + 9 + 12) * 576 * 1024)
    assert circuit_eval_bytes(geometry(cfg), 256) == 2 * 121 * 576 * 256 * 4 + 8 * 301 * 576 * 256
    circuit = plan_memory(cfg, req, 1024).devices[0].activations
    scores = plan_memory(cfg, "eap", 1024).devices[0].activations
    forward = plan_memory(cfg, "forward", 1024).devices[0].activations
    assert scores < evals < circuit <= forward + evals + scores
    least = minimum_plan(cfg, req, 1024)
    assert least.devices[0].activations >= evals
    with pytest.raises(Exception, match="needs at least"):
        check_budget(cfg, req, 1024, least.peak - 1)
    check_budget(cfg, req, 1024, least.peak)
