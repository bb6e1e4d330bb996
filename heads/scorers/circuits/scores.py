"""Edge scores: EAP, EAP-IG (over the inputs) and exact edge patching.

For an edge u -> v, with x the clean and x~ the corrupted prompt of a pair and M the metric
(default: logit difference at the last position):

* **EAP** (Syed et al. 2024, Eq. 2; Nanda 2023 "attribution patching"):
  `score(u -> v) = (a_u(x~) - a_u(x)) . dM/dv_in (x)`, summed over positions and averaged over
  pairs: one corrupted forward (to cache a_u(x~)) and one clean forward + backward. The
  gradient dM/dv_in is taken with respect to a zero delta added to v's own input, so each
  head's q, k and v inputs (k / v per KV head) get their own gradient.
* **EAP-IG, inputs** (Hanna et al. 2024, Sec. 3.2, Eq. 3): the gradient is averaged over m
  runs (default 5) whose input embeddings are `e(x~) + (k/m) (e(x) - e(x~))`, k = 1..m (a
  Riemann sum of integrated gradients from x~ to x); the activation difference is the same.
* **Exact** edge patching: `score(u -> v) = M(x with only u -> v corrupted) - M(x)`, averaged
  over pairs (the oracle; Conmy et al. 2023 patch edges one at a time the same way). Batched:
  each (edge, pair) is one row of a forward.

Sign convention: both EAP and exact scores estimate the *change* in M when the edge is
corrupted (negative = the edge carries the behaviour, for a metric higher on x).

Memory grows linearly in the prompt (`heads.scorers.circuits.eap`): the activation differences
are kept per layer (`[R, T, H, d]` for the heads, `[R, T, D]` for the MLPs) and the gradients
come one layer at a time, for a chunk of R pairs (`batch_size`, default 8); pairs are processed
in chunks and the scores summed, never by dropping positions.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from heads._util.progress import ProgressArg, progress_callback
from heads._util.validation import check_int
from heads.engine.options import SweepOptions, sweep_options
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.planning.eap import CIRCUIT_PATCH_MEMORY, circuit_diff_streams, circuit_row_work_streams
from heads.results.edges import EdgeScores as EdgeScores  # defined there; imported here as before
from heads.scorers.circuits.eap import eap_chunk
from heads.scorers.circuits.eap_lean import eap_chunk_lean
from heads.scorers.circuits.eap_path import choose_path
from heads.scorers.circuits.graph import Acts, Graph, first_patched_layer, graph_of, run_graph
from heads.scorers.circuits.layout import plan_geometry
from heads.scorers.circuits.request import DEFAULT_STEPS as DEFAULT_STEPS  # re-exported
from heads.scorers.circuits.request import MAX_STEPS, METHODS, CircuitRequest
from heads.scorers.patching.metrics import Metric, get_metric
from heads.scorers.patching.pairs import PairBatch, check_vocab

__all__ = [
    "MAX_STEPS",
    "METHODS",
    "EdgeScores",
    "edge_scores",
    "exact_scores",
    "patched_metrics",
    "run_metrics",
]

PATCH_MEMORY = CIRCUIT_PATCH_MEMORY
"""Bytes that the upstream differences of one exact patched forward may take (`patched_metrics`;
`heads.planning.eap.CIRCUIT_PATCH_MEMORY`, 512 MiB): rows (patch x pair) are run in forwards small
enough to fit, one row per forward at the least. When one row's differences alone pass it (long
prompts: U = 1 + L (H + 1) residual streams), the heads' differences are kept as head outputs and
projected when read (`run_graph(compact=True)`), about 2 L + 1 residual streams a row."""

COMPACT: bool | None = None
"""Force (True) or forbid (False) the compact upstream differences of `patched_metrics`; None
(default): compact exactly when one row's full differences pass `PATCH_MEMORY`."""


def _check_pairs(model: HeadModel, pairs: Any, metric: Metric) -> PairBatch:
    if not isinstance(pairs, PairBatch):
        raise HeadsteerTypeError(
            f"pairs must be a PairBatch (heads.scorers.patching.encode_pairs), got {type(pairs).__name__}"
        )
    if pairs.clean_ids.shape != pairs.corrupted_ids.shape:
        raise HeadsteerValueError(
            f"clean {tuple(pairs.clean_ids.shape)} and corrupted {tuple(pairs.corrupted_ids.shape)} "
            "ids must have one shape (pairs of equal token length)"
        )
    check_vocab(pairs, model.d_vocab)
    metric.check(pairs)
    model.check_length(pairs.width)
    return pairs


