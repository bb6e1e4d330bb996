"""`headsteer report circuit`: find a circuit on IOI / Colored Objects / a pairs file and show it.

The page: the circuit graph (`viz.circuits.circuit_figure`), the faithfulness curve against
random circuits of the same sizes (CPR / CMD), the head-level view (summed |edge score| per
head) and the top edges table. The circuit itself is saved beside the page as JSON
(`Circuit.save`) when `circuit_json` is given.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from heads import HeadModel
from heads._util.files import check_output
from heads._util.progress import ProgressArg, progress_callback
from heads.errors import HeadsteerValueError
from heads.results.stability import check_stability
from heads.scorers.circuits import SIZES, Circuit, edge_scores, evaluate, faithfulness_curve, select
from heads.scorers.circuits.circuit import _check_sizes, _n_of, circuit_stability
from heads.scorers.circuits.graph import graph_of
from heads.scorers.patching import PairBatch, encode_pairs, load_pairs
from viz.circuits import circuit_figure, curve_figure
from viz.reports.base import Report

__all__ = ["TASKS", "circuit_report", "circuit_steps", "task_pairs"]

TASKS = ("ioi", "colored_objects")
"""Shipped pair sets `--task` accepts by name (any other value is a JSONL pairs file)."""


def circuit_steps() -> int:
    """Progress units of `circuit_report`: scores, selection + evaluation, curve, page."""
    return 4


def task_pairs(model: HeadModel, task: str | os.PathLike, n: int, split: str = "test") -> PairBatch:
    """A `PairBatch` of the first `n` pairs of a shipped task or of a JSONL pairs file.

    Raises:
        ValueError: an unknown task that is not a file, or pairs the tokenizer cannot align.
    """
    from probes.datasets.pairs import load_task_pairs

    if isinstance(task, str) and task in TASKS:
        pairs = load_task_pairs(task, split=split, n=n)
    else:
        pairs = load_pairs(task)[:n]
    return encode_pairs(model, pairs)


def circuit_report(
    model: HeadModel,
    out: str | Path,
    *,
    task: str | os.PathLike = "ioi",
    method: str = "eap-ig",
    n_pairs: int = 16,
    size: float = 5.0,
    steps: int = 5,
    sizes: Sequence[float] = SIZES,
    overwrite: bool = False,
    circuit_json: str | Path | None = None,
    progress: ProgressArg = True,
    stability: int = 0,
) -> tuple[Circuit, dict]:
    """Score every edge on `n_pairs` pairs of `task`, select the top `size` % of the edges,
    evaluate it and its faithfulness curve exactly, and write the page to `out`.

    `stability`: bootstrap resamples of the pairs (default 0: none): each edge's inclusion
    frequency in the re-selected circuit and the ranking's stability, on the page and in the
    summary (`circuit_stability`, no extra forward).

    Returns:
        `(circuit, summary)`; summary: edges, heads, faithfulness, CPR / CMD (method and random),
        and with `stability` its summary (top-k Jaccard, stable edges).

    Raises:
        ValueError: `out` (or `circuit_json`) exists without `overwrite`; a refused family; bad
            sizes; all before any forward.
    """
    check_output(out, overwrite)
    if circuit_json is not None:
        check_output(circuit_json, overwrite)
    graph = graph_of(model)
    stability = check_stability(stability)
    (size,) = _check_sizes([size])
    sizes = _check_sizes(sizes)
    pairs = task_pairs(model, task, n_pairs)
    if stability and pairs.n < 2:
        raise HeadsteerValueError(f"stability={stability} needs at least 2 pairs, got {pairs.n}")
    with progress_callback(progress, "circuit report", "steps") as report:
        tick = (lambda i: report(i, circuit_steps())) if report is not None else (lambda i: None)
        tick(0)
        sc = edge_scores(model, pairs, method=method, steps=steps, progress=False)
        tick(1)
        c = select(sc, _n_of(graph, size))
        if stability:
            c.stability = circuit_stability(sc, stability, n=_n_of(graph, size), pairs=pairs)
        c.faithfulness = float(evaluate(model, pairs, c)[0])
        tick(2)
        c.curve = faithfulness_curve(model, pairs, sc, sizes=sizes)
        c.params.update(task=str(task), n_pairs=pairs.n, size=size)
        tick(3)
        frame = c.to_frame()
        rep = Report(
            f"Circuit ({method}) on {Path(str(task)).name}",
            model.name,
            {"task": str(task), "method": method, "pairs": pairs.n, "size %": size, "steps": steps},
        )
        rep.figure(
            "Circuit graph",
            circuit_figure(c),
            note=f"The top {size:g} % of the edges by |{method} score|, pruned; node size = importance, "
            "edge width = |score|, red = the metric rises when the edge is corrupted, blue = it falls.",
        )
        rep.figure(
            "Faithfulness curve",
            curve_figure(c.curve, method=method),
            note="f(C) = (M(C) - M(corrupt)) / (M(clean) - M(corrupt)) with every edge outside C corrupted, "
            "exact forwards; random circuits of the same sizes for comparison.",
        )
        hs = c.head_scores()
        from viz.figures import head_heatmap

        rep.figure(
            "Heads",
            head_heatmap(hs),
            note="Per head, the summed |score| of all its edges (the head-level view, a HeadScores).",
        )
        if c.stability is not None:
            from viz.figures import stability_bars

            st = c.stability
            rep.figure(
                "Edge stability",
                stability_bars(st, 20),
                note=f"Bootstrap over the {pairs.n} pairs ({st.n_resamples} resamples): each edge's score "
                "with its 95% interval; * stable: in the top k of at least 95% of the resamples.",
            )
            inc = st.to_frame().sort_values("inclusion", ascending=False, kind="stable")
            rep.table(
                "Edge inclusion frequency",
                inc[["item", "inclusion", "p_top_k", "rank", "rank_low", "rank_high"]],
                max_rows=40,
                note="Share of resamples whose circuit (same size, pruned) holds the edge.",
            )
            share = dict(
                zip(
                    st.names, (st.inclusion if st.inclusion is not None else st.p_top_k).tolist(), strict=True
                )
            )
            frame["inclusion"] = [share[e] for e in frame["edge"]]
        rep.table("Top edges", frame, max_rows=40, note="Circuit edges by decreasing |score|.")
        rep.save(out, overwrite=overwrite)
        if circuit_json is not None:
            c.save(circuit_json, overwrite=overwrite)
        tick(4)
    curve = c.curve
    summary = {
        "edges": c.n_edges,
        "graph_edges": graph.n_edges,
        "heads": len(c.heads.heads),
        "faithfulness": c.faithfulness,
        "cpr": curve["cpr"],
        "cmd": curve["cmd"],
        "cpr_random": curve["cpr_random"],
        "cmd_random": curve["cmd_random"],
        "top_edges": frame["edge"].head(10).tolist(),
    }
    if c.stability is not None:
        s = c.stability.summary()
        summary["stability"] = {k: v for k, v in s.items() if k != "stable"} | {"stable": s["stable"][:20]}
    return c, summary
