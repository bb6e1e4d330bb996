"""Circuits: selection, pruning, exact faithfulness, the faithfulness curve, save / load.

A circuit C is a set of edges. It is evaluated exactly (Hanna et al. 2024, Sec. 4; MIB,
Mueller et al. 2025, Sec. 3.1) by running each clean prompt x with **every edge not in C
corrupted** (its source's contribution taken from x~):

    f(C) = (M(C) - M(x~)) / (M(x) - M(x~)),    M averaged over pairs,

so the full graph has f = 1 and the empty circuit f = 0. Selection keeps the top n edges by
|score| (or by score) or those above a threshold, then prunes dangling parts: edges whose
source is not fed from the input through the circuit, and edges into nodes that no longer
reach the logits (a KV input feeds every query head of its group).

Faithfulness curve: f at circuit sizes of 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100 % of the
edges (MIB's sizes), for the method's ranking and for random circuits of the same sizes.
MIB's summaries are areas over the edge fraction k in [0, 1] (trapezoid rule):
CPR = area under f(k) (higher is better), CMD = area under |1 - f(k)| (lower is better).

This module holds the evaluation (`evaluate`, `faithfulness_curve`, `circuit_stability`) and
`find_circuit`; the `Circuit` result and `select` live in `heads.results.circuits`, the
pruning in `heads.results.graph` (both re-exported here).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from heads._util.validation import check_bool, check_int, check_number, check_seed
from heads.engine.options import SweepOptions, sweep_options
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.planning.eap import circuit_eval_bytes
from heads.planning.units import format_bytes
from heads.results.circuits import Circuit, select, warn_most_heads
from heads.results.graph import _check_sizes, _n_of, _top_mask, prune, size_for_faithfulness
from heads.results.stability import Stability
from heads.scorers.circuits.graph import Graph, graph_of
from heads.scorers.circuits.layout import plan_geometry

# Re-exported (`as` themselves): their import path `heads.scorers.circuits.circuit.<name>` stays.
from heads.results.circuits import (  # isort: skip
    MAX_HEADS as MAX_HEADS,
    MAX_LAYERS as MAX_LAYERS,
    MOST_HEADS as MOST_HEADS,
    SCHEMA as SCHEMA,
    SCHEMA_VERSION as SCHEMA_VERSION,
    _edge_index as _edge_index,
    _graph_of_dict as _graph_of_dict,
    _n_edges as _n_edges,
    _parse as _parse,
)
from heads.scorers.circuits.request import SIZES, CircuitRequest
from heads.scorers.circuits.scores import (
    EdgeScores,
    _batch_size,
    _check_pairs,
    _rows_progress,
    chunked_edge_scores,
    patched_metrics,
)
from heads.scorers.patching.metrics import Metric, get_metric
from heads.scorers.patching.pairs import PairBatch

__all__ = [
    "MAX_MEMORY_GB",
    "SIZES",
    "Circuit",
    "areas",
    "circuit_rows",
    "circuit_stability",
    "evaluate",
    "faithfulness_curve",
    "find_circuit",
    "prune",
    "run_find_circuit",
    "select",
    "size_for_faithfulness",
    "warn_most_heads",
    "DEFAULT_FAITHFULNESS",
]


MAX_MEMORY_GB = 2.0
"""Default budget (GiB) of the exact evaluations' activations (`circuit_rows`): `find_circuit`
without `batch_rows`, `headsteer report circuit --max-memory`."""


def circuit_rows(
    graph: Graph,
    d_model: int,
    width: int,
    max_memory_gb: float = MAX_MEMORY_GB,
    *,
    strict: bool = False,
    d_head: int | None = None,
    itemsize: int = 4,
    pairs: int | None = None,
    reserve: int = 0,
    floor: int = 0,
) -> int:
    """Rows per forward of the exact evaluations (`evaluate`, `faithfulness_curve`'s
    `batch_rows`) that keep their activations within `max_memory_gb` GiB, between 1 and 64, by
    `heads.planning.eap.circuit_eval_bytes`: r rows keep the recorded clean / corrupted runs of
    `min(pairs, r)` pairs of `width` tokens (a chunk of pairs is recorded at once; `pairs` None:
    as many as rows) in the model's dtype of `itemsize` bytes, plus each row's upstream
    differences (every node's on short prompts, the heads' as head outputs on long ones; `d_head`
    default `d_model / H`), beside `reserve` bytes (a budget the user gave: the weights and one
    row's forward). One row over the budget: 1 row, or with `strict` refused naming the least
    the run needs, the larger of one row and `floor` (the edge scores' own minimum plan).

    Raises:
        ValueError: a budget that is not a number > 0; with `strict`, one row over it.
    """
    budget = check_number("max_memory", max_memory_gb, lo=0, lo_open=True) * 2**30
    g = plan_geometry(graph, d_model, d_head)
    tokens = max(1, width)
    recorded = circuit_eval_bytes(g, tokens, 0, itemsize)  # one pair's recorded runs
    per_row = circuit_eval_bytes(g, tokens, 1, itemsize) - recorded

    def need(r: int) -> int:
        return reserve + min(r if pairs is None else max(1, pairs), r) * recorded + r * per_row

    least = max(need(1), floor)
    if strict and least > budget:
        raise HeadsteerValueError(
            f"find_circuit needs at least {format_bytes(least)} for one pair of {width} tokens "
            "(the weights and a forward, the edge scores, and the exact evaluations of the circuit: "
            f"the clean and corrupted runs' activations plus one row's upstream differences, "
            f"{graph.n_upstream} upstream nodes x d_model {d_model} x tokens); max_memory is "
            f"{format_bytes(int(budget))}: raise it or use shorter pairs"
        )
    rows = 1
    while rows < 64 and need(rows + 1) <= budget:
        rows += 1
    return rows


DEFAULT_FAITHFULNESS = 0.3
"""The faithfulness the default circuit reaches (`find_circuit`, `headsteer report circuit`): the
smallest size of the curve with f >= 0.3. On IOI with the embedded model that is about 1 % of the
edges, whose heads ablated drop accuracy far below as many random heads (docs/methods/circuits.md);
the old fixed 5 % held most of the model's heads."""


# ------------------------------------------------------------------------------ evaluation
def evaluate(
    model: HeadModel,
    pairs: PairBatch,
    circuits: Circuit | torch.Tensor | list[Circuit],
    *,
    metric: str | Metric | Any = "logit_diff",
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> torch.Tensor:
    """`[K]` exact faithfulness f(C) of K circuits (every non-circuit edge corrupted).

    Args:
        circuits: a `Circuit`, a list of them, or `[K, U, Dn]` bool edge masks.
        options: `heads.SweepOptions`: `max_rows` rows (circuit x pair) per forward (default 64),
            `progress` (without `options`: none) in forwards; `max_memory`: fewer rows where the
            `"forward"` plan beside the recorded clean / corrupted runs needs it.
        **deprecated: `batch_rows=` (now `max_rows`) and `progress=` as keywords (one release; a
            `DeprecationWarning`; refused together with the same field set in `options`).

    Raises:
        ValueError: masks of another graph's shape; a model other than the circuit's geometry.
    """
    batch_rows, progress = _rows_progress(options, deprecated, "evaluate", None, model, pairs)
    graph = graph_of(model)
    if isinstance(circuits, Circuit):
        circuits = [circuits]
    if isinstance(circuits, list):
        for c in circuits:
            if not isinstance(c, Circuit):
                raise HeadsteerTypeError(
                    f"circuits must be Circuits or [K, U, Dn] masks, got {type(c).__name__}"
                )
            c.graph.check_model(model)
        masks = torch.stack([c.mask for c in circuits]) if circuits else torch.zeros(0)
    else:
        masks = torch.as_tensor(circuits, dtype=torch.bool)
    if masks.ndim != 3 or tuple(masks.shape[1:]) != (graph.n_upstream, graph.n_downstream):
        raise HeadsteerValueError(
            f"circuit masks must be [K, {graph.n_upstream}, {graph.n_downstream}], got {tuple(masks.shape)}"
        )
    met = get_metric(metric)
    pairs = _check_pairs(model, pairs, met)
    patches = graph.valid[None] & ~masks
    got: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = patched_metrics(
        model,
        pairs,
        patches,
        metric=met,
        batch_rows=batch_rows,
        progress=progress,
        desc="faithfulness",
        return_runs=True,
    )
    vals, clean, corr = got
    gap = clean.mean() - corr.mean()
    if abs(float(gap)) < 1e-8:
        raise HeadsteerValueError(
            "M(clean) equals M(corrupted) on average: faithfulness has no scale for these pairs"
        )
    return ((vals.mean(-1) - corr.mean()) / gap).float()


def areas(fractions: Any, faith: Any) -> tuple[float, float]:
    """`(CPR, CMD)`: trapezoid areas of f and of |1 - f| over the edge fractions k in [0, 1]
    (NaN with fewer than two sizes)."""
    x = torch.as_tensor(fractions, dtype=torch.float64)
    f = torch.as_tensor(faith, dtype=torch.float64)
    if len(x) < 2:
        return float("nan"), float("nan")
    return float(torch.trapezoid(f, x)), float(torch.trapezoid((1 - f).abs(), x))


def faithfulness_curve(
    model: HeadModel,
    pairs: PairBatch,
    scores: EdgeScores,
    *,
    sizes: Any = SIZES,
    absolute: bool = True,
    random: bool = True,
    seed: int = 0,
    n_random: int = 1,
    metric: str | Metric | Any | None = None,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> dict:
    """The faithfulness curve of `scores`' ranking (and of random circuits of the same sizes).

    Args:
        sizes: circuit sizes in % of the edges, each in (0, 100] (default `SIZES`).
        random: also evaluate random circuits of the same sizes (one per size and draw, each
            draw a random edge order seeded by `seed`), pruned alike.
        n_random: random draws, 1..1000 (default 1); the random curve is the mean over draws,
            `cpr_random` / `cmd_random` the means of the draws' CPR / CMD.
        metric: default the metric the scores were made with.
        options: `heads.SweepOptions` of the exact runs (`evaluate`'s: `max_rows` rows per
            forward, default 64, fewer where `max_memory` needs it; `progress`, without
            `options` none).
        **deprecated: `batch_rows=` / `progress=` as keywords (one release; a `DeprecationWarning`).

    Returns:
        `{"sizes": [%], "n_edges": [requested], "n_kept": [after pruning], "faithfulness": [f],
        "cpr", "cmd", and with random: "random" (mean curve), "n_kept_random" (first draw),
        "cpr_random", "cmd_random", "random_draws" (`[n_random, sizes]` curves),
        "cpr_random_draws", "cmd_random_draws", "seed"}`.

    Raises:
        ValueError: sizes not a list of numbers in (0, 100] (a string or a bool is refused);
            scores of another graph; a bad seed or batch_rows.
        TypeError: scores not `EdgeScores`.
    """
    sz = _check_sizes(sizes)
    if not isinstance(scores, EdgeScores):
        raise HeadsteerTypeError(f"scores must be EdgeScores (edge_scores), got {type(scores).__name__}")
    check_bool("absolute", absolute)
    check_bool("random", random)
    seed = check_seed("seed", seed)
    n_random = check_int("n_random", n_random, lo=1, hi=1000)
    batch_rows, progress = _rows_progress(options, deprecated, "faithfulness_curve", None, model, pairs)
    graph = graph_of(model)
    if scores.graph.n_upstream != graph.n_upstream or scores.graph.n_downstream != graph.n_downstream:
        raise HeadsteerValueError("the scores are for another model geometry")
    met = get_metric(metric if metric is not None else scores.metric)
    ns = [_n_of(graph, s) for s in sz]
    ranking = scores.ranking(absolute)
    masks = [prune(graph, _top_mask(graph, ranking, n)) for n in ns]
    if random:
        gen = torch.Generator().manual_seed(seed)
        edges = torch.nonzero(graph.valid)
        for _ in range(n_random):
            perm = edges[torch.randperm(len(edges), generator=gen)]
            masks += [prune(graph, _top_mask(graph, perm, n)) for n in ns]
    f = evaluate(
        model,
        pairs,
        torch.stack(masks),
        metric=met,
        options=SweepOptions(max_rows=batch_rows, progress=progress),
    )
    x = [s / 100.0 for s in sz]
    k = len(sz)
    cpr, cmd = areas(x, f[:k])
    out: dict[str, Any] = {
        "sizes": list(sz),
        "n_edges": ns,
        "n_kept": [int(m.sum()) for m in masks[:k]],
        "faithfulness": [float(v) for v in f[:k]],
        "cpr": cpr,
        "cmd": cmd,
    }
    if random:
        draws = f[k:].reshape(n_random, k)
        ar = [areas(x, d) for d in draws]
        out.update(
            random=[float(v) for v in draws.mean(0)],
            n_kept_random=[int(m.sum()) for m in masks[k : 2 * k]],
            cpr_random=sum(a for a, _ in ar) / n_random,
            cmd_random=sum(b for _, b in ar) / n_random,
            random_draws=[[float(v) for v in d] for d in draws],
            cpr_random_draws=[a for a, _ in ar],
            cmd_random_draws=[b for _, b in ar],
            seed=seed,
        )
    return out


def circuit_stability(
    scores: EdgeScores,
    n_resamples: int = 100,
    *,
    n: int | None = None,
    threshold: float | None = None,
    pairs: PairBatch | None = None,
    seed: int = 0,
) -> Stability:
    """Bootstrap over pairs of a circuit: the edge ranking's `Stability` (top k = the circuit's
    size) with `inclusion`, each edge's share of resamples whose circuit, re-selected by the same
    rule (top `n` by |score| or `threshold`, pruned) on the resample's mean per-pair scores, holds
    it. `pairs` gives the template ids (agreement across templates). No forward pass.

    Raises:
        ValueError: scores without per-pair values, fewer than 2 pairs, not exactly one of n /
            threshold, a bad n_resamples or seed.
    """
    from heads.scorers.stability import pair_templates

    if (n is None) == (threshold is None):
        raise HeadsteerValueError("give exactly one of n= (top-n edges) or threshold=")
    graph = scores.graph
    point = select(scores, n, threshold=threshold)

    def reselect(values: torch.Tensor) -> torch.Tensor:
        full = torch.full_like(scores.scores, float("nan"))
        full[graph.valid] = values
        again = EdgeScores(graph, full, scores.method, scores.metric, scores.n_pairs)
        return select(again, n, threshold=threshold).mask[graph.valid]

    templates = pair_templates(pairs) if pairs is not None else None
    k = max(1, point.n_edges)
    return scores.bootstrap(n_resamples, k=k, seed=seed, templates=templates, select=reselect)


def find_circuit(
    model: HeadModel,
    pairs: PairBatch,
    *,
    method: str = "eap-ig",
    n: int | None = None,
    size: float | None = None,
    threshold: float | None = None,
    steps: int = 5,
    metric: str | Metric | Any = "logit_diff",
    confirm: int = 0,
    curve: bool = True,
    sizes: Any = SIZES,
    stability: int = 0,
    faithfulness: float | None = None,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> Circuit:
    """Score every edge, select a circuit, evaluate it exactly and (optionally) its curve.

    Args:
        method: `"eap"` or `"eap-ig"` (default) or `"exact"`.
        n, size, threshold, faithfulness: the circuit: top `n` edges, the top `size` % of the
            edges, |score| >= threshold, or the smallest size of `sizes` whose exact
            faithfulness reaches `faithfulness` (read from the curve). Default: the smallest
            size reaching `DEFAULT_FAITHFULNESS` (0.3); the method's curve is evaluated for it
            even with `curve=False` (then without the random baseline, and not kept).
        confirm: rerun the top `confirm` edges exactly (`EdgeScores.exact`).
        curve: also compute the faithfulness curve over `sizes` with a random baseline.
        options: `heads.SweepOptions`: `max_rows` is the rows per forward of the exact runs (the
            curve, the circuit, `confirm`), and `max_rows // 8` the pairs per EAP / EAP-IG chunk;
            at its default (64, or no `options`) the exact runs take as many rows as keep their
            activations within `MAX_MEMORY_GB` (2 GiB, `circuit_rows`; on SmolLM2-135M and IOI
            about 20 MB a row, where 51 rows peaked at 1 GB; one pair of 1,024 tokens about
            0.8 GB, one row with the heads' differences kept compactly) and the chunks 8 pairs;
            `max_memory` (bytes) replaces that budget (at most `max_rows` rows).
            `progress`: True (default: a bar), False / None, or a `(done, total)` callable.
            EAP (and EAP-IG with up to 8 points on SmolLM2) take the memory-lean path on long
            prompts, any method under a budget the default path exceeds (`edge_scores`: SmolLM2
            from 601 tokens on, about 2.2x a plain forward's memory instead of 9x, at 2.5-3.6x
            the default path's CPU time; the same scores);
            `with heads.scorers.circuits.eap_path.forced("lean" | "default")` forces a path.
        **deprecated: `batch_size=`, `batch_rows=` and `progress=` as keywords (one release; a
            `DeprecationWarning`; see `edge_scores`; `batch_rows=None` is the default).
        stability: bootstrap resamples of the pairs (default 0: none; e.g. 100): the circuit is
            re-selected (same rule, pruned) on each resample's mean per-pair edge scores, giving
            every edge's inclusion frequency (`circuit.stability`; no extra forward).

    Raises:
        ValueError: bad arguments (checked before any forward; see `edge_scores`, `select`).
    """
    if deprecated.get("batch_rows", 0) is None:
        del deprecated["batch_rows"]  # the old default: the memory-budget rows
    loose_rows = deprecated.get("batch_rows")
    batch_size, opts = _batch_size(
        options, deprecated, "find_circuit", takes=("max_rows", "progress", "max_memory")
    )
    request = CircuitRequest(
        method=method,
        n=n,
        size=size,
        threshold=threshold,
        steps=steps,
        metric=metric,
        confirm=confirm,
        curve=curve,
        sizes=sizes,
        stability=stability,
        faithfulness=faithfulness,
    )
    c = _run(model, pairs, request, opts, batch_size, budget=loose_rows is None)
    warn_most_heads(c)  # here, not in _run: the warning names the caller's line
    return c


def run_find_circuit(
    model: HeadModel, pairs: PairBatch, request: CircuitRequest, options: SweepOptions | None = None
) -> Circuit:
    """Run a `CircuitRequest` on `pairs` (what `find_circuit` does once it has built the request,
    whose values are checked there; its edge counts are checked here against `model`'s graph).
    `options` as `find_circuit`'s. See `find_circuit` for the result and the errors."""
    if not isinstance(request, CircuitRequest):
        raise HeadsteerTypeError(f"request must be a CircuitRequest, got {type(request).__name__}")
    opts = sweep_options(options, {}, "find_circuit", takes=("max_rows", "progress", "max_memory"))
    c = _run(model, pairs, request, opts, max(1, opts.max_rows // 8), budget=True)
    warn_most_heads(c)
    return c


def _run(
    model: HeadModel,
    pairs: PairBatch,
    request: CircuitRequest,
    opts: SweepOptions,
    batch_size: int,
    *,
    budget: bool,
) -> Circuit:
    """`run_find_circuit` with the pairs per gradient chunk given (`batch_size`); `budget`: at the
    default `max_rows` the exact runs take the rows of the `MAX_MEMORY_GB` budget (False: a loose
    `batch_rows=` keyword set them). The circuit is not checked for holding most heads (the caller
    warns, so that the warning names its caller's line)."""
    r = request
    method, steps, confirm, sizes, threshold = r.method, r.steps, r.confirm, r.sizes, r.threshold
    stability, curve, n = r.stability, r.curve, r.n
    by_curve = r.n is None and r.size is None and r.threshold is None
    target = DEFAULT_FAITHFULNESS if r.faithfulness is None else r.faithfulness
    graph = graph_of(model)
    request.check_config(model)  # n and confirm within the graph's edges
    batch_rows, progress = opts.max_rows, opts.progress
    width = pairs.width if isinstance(pairs, PairBatch) else 1  # edge_scores refuses a non-batch
    d_head, item = model.d_head, torch.empty(0, dtype=model.dtype).element_size()
    n_pairs = pairs.n if isinstance(pairs, PairBatch) else 1
    if opts.max_memory is not None:  # the exact runs' rows within that budget (refused before any forward)
        from heads.planning.budget import minimum_plan
        from heads.planning.plan import plan_memory

        gb, dev = int(opts.max_memory) / 2**30, str(model.device)
        forward = plan_memory(model, "forward", width, 1, model.dtype, dev).peak  # weights + one row
        floor = minimum_plan(model, request, width, 1, model.dtype, dev).peak  # with the edge scores
        rows = circuit_rows(
            graph, model.d_model, width, gb, strict=True, d_head=d_head, itemsize=item, pairs=n_pairs,
            reserve=forward, floor=floor,
        )  # fmt: skip
        batch_rows = min(opts.max_rows, rows)
    elif budget and opts.max_rows == SweepOptions().max_rows:
        batch_rows = circuit_rows(graph, model.d_model, width, d_head=d_head, itemsize=item, pairs=n_pairs)
    if stability and isinstance(pairs, PairBatch) and pairs.n < 2:
        raise HeadsteerValueError(f"stability={stability} needs at least 2 pairs, got {pairs.n}")
    if r.size is not None:
        n = _n_of(graph, r.size)
    met = get_metric(r.metric)
    # the exact runs: a bar of their own ("faithfulness", in forwards) when the caller asked for
    # bars (a long prompt's curve takes minutes); a callable keeps the edge scores' counts only
    exact_opts = SweepOptions(max_rows=batch_rows, progress=True if progress is True else None)
    sc = chunked_edge_scores(
        model, pairs, method, steps, met, confirm, batch_size, batch_rows, progress, opts.max_memory
    )
    fc = None
    if curve or by_curve:
        fc = faithfulness_curve(model, pairs, sc, sizes=sizes, random=curve, metric=met, options=exact_opts)
    if by_curve:
        assert fc is not None
        n = size_for_faithfulness(fc, target) if r.faithfulness is not None else _default_size(fc, target)
    c = select(sc, n, threshold=threshold)
    if by_curve:
        c.params.update(faithfulness_target=target)
    if stability:
        c.stability = circuit_stability(sc, stability, n=n, threshold=threshold, pairs=pairs)
    c.curve = fc if curve else None
    if by_curve and fc is not None and n in fc["n_edges"]:  # the curve evaluated this very circuit
        c.faithfulness = float(fc["faithfulness"][fc["n_edges"].index(n)])
    else:
        c.faithfulness = float(evaluate(model, pairs, c, metric=met, options=exact_opts)[0])
    return c


def _default_size(curve: dict, target: float) -> int:
    """`size_for_faithfulness`, or, when no size of the curve reaches `target`, the most faithful
    size with a `UserWarning` saying so (the default must give a circuit)."""
    try:
        return size_for_faithfulness(curve, target)
    except HeadsteerValueError as err:
        warnings.warn(
            f"{err}; taking the most faithful size", UserWarning, stacklevel=4
        )  # find_circuit's caller
        best = max(range(len(curve["n_edges"])), key=lambda i: curve["faithfulness"][i])
        return int(curve["n_edges"][best])