def _chunks(n: int, size: int) -> list[torch.Tensor]:
    return [torch.arange(i, min(n, i + size)) for i in range(0, n, size)]


def _metric(
    metric: Metric,
    logits: torch.Tensor,
    pairs: PairBatch,
    index: torch.Tensor,
    clean: torch.Tensor | None = None,
) -> torch.Tensor:
    return metric(logits, pairs, index, clean_logits=clean)


def _record(
    model: HeadModel, graph: Graph, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, Acts]:
    with torch.no_grad():
        logits, runner = run_graph(model, graph, ids, mask, record=True)
    return logits, runner.acts()


def _batch_size(
    options: SweepOptions | None,
    deprecated: dict[str, Any],
    where: str,
    takes: tuple[str, ...] = ("max_rows", "progress"),
) -> tuple[int, SweepOptions]:
    """The pairs per gradient chunk and the `SweepOptions` of `edge_scores` / `find_circuit`:
    the deprecated `batch_size=` (warned, refused with `options.max_rows`) or `max_rows // 8`."""
    batch_size = deprecated.pop("batch_size", None)
    opts = sweep_options(  # stacklevel 4: the warning names the caller of edge_scores / find_circuit
        options, deprecated, where, takes=takes, renamed={"batch_rows": "max_rows"}, stacklevel=4
    )
    if batch_size is None:
        return max(1, opts.max_rows // 8), opts
    if options is not None and options.max_rows != SweepOptions().max_rows:
        raise HeadsteerValueError(
            f"{where}() got both batch_size= and options.max_rows: pass only "
            "options=SweepOptions(max_rows=...)"
        )
    warnings.warn(
        f"{where}(batch_size=) is deprecated: pass options=SweepOptions(max_rows=8 * batch_size) "
        "instead (the keyword is removed in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )
    return check_int("batch_size", batch_size, lo=1), opts


def _rows_progress(
    options: SweepOptions | None,
    deprecated: dict[str, Any],
    where: str,
    progress: ProgressArg,
    model: HeadModel | None = None,
    pairs: object = None,
) -> tuple[int, ProgressArg]:
    """`(max_rows, progress)` of `evaluate` / `faithfulness_curve` / `exact_scores`: `options`,
    or the deprecated `batch_rows=` / `progress=` keywords (warned at the caller's line);
    `progress` is the scorer's own default when neither sets it. With `options.max_memory`,
    `max_rows` is lowered to the rows the `"forward"` plan fits beside the recorded clean and
    corrupted runs of `pairs` (refused before any forward when one row does not fit)."""
    given = options is not None or "progress" in deprecated
    if "batch_rows" in deprecated:  # named as given, before the warning
        check_int("batch_rows", deprecated["batch_rows"], lo=1)
    opts = sweep_options(
        options,
        deprecated,
        where,
        takes=("max_rows", "progress", "max_memory"),
        renamed={"batch_rows": "max_rows"},
        stacklevel=4,
    )
    if opts.max_memory is not None and model is not None and isinstance(pairs, PairBatch):
        from heads.scorers.patching.record import cache_bytes

        kept = 2 * cache_bytes(model, pairs.n, pairs.width)
        opts = opts.within(model, pairs.width, reserve=kept, whole=pairs.n)
    return opts.max_rows, opts.progress if given else progress


def edge_scores(
    model: HeadModel,
    pairs: PairBatch,
    *,
    method: str = "eap-ig",
    steps: int = 5,
    metric: str | Metric | Any = "logit_diff",
    confirm: int = 0,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> EdgeScores:
    """Score every edge of `model`'s graph on clean / corrupted `pairs`.

    Args:
        model: a `HeadModel` of a family the graph supports (`graph.check_family`).
        pairs: a `PairBatch` (`heads.scorers.patching.encode_pairs` / `pairs_from_tokens`).
        method: `"eap"`, `"eap-ig"` (default) or `"exact"` (every edge patched exactly: slow).
        steps: m, the EAP-IG interpolation steps, 1..MAX_STEPS (default 5, Hanna et al. 2024);
            only "eap-ig" takes it (another method with steps != 5 is refused).
        metric: a metric name of `heads.scorers.patching.METRICS`, a `Metric` or a
            differentiable function `(logits [R, V], pairs, index [R]) -> [R]`.
        confirm: rerun the top `confirm` edges (by |score|) with exact edge patching; their
            exact scores land in `.exact` (default 0: none).
        options: `heads.SweepOptions`; `max_rows` (default 64) is the rows per forward of the
            exact runs (edge x pair), and `max_rows // 8` (default 8) the pairs per chunk of the
            gradient runs (bounds memory); `progress`: True (default: a bar), False / None, or a
            `(done, total)` callable; unit: chunks of pairs (EAP / EAP-IG) or forwards (exact);
            `max_memory`: the pairs per chunk lowered to what the `"eap"` plan fits in it and
            the exact runs' rows to the `"forward"` plan's; when not even one pair fits the
            `"eap"` plan, EAP / EAP-IG take the memory-lean path within the `"eap_lean"` plan
            (refused before any forward, its minimum named, when one pair does not fit that).
            Which path (`heads.scorers.circuits.eap_path.choose_path`): the lean path
            (`heads.scorers.circuits.eap_lean`: the activation differences recomputed block by
            block instead of held; the same scores within float rounding) also without a budget
            on long prompts, where the default path's planned activations for one pair exceed
            2.5x a plain forward's and 128 MiB over it (SmolLM2-135M: from 601 tokens on), and
            its estimated work is within 5x the default's (EAP; EAP-IG with up to 8 points on
            SmolLM2; a much deeper model keeps the default path: each point sweeps again); it keeps
            2.1-2.4x a plain forward's memory (the default path 9-10x on SmolLM2) at 2.5x the
            default path's CPU time for EAP at 1k tokens (EAP-IG with 2 points: about 3.6x).
            `with eap_path.forced("lean")` / `forced("default")` forces either.
        **deprecated: `batch_rows=` (now `max_rows`), `batch_size=` (pairs per gradient chunk:
            `max_rows=8 * batch_size`) and `progress=` as keywords (one release; a
            `DeprecationWarning`; refused together with the same field set in `options`).

    Returns:
        an `EdgeScores` (`[U, Dn]`, NaN off the graph).

    Raises:
        ValueError: an unknown method, steps outside 1..MAX_STEPS (or given to eap / exact),
            confirm < 0, a refused family (named), pairs
            whose rows differ in length, a metric the pairs cannot feed; all before any forward.
    """
    batch_size, opts = _batch_size(options, deprecated, "edge_scores", ("max_rows", "progress", "max_memory"))
    # the values are checked once, by the request find_circuit runs (its edge-score fields)
    request = CircuitRequest(method=method, steps=steps, metric=metric, confirm=confirm, curve=False)
    graph_of(model)  # a refused family is named before the geometry check
    request.check_config(model)  # confirm within the graph's edges
    return chunked_edge_scores(
        model,
        pairs,
        request.method,
        request.steps,
        metric,
        request.confirm,
        batch_size,
        opts.max_rows,
        opts.progress,
        opts.max_memory,
    )


def chunked_edge_scores(
    model: HeadModel,
    pairs: PairBatch,
    method: str,
    steps: int,
    metric: str | Metric | Any,
    confirm: int,
    batch_size: int,
    batch_rows: int,
    progress: ProgressArg,
    max_memory: int | str | None = None,
) -> EdgeScores:
    """`edge_scores` with its batching given apart: `batch_size` pairs per gradient chunk and
    `batch_rows` rows per exact forward (`find_circuit`'s memory-budget rows); `max_memory`
    (bytes) lowers both to the `"eap"` (or `"eap_lean"`, `eap_path.choose_path`) / `"forward"` plans'
    rows within it (refused before any forward when one row does not fit). The method, steps
    and confirm are a checked `CircuitRequest`'s (`edge_scores` / `find_circuit` build it); the
    pairs are checked here."""
    graph = graph_of(model)
    met = get_metric(metric)
    pairs = _check_pairs(model, pairs, met)
    budget = SweepOptions(max_memory=max_memory)  # max_memory: both batchings within it
    n_runs = 1 if method == "eap" else steps
    gradient = budget.replace(max_rows=batch_size)
    batch_size, lean, block = choose_path(
        model, gradient, pairs.width, method, None if method == "eap" else n_runs
    )
    if max_memory is not None and (method == "exact" or confirm):  # exact runs keep both recorded runs
        from heads.scorers.patching.record import cache_bytes

        kept = 2 * cache_bytes(model, pairs.n, pairs.width)
        batch_rows = budget.replace(max_rows=batch_rows).within(model, pairs.width, reserve=kept).max_rows
    if method == "exact":
        return exact_scores(
            model, pairs, metric=met, options=SweepOptions(max_rows=batch_rows, progress=progress)
        )
    U, Dn = graph.n_upstream, graph.n_downstream
    total = torch.zeros(U, Dn, dtype=torch.float64)
    per_pair: list[torch.Tensor] = []  # [R, E] per chunk
    valid = graph.valid
    chunks = _chunks(pairs.n, batch_size)
    with progress_callback(progress, method, "pair chunks") as report:
        for done, idx in enumerate(chunks, 1):
            sub = pairs.select(idx)
            clean_logits = None
            if met.needs_clean:
                clean_logits, _ = _record(model, graph, sub.clean_ids, sub.attention_mask)
            rows = torch.arange(sub.n)

            def loss(
                logits: torch.Tensor,
                sub: PairBatch = sub,
                rows: torch.Tensor = rows,
                ref: torch.Tensor | None = clean_logits,
            ) -> torch.Tensor:
                return _metric(met, logits, sub, rows, ref).sum()

            args = (model, graph, sub.clean_ids, sub.corrupted_ids, sub.attention_mask, loss)
            ig = None if method == "eap" else n_runs
            if lean:  # [R, U, Dn]: each pair's score of every (u, v)
                per = eap_chunk_lean(*args, steps=ig, block=block)
            else:
                per = eap_chunk(*args, steps=ig)
            per_pair.append(per[:, valid])
            total += per.double().sum(0)
            if report:
                report(done, len(chunks))
    scores = (total / pairs.n).float()
    scores[~graph.valid] = float("nan")
    params = {"steps": steps, "confirm": confirm, "d_model": model.d_model}
    out = EdgeScores(graph, scores, method, met.name, pairs.n, params=params, per_pair=torch.cat(per_pair))
    if confirm:
        top = out.ranking()[:confirm]
        opts = SweepOptions(max_rows=batch_rows, progress=progress)
        ex = exact_scores(model, pairs, edges=top, metric=met, options=opts)
        out.exact = ex.scores
    return out


def run_metrics(
    model: HeadModel, pairs: PairBatch, metric: Metric, batch_size: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """`([N] M(x), [N] M(x~))` of the unpatched clean and corrupted runs."""
    graph = graph_of(model)
    clean, corr = [], []
    for idx in _chunks(pairs.n, batch_size):
        sub = pairs.select(idx)
        lc, _ = _record(model, graph, sub.clean_ids, sub.attention_mask)
        lx, _ = _record(model, graph, sub.corrupted_ids, sub.attention_mask)
        i = torch.arange(sub.n)
        clean.append(_metric(metric, lc, sub, i, lc).cpu())
        corr.append(_metric(metric, lx, sub, i, lc).cpu())
    return torch.cat(clean), torch.cat(corr)


def patched_metrics(
    model: HeadModel,
    pairs: PairBatch,
    patches: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
    n_patches: int | None = None,
    *,
    metric: Metric,
    batch_rows: int = 64,
    progress: ProgressArg = None,
    desc: str = "patching",
    return_runs: bool = False,
) -> Any:
    """`[K, N]` M of every pair with edge set k corrupted.

    Args:
        patches: `[K, U, Dn]` bool, or a function `ks [k] long -> [k, U, Dn] bool` building
            the patches of a block on demand (then `n_patches` = K).
        return_runs: also return `[N] M(x)` and `[N] M(x~)` of the unpatched runs (the ones
            recorded here), as `(values, clean, corrupted)`.

    Rows are (patch k, pair n), `batch_rows` per forward, fewer when the upstream differences
    they keep would pass `PATCH_MEMORY` (per patched input the smaller of its patched and its
    unpatched sources, `run_graph`), so memory grows linearly in the prompt; the clean and
    corrupted runs of a chunk of pairs are recorded once and reused by every block of patches
    (read per row, not copied). A forward whose patches touch no input below layer l skips
    layers 0 .. l-1 (their outputs are the clean run's: `run_graph(skip=)`), so exact patching
    of edges into late layers costs less. On long prompts, where one row's full differences
    could pass `PATCH_MEMORY`, the clean run keeps only its logits (no layer is skipped) and a row
    keeps the heads' differences as head outputs (`run_graph(compact=True)`) wherever that is
    less: about 4 L + 1 streams recorded plus 2 L + 1 a row, instead of 8 L + 2 plus U. Given as a
    tensor, identical patches are run once and an empty patch (nothing corrupted: the model's own
    forward) takes the clean run's M without a forward.
    """
    graph = graph_of(model)
    empty: torch.Tensor | None = None  # [K] bool: the patch corrupts nothing
    back: torch.Tensor | None = None  # [K] long: the distinct patch each one is
    if callable(patches):
        make = patches
        K = int(n_patches or 0)
    else:
        shape = tuple(patches.shape[1:])
        flat = torch.as_tensor(patches).bool().reshape(patches.shape[0], -1)
        empty = ~flat.any(dim=1)
        uniq, back = torch.unique(flat, dim=0, return_inverse=True)
        keep = uniq.any(dim=1)  # distinct non-empty patches
        dense: torch.Tensor = uniq[keep].reshape(-1, *shape)
        back = (torch.cumsum(keep.long(), 0) - 1)[back]  # -> row of dense (-1: empty)
        K = dense.shape[0]

        def make(ks: torch.Tensor) -> torch.Tensor:
            return dense[ks]

    out = torch.empty(K, pairs.n)
    clean_m, corr_m = torch.empty(pairs.n), torch.empty(pairs.n)
    n_pc = max(1, min(pairs.n, batch_rows))
    geometry = plan_geometry(graph, model.d_model, model.d_head)
    small = circuit_diff_streams(geometry)  # streams of differences a compact row keeps
    work = circuit_row_work_streams(geometry)  # and a row's working set
    per = max(1, batch_rows // n_pc)
    pchunks = _chunks(pairs.n, n_pc)
    with progress_callback(progress, desc, "forwards") as report:
        done, want = 0, len(pchunks) * (2 + -(-K // per))
        for pidx in pchunks:
            sub = pairs.select(pidx)
            width = sub.width * model.d_model * 4  # bytes of one upstream difference of one row
            # long prompts (a row's differences could pass the budget): the clean run's logits
            # only, no recorded activations and no skipped layers (its 4 L + 1 streams saved)
            long = graph.n_upstream * width > PATCH_MEMORY if COMPACT is None else COMPACT
            clean_acts: Acts | None = None
            if long:
                with torch.no_grad():
                    clean_logits = run_graph(model, graph, sub.clean_ids, sub.attention_mask)[0]
            else:
                clean_logits, clean_acts = _record(model, graph, sub.clean_ids, sub.attention_mask)
            corr_logits, corr = _record(model, graph, sub.corrupted_ids, sub.attention_mask)
            i = torch.arange(sub.n)
            lo, hi = int(pidx[0]), int(pidx[-1]) + 1
            clean_m[lo:hi] = _metric(metric, clean_logits, sub, i, clean_logits).cpu()
            corr_m[lo:hi] = _metric(metric, corr_logits, sub, i, clean_logits).cpu()
            done += 2
            if report:
                report(done, want)
            n = sub.n
            for k0 in range(0, K, per):
                ks = torch.arange(k0, min(K, k0 + per))
                block = make(ks)
                # rows (patch, pair) per forward: the upstream differences they keep fit the budget;
                # compact (the heads' as head outputs) when one row's alone would not, and on long
                # prompts whenever that keeps less
                nodes = max(1, needed_nodes(graph, block))
                compact = nodes * width > PATCH_MEMORY or (long and nodes > small)
                compact = compact if COMPACT is None else COMPACT
                # a row's differences and its working set (one layer's deltas and their products,
                # normalised copies, the row's own forward): the rows of a forward fit the budget
                need = int(((small if compact else nodes) + work) * width)
                fit = max(1, PATCH_MEMORY // need)
                kr = torch.arange(len(ks)).repeat_interleave(n)  # row -> patch of the block
                pr = torch.arange(n).repeat(len(ks))  # row -> pair of the chunk
                for r0 in range(0, len(kr), fit):
                    rk, rp = kr[r0 : r0 + fit], pr[r0 : r0 + fit]
                    rows_block = block[rk]
                    # below l0 the rows are the clean run's
                    l0 = first_patched_layer(graph, rows_block) if clean_acts is not None else 0
                    with torch.no_grad():
                        logits, _ = run_graph(
                            model,
                            graph,
                            sub.clean_ids[rp],
                            sub.attention_mask[rp],
                            patch=rows_block.to(model.device),
                            corr=corr,
                            rows=rp,
                            skip=(l0, clean_acts) if l0 > 0 and clean_acts is not None else None,
                            compact=compact,
                        )
                    vals = _metric(metric, logits, sub, rp, clean_logits[rp]).cpu()
                    out[k0 + rk, lo + rp] = vals
                done += 1
                if report:
                    report(done, want)
    if back is not None:
        assert empty is not None
        full = torch.empty(len(back), pairs.n)
        full[~empty] = out[back[~empty]]
        full[empty] = clean_m
        out = full
    return (out, clean_m, corr_m) if return_runs else out


def needed_nodes(graph: Graph, patches: torch.Tensor) -> int:
    """How many upstream nodes' differences a forward of `patches [K, U, Dn]` keeps: per patched
    input the smaller of its patched and its unpatched sources (`run_graph`'s complement)."""
    p = patches.bool().cpu()
    n_p = p.sum(1)  # [K, Dn]
    base = (graph.n_before()[None] - n_p) < n_p
    need = torch.where(base[:, None], graph.valid & ~p, p)
    return int(need.any(dim=0).any(dim=1).sum())


def exact_scores(
    model: HeadModel,
    pairs: PairBatch,
    *,
    edges: torch.Tensor | None = None,
    metric: str | Metric | Any = "logit_diff",
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> EdgeScores:
    """Exact edge patching: `M(x with u -> v corrupted) - M(x)`, averaged over pairs.

    Args:
        edges: `[E, 2]` (upstream, downstream) edges to score (default: every edge: E forwards
            rows per pair, slow beyond small models).
        options: `heads.SweepOptions`: `max_rows` rows (edge x pair) per forward (default 64),
            `progress` (default True: a bar) in forwards; `max_memory`: fewer rows where the
            `"forward"` plan beside the recorded clean / corrupted runs needs it.
        **deprecated: `batch_rows=` (now `max_rows`) and `progress=` as keywords (one release; a
            `DeprecationWarning`; refused together with the same field set in `options`).

    Returns:
        an `EdgeScores` with NaN on edges not scored.

    Raises:
        ValueError: an edge that is not in the graph.
    """
    batch_rows, progress = _rows_progress(options, deprecated, "exact_scores", True, model, pairs)
    graph = graph_of(model)
    met = get_metric(metric)
    pairs = _check_pairs(model, pairs, met)
    valid = graph.valid
    if edges is None:
        edges = torch.nonzero(valid)
    edges = torch.as_tensor(edges, dtype=torch.long).reshape(-1, 2)
    if len(edges) and (
        (edges < 0).any()
        or (edges[:, 0] >= graph.n_upstream).any()
        or (edges[:, 1] >= graph.n_downstream).any()
        or not bool(valid[edges[:, 0], edges[:, 1]].all())
    ):
        raise HeadsteerValueError("edges must be (upstream, downstream) pairs of the graph (see Graph.valid)")
    E = len(edges)
    U, Dn = graph.n_upstream, graph.n_downstream

    def make(ks: torch.Tensor) -> torch.Tensor:
        p = torch.zeros(len(ks), U, Dn, dtype=torch.bool)
        p[torch.arange(len(ks)), edges[ks, 0], edges[ks, 1]] = True
        return p

    vals, clean, _ = patched_metrics(
        model,
        pairs,
        make,
        E,
        metric=met,
        batch_rows=batch_rows,
        progress=progress,
        desc="exact",
        return_runs=True,
    )
    scores = torch.full((U, Dn), float("nan"))
    scores[edges[:, 0], edges[:, 1]] = (vals - clean[None]).mean(-1)
    index = torch.full((U, Dn), -1, dtype=torch.long)
    index[valid] = torch.arange(int(valid.sum()))
    per_pair = torch.full((pairs.n, int(valid.sum())), float("nan"))
    per_pair[:, index[edges[:, 0], edges[:, 1]]] = (vals - clean[None]).T
    params = {"d_model": model.d_model}
    return EdgeScores(graph, scores, "exact", met.name, pairs.n, params=params, per_pair=per_pair)
