"""`headsteer report circuit`: find a circuit on IOI / Colored Objects / a pairs file and show it.

The page: the circuit graph (`viz.circuits.circuit_figure`) and its heads-only view, the
faithfulness curve against random circuits of the same sizes (CPR / CMD), the head-level view
(summed |edge score| per head) and the top edges table. The circuit itself is saved beside the
page as JSON (`Circuit.save`) when `circuit_json` is given.

Its size: by default the smallest size of the curve whose exact faithfulness reaches
`faithfulness` (`DEFAULT_FAITHFULNESS`, 0.3); `size=` fixes it instead. A circuit holding more
than half of the model's heads is flagged on the page, in the summary and by a warning.

Memory: the exact evaluations (curve and circuit) run `batch_rows` rows per forward, chosen so
that their activations stay within `max_memory` GiB (`circuit_rows`); EAP / EAP-IG run
`batch_size` pairs per chunk and need less (about 0.75 GiB above the model for 8 pairs on
SmolLM2-135M). Measured on SmolLM2-135M, IOI, fp32 CPU: 16 pairs (the default) 200 s and 2.7 GiB
peak RSS with the default budget of 2 GiB, the model alone 1.0 GiB.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from heads import HeadModel
from heads._util.files import check_output, write_text
from heads._util.progress import ProgressArg, progress_callback
from heads._util.validation import check_number
from heads.engine.options import SweepOptions
from heads.errors import HeadsteerValueError
from heads.planning.units import parse_gib
from heads.results.storage import json_text
from heads.scorers.circuits import (
    DEFAULT_FAITHFULNESS,
    SIZES,
    Circuit,
    size_for_faithfulness,
)
from heads.scorers.circuits.circuit import (
    MAX_MEMORY_GB,
    MOST_HEADS,
    circuit_rows,
)
from heads.scorers.circuits.graph import graph_of
from heads.scorers.circuits.request import CircuitRequest
from heads.scorers.patching import PairBatch, encode_pairs, load_pairs
from viz.circuits import circuit_figure, curve_figure
from viz.reports.base import Report

__all__ = ["MAX_MEMORY_GB", "TASKS", "circuit_report", "circuit_rows", "circuit_steps", "task_pairs"]

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
    size: float | None = None,
    steps: int = 5,
    sizes: Sequence[float] = SIZES,
    overwrite: bool = False,
    circuit_json: str | Path | None = None,
    progress: ProgressArg = True,
    stability: int = 0,
    faithfulness: float | None = None,
    confirm: int = 0,
    max_memory: float | str = MAX_MEMORY_GB,
    graph_threshold: float | None = None,
    request: CircuitRequest | None = None,
) -> tuple[Circuit, dict]:
    """Score every edge on `n_pairs` pairs of `task`, evaluate the faithfulness curve exactly,
    cut the circuit, and write the page to `out`.

    The circuit is found by `heads.run` on a `CircuitRequest` (`heads.find_circuit`'s request):
    `request`, or the one built from `method`, `size`, `steps`, `sizes`, `stability`,
    `faithfulness` and `confirm` (which may then not be given too).

    Args:
        size: the circuit's size in % of the edges; default None: the smallest size of `sizes`
            whose exact faithfulness reaches `faithfulness` (the most faithful size, with a
            warning, when none does and `faithfulness` is left at None).
        faithfulness: the target of the default size (default None: `DEFAULT_FAITHFULNESS`,
            0.3); not with `size`.
        confirm: rerun the top `confirm` edges with exact edge patching (default 0): their
            exact scores fill the table's `exact` column (left out when 0).
        stability: bootstrap resamples of the pairs (default 0: none): each edge's inclusion
            frequency in the re-selected circuit and the ranking's stability, on the page and in
            the summary (`circuit_stability`, no extra forward).
        max_memory: GiB the run's planned peak may take, weights included (default 2; the
            exact evaluations' rows by `circuit_rows`), or a size with a unit (`"24GB"`,
            `"512MiB"`; `heads.planning.parse_gib`); >= 1 MiB.
        graph_threshold: draw only the circuit's edges with |score| >= this in both graphs
            (default None: every edge, up to `circuit_figure`'s 400 largest); the circuit, its
            table and its faithfulness are unchanged.
        request: the circuit request itself (the CLI's, checked before the model loaded); its
            `n` / `threshold` are refused (the page cuts by size) and `curve` must be True.

    Returns:
        `(circuit, summary)`; summary: edges, heads, faithfulness, size, CPR / CMD (method and
        random), `most_heads` (the circuit holds more than half of the heads), and with
        `stability` its summary (top-k Jaccard, stable edges).

    Raises:
        ValueError: `out` (or `circuit_json`) exists without `overwrite`; a refused family; what
            `CircuitRequest` refuses (sizes, faithfulness, confirm, steps); a bad max_memory or
            graph_threshold (a number >= 0); all before any forward.
    """
    if request is None:
        request = CircuitRequest(
            method=method, size=size, steps=steps, sizes=sizes, stability=stability,
            faithfulness=faithfulness, confirm=confirm,
        )  # fmt: skip
    elif (method, size, steps, tuple(sizes), stability, faithfulness, confirm) != (
        "eap-ig", None, 5, SIZES, 0, None, 0,
    ):  # fmt: skip
        raise HeadsteerValueError("give the request, or its values as keywords, not both")
    if request.n is not None or request.threshold is not None or not request.curve:
        raise HeadsteerValueError(
            "the circuit report cuts by size or faithfulness and draws the curve: give a request "
            "without n / threshold and with curve=True"
        )
    check_output(out, overwrite)
    if circuit_json is not None:
        check_output(circuit_json, overwrite)
    graph = graph_of(model)
    max_memory = parse_gib(max_memory, "max_memory")
    if graph_threshold is not None:
        graph_threshold = check_number("graph_threshold", graph_threshold, lo=0)
    method, size, steps = request.method, request.size, request.steps
    confirm, target = request.confirm, request.faithfulness
    pairs = task_pairs(model, task, n_pairs)  # find_circuit refuses stability on one pair
    options = SweepOptions(progress=False, max_memory=int(max_memory * 2**30))
    with progress_callback(progress, "circuit report", "steps") as report:
        tick = (lambda i: report(i, circuit_steps())) if report is not None else (lambda i: None)
        tick(0)
        from heads import run

        c = run(model, request, pairs, options=options)
        curve = c.curve
        tick(2)
        by_target = size is None
        if size is None:
            target = DEFAULT_FAITHFULNESS if target is None else target
            n = _curve_size(curve, target)
            size = 100.0 * n / graph.n_edges
            chosen = f"the smallest size of the curve reaching faithfulness {target:g}"
        else:
            chosen = f"size {size:g} % (--size)"
        c.params.update(task=str(task), n_pairs=pairs.n, size=size, faithfulness_target=target)
        n_heads, all_heads = len(c.heads), graph.n_layers * graph.n_heads
        most = n_heads > MOST_HEADS * all_heads  # find_circuit warned (warn_most_heads)
        tick(3)
        frame = c.to_frame()
        if not confirm:
            frame = frame.drop(columns="exact")  # no edge was confirmed: the column would be all NaN
        rep = Report(
            f"Circuit ({method}) on {Path(str(task)).name}",
            model.name,
            {"task": str(task), "method": method, "pairs": pairs.n, "size %": round(size, 3), "steps": steps},
        )
        if most:
            rep.text(
                "Most heads",
                f"This circuit holds {n_heads} of the model's {all_heads} heads (more than "
                f"{MOST_HEADS:.0%}): ablating its heads is close to ablating the model and says little "
                "about this circuit. Cut a smaller one: --size, or Circuit.select(fraction=...) on the "
                "saved circuit.",
            )
        sign = (
            f"{method} score = the change of the logit difference when the edge alone is corrupted "
            "(noising): blue (< 0) = the edge supports the answer, red (> 0) = it works against it"
        )
        shown = "" if graph_threshold is None else f" Drawn: the edges with |score| >= {graph_threshold:g}."
        rep.figure(
            "Circuit graph",
            circuit_figure(c, threshold=graph_threshold),
            note=f"{c.n_edges} edges ({size:.3g} % of {graph.n_edges}, {chosen}, f = {c.faithfulness:.3f}), "
            f"pruned; {n_heads} of {all_heads} heads. Node size = importance, edge width = |score|; "
            f"{sign}.{shown}",
        )
        rep.figure(
            "Circuit graph, heads only",
            circuit_figure(c, heads_only=True, threshold=graph_threshold),
            note="The same circuit with the MLPs, the input and their edges left out: head-to-head "
            f"edges (into a head's query, key or value) and heads to the logits.{shown}",
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
        rep.table(
            "Top edges",
            frame,
            max_rows=40,
            note=f"Circuit edges by decreasing |score|; {sign}."
            + (f" exact: the top {confirm} edges rerun with exact edge patching." if confirm else ""),
        )
        # every output rendered before any is written: a report writes all its files or none
        body = None if circuit_json is None else json_text(c.to_dict(), indent=1)
        rep.save(out, overwrite=overwrite)
        if circuit_json is not None and body is not None:
            write_text(circuit_json, body, overwrite=overwrite)
        tick(4)
    summary = {
        "edges": c.n_edges,
        "graph_edges": graph.n_edges,
        "heads": n_heads,
        "model_heads": all_heads,
        "most_heads": most,
        "size": size,
        "faithfulness": c.faithfulness,
        "faithfulness_target": target if by_target else None,
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


def _curve_size(curve: dict, target: float) -> int:
    """The edges of the smallest curve size reaching `target` (`size_for_faithfulness`), else the
    most faithful size's (as `find_circuit` chose, having warned)."""
    try:
        return size_for_faithfulness(curve, target)
    except HeadsteerValueError:
        return int(max(zip(curve["faithfulness"], curve["n_edges"], strict=True))[1])
