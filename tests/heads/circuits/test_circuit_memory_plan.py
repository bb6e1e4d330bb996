"""The circuit's exact-evaluation memory plan (`circuit_rows` / `circuit_eval_bytes`) counts the
recorded clean / corrupted runs of every pair `patched_metrics` records at once (a chunk of
`min(pairs.n, batch_rows)` pairs, alive while every row runs), not of one pair: it once granted
rows whose pairs' recorded runs alone passed the budget.

Real-scale numbers (SmolLM2-135M geometry, 1,024 tokens, default 2 GiB): circuit_rows grants 8
rows (planned 2.12 GB) but 8 pairs' recorded corrupted runs alone take 2.28 GB (~4.1 GB in all).
"""

from __future__ import annotations

import torch

import heads.planning.eap as eap_plan
import heads.scorers.circuits.scores as scores_mod
from heads import SweepOptions
from heads.planning.eap import circuit_eval_bytes
from heads.scorers.circuits import evaluate, graph_of
from heads.scorers.circuits.circuit import circuit_rows
from heads.scorers.patching import pairs_from_tokens
from tests.support.families import tiny_family_model

torch.set_num_threads(1)


def _pairs(gen: torch.Generator, n: int, t: int):
    """`n` random pairs of `t` tokens whose corrupted prompt differs at position 2 (drawn from `gen`)."""
    clean = torch.randint(3, 300, (n, t), generator=gen).tolist()
    corr = [list(r) for r in clean]
    for r in corr:
        r[2] = (r[2] + 7) % 300 + 3
    return pairs_from_tokens(clean, corr, [5] * n, [40] * n)


def _bytes(acts) -> int:
    total = 0
    for f in ("input", "z", "mlp", "resid", "scale", "mid"):
        v = getattr(acts, f)
        for t in v if isinstance(v, list) else [v]:
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def test_smollm2_geometry_plan_below_the_recorded_runs_alone():
    """Pure arithmetic at the real threshold: rows granted by the plan vs what the recorded
    corrupted runs of that many pairs take (patched_metrics records min(n, batch_rows) pairs)."""
    g = dict(n_layers=30, n_heads=9, n_kv_heads=3, d_head=64, d_model=576)
    T, budget = 1024, 2 * 2**30
    recorded_one = circuit_eval_bytes(g, T, 0)  # 1 pair's corrupted run (compact: clean keeps logits)
    per_row = circuit_eval_bytes(g, T, 1) - recorded_one

    class _Geom:  # circuit_rows reads the graph's geometry only
        n_layers, n_heads, n_kv_heads, n_upstream = 30, 9, 3, 301

    rows = circuit_rows(_Geom(), 576, T, budget / 2**30, d_head=64, pairs=8)  # type: ignore[arg-type]
    assert rows > 1
    actual_lower_bound = rows * recorded_one + rows * per_row  # rows pairs recorded + rows rows
    assert actual_lower_bound <= budget, (rows, actual_lower_bound / 1e9, budget / 1e9)


def test_recorded_runs_of_a_pair_chunk_fit_the_budget_circuit_rows_plans(monkeypatch):
    """Instrumented on a tiny many-layer model, compact path (COMPACT=True, the plan told so
    too): recorded runs held + the row differences of one forward vs the budget given."""
    m = tiny_family_model("llama", num_hidden_layers=12, num_attention_heads=2, num_key_value_heads=1)
    g = graph_of(m)
    T, n = 24, 12
    gen = torch.Generator().manual_seed(0)
    pairs = _pairs(gen, n, T)
    monkeypatch.setattr(eap_plan, "CIRCUIT_PATCH_MEMORY", 1)  # the plan takes the compact row
    monkeypatch.setattr(scores_mod, "COMPACT", True)  # and so does patched_metrics
    gb = (
        circuit_eval_bytes(
            dict(n_layers=12, n_heads=2, n_kv_heads=1, d_head=m.d_head, d_model=m.d_model), T, 8
        )
    ) / 2**30  # a budget of 8 planned rows
    rows = circuit_rows(g, m.d_model, T, gb, d_head=m.d_head, pairs=n)
    assert 1 < rows < 8  # 8 rows would record 8 pairs' runs
    held = {"rec": 0, "peak": 0}
    rec = scores_mod._record
    run = scores_mod.run_graph

    def spy_record(*a, **k):
        logits, acts = rec(*a, **k)
        held["rec"] = _bytes(acts)  # compact: one recorded run (the corrupted one) per pair chunk
        return logits, acts

    def spy_run(*a, **k):
        logits, runner = run(*a, **k)
        if k.get("patch") is not None:
            d = 0 if runner.diff is None else runner.diff.numel() * 4
            d += sum(t.numel() * 4 for _, t in runner.hdiff.values())
            held["peak"] = max(held["peak"], held["rec"] + d)
        return logits, runner

    monkeypatch.setattr(scores_mod, "_record", spy_record)
    monkeypatch.setattr(scores_mod, "run_graph", spy_run)
    mask = torch.rand(g.n_upstream, g.n_downstream, generator=gen) < 0.3
    evaluate(m, pairs, (mask & g.valid)[None], options=SweepOptions(max_rows=rows, progress=False))
    assert held["peak"] <= gb * 2**30, (held["peak"], int(gb * 2**30))


def test_rows_per_forward_count_each_rows_working_set(monkeypatch):
    """`patched_metrics` sizes a forward's rows by each row's differences and its working set
    (`circuit_row_work_streams`: deltas, products, normalised copies, its own forward), not by the
    differences alone: with room for two such rows, every patched forward holds at most two
    (by the differences alone it took five times as many at 1k tokens, 1.4 GB against 0.8)."""
    from heads.planning.eap import circuit_row_work_streams
    from heads.scorers.circuits.layout import plan_geometry
    from heads.scorers.circuits.scores import needed_nodes

    m = tiny_family_model("llama")
    g = graph_of(m)
    T, n = 12, 6
    gen = torch.Generator().manual_seed(3)
    pairs = _pairs(gen, n, T)
    mask = (torch.rand(g.n_upstream, g.n_downstream, generator=gen) < 0.05) & g.valid
    patch = (g.valid & ~mask)[None]
    width = T * m.d_model * 4
    row = (needed_nodes(g, patch) + circuit_row_work_streams(plan_geometry(g, m.d_model))) * width
    monkeypatch.setattr(scores_mod, "COMPACT", False)
    monkeypatch.setattr(scores_mod, "PATCH_MEMORY", 2 * row + 1)
    seen: list[int] = []
    run = scores_mod.run_graph

    def spy(*a, **k):
        if k.get("patch") is not None:
            seen.append(int(k["patch"].shape[0]))
        return run(*a, **k)

    monkeypatch.setattr(scores_mod, "run_graph", spy)
    evaluate(m, pairs, mask[None], options=SweepOptions(max_rows=64, progress=False))
    assert seen and max(seen) == 2 and sum(seen) == n
