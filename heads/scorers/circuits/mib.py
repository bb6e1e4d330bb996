"""MIB's circuit-track format in and out, and its faithfulness curve (CPR, CMD).

MIB (Mueller et al. 2025, *MIB: A Mechanistic Interpretability Benchmark*, ICML; public code
`hannamw/MIB-circuit-track`, graph code `hannamw/EAP-IG` `src/eap/graph.py`) takes circuits as
JSON: `{"cfg": {"n_layers", "n_heads", "parallel_attn_mlp", "d_model"}, "nodes": {name:
{"in_graph"}}, "edges": {name: {"score", "in_graph"}}}`, with nodes `input`, `a{l}.h{h}`,
`m{l}`, `logits` and edges `"u->v"`, where an edge into a head names its input: `"a0.h1->a2.h3<k>"`.
A submission is either one file of importance scores for every edge, or nine binary circuits
holding at most 0.1, 0.2, 0.5, 1, 2, 5, 10, 20 and 50 % of the edges (`SUBMISSION_SIZES`).

Conventions at the border:

* **Sign.** MIB's attribution differentiates a *loss* (minus the logit difference,
  `run_attribution.py`: `loss=True`), so its importance is minus headsteer's edge score (the
  change of the metric when the edge is corrupted). `to_mib` writes `-score`, `from_mib` reads
  it back negated; MIB's signed ranking (`absolute=False`, highest first) then picks the edges
  whose corruption lowers the metric most, as `EdgeScores.ranking(absolute=False)` does.
* **GQA.** MIB un-groups grouped-query attention (every query head has its own k and v input);
  headsteer's k / v edges go to the KV head shared by a group. `to_mib` writes a KV edge as one
  edge per query head of its group, each with the KV edge's score divided by the group size;
  `from_mib` sums a group's scores and keeps a KV edge when any of its group's edges is in the
  circuit. On a model without GQA both are the identity.

`mib_curve` computes MIB's faithfulness curve exactly as `MIB_circuit_track/evaluation.py`
(`evaluate_area_under_curve`) does: for each fraction p of `MIB_PERCENTAGES` the top
`int(p * E)` edges by score (by |score| with `absolute=True`, MIB's default there), pruned as
MIB's `Graph.prune` prunes (edges whose source has no incoming edge or whose target has no
outgoing edge, repeated), evaluated exactly with every other edge corrupted; faithfulness
`(M(C) - M(empty)) / (M(clean) - M(empty))` with M averaged over the pairs; CPR and CMD the
trapezoid areas of f and of |1 - f| over p. Ties in the ranking are broken by graph order
(MIB's `torch.argsort` leaves their order to torch). Tested against MIB's code re-implemented in
`tests/support/mib_reference.py` on a tiny model.

The file format (`write_mib`, `read_mib`, `mib_edge_names`, `mib_top`, the sizes) lives with the
circuit results (`heads.results.mib`) and is imported here under the same names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from heads._util.progress import ProgressArg
from heads._util.validation import check_bool, check_int
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.mib import (
    MIB_PERCENTAGES,
    SUBMISSION_SIZES,
    mib_edge_names,
    mib_top,
    read_mib,
    write_mib,
)
from heads.scorers.circuits.graph import Graph, graph_of
from heads.scorers.circuits.scores import EdgeScores, _check_pairs, patched_metrics
from heads.scorers.patching.metrics import get_metric

if TYPE_CHECKING:  # pragma: no cover
    from heads.model.adapter import HeadModel
    from heads.scorers.patching.metrics import Metric
    from heads.scorers.patching.pairs import PairBatch

__all__ = [
    "MIB_PERCENTAGES",
    "SUBMISSION_SIZES",
    "mib_curve",
    "mib_edge_names",
    "mib_top",
    "read_mib",
    "write_mib",
]


def _faithfulness(
    model: HeadModel,
    pairs: PairBatch,
    masks: torch.Tensor,
    metric: Any,
    batch_rows: int,
    progress: ProgressArg,
) -> list[float]:
    """`(mean M(C) - mean M(empty)) / (mean M(clean) - mean M(empty))` of every circuit mask, the
    empty circuit evaluated as MIB does (its own patched forward: every edge corrupted)."""
    check_int("batch_rows", batch_rows, lo=1)
    met = get_metric(metric)
    pairs = _check_pairs(model, pairs, met)
    graph = graph_of(model)
    empty = torch.zeros(1, *masks.shape[1:], dtype=torch.bool)
    patches = graph.valid[None] & ~torch.cat([empty, masks])
    vals, clean, _ = patched_metrics(
        model,
        pairs,
        patches,
        metric=met,
        batch_rows=batch_rows,
        progress=progress,
        desc="mib",
        return_runs=True,
    )
    base, corrupted = float(clean.double().mean()), float(vals[0].double().mean())
    if abs(base - corrupted) < 1e-8:
        raise HeadsteerValueError(
            "M(clean) equals M(corrupted) on average: faithfulness has no scale for these pairs"
        )
    return [(float(v.double().mean()) - corrupted) / (base - corrupted) for v in vals[1:]]


def mib_curve(
    model: HeadModel,
    pairs: PairBatch,
    scores: EdgeScores | Any,  # or a `Circuit` (its module builds on this one: no import here)
    *,
    absolute: bool = True,
    metric: str | Metric | Any | None = None,
    batch_rows: int = 64,
    progress: ProgressArg = None,
) -> dict:
    """MIB's faithfulness curve of an edge ranking, CPR and CMD (module docstring).

    Args:
        scores: `EdgeScores` or a `Circuit` (its `scores`), in headsteer's sign; MIB ranks
            `-score` when `absolute=False`.
        absolute: rank by |score| (default True, `evaluate_area_under_curve`'s default).
        metric: default the scores' metric.

    Returns:
        `{"percentages", "n_edges" (int(p x E)), "weighted_edge_counts" (edges after pruning),
        "faithfulness", "cpr" (MIB's area_under), "cmd" (area_from_1), "average"}`.

    Raises:
        ValueError: scores of another geometry, a model the graph refuses, pairs whose clean and
            corrupted metric are equal on average. TypeError: scores of another type.
    """
    if not (
        isinstance(getattr(scores, "graph", None), Graph)
        and isinstance(getattr(scores, "scores", None), torch.Tensor)
    ):
        raise HeadsteerTypeError(f"scores must be EdgeScores or a Circuit, got {type(scores).__name__}")
    check_bool("absolute", absolute)
    graph = graph_of(model)
    g = scores.graph
    if (g.n_layers, g.n_heads, g.n_kv_heads) != (graph.n_layers, graph.n_heads, graph.n_kv_heads):
        raise HeadsteerValueError("the scores are for another model geometry")
    s = scores.scores if absolute else -scores.scores  # MIB's importance is -score
    n_items = len(mib_edge_names(graph)) if graph.n_kv_heads == graph.n_heads else graph.n_edges
    ns = [int(p * n_items) for p in MIB_PERCENTAGES]
    masks = torch.stack([mib_top(graph, s, n, absolute=absolute) for n in ns])
    f = _faithfulness(
        model, pairs, masks, metric if metric is not None else scores.metric, batch_rows, progress
    )
    area_under = area_from_1 = 0.0
    for i in range(len(f) - 1):
        dx = MIB_PERCENTAGES[i + 1] - MIB_PERCENTAGES[i]
        area_from_1 += dx * ((abs(1.0 - f[i]) + abs(1.0 - f[i + 1])) / 2)
        area_under += dx * ((f[i] + f[i + 1]) / 2)
    return {
        "percentages": list(MIB_PERCENTAGES),
        "n_edges": ns,
        "weighted_edge_counts": [int(m.sum()) for m in masks],
        "faithfulness": f,
        "cpr": area_under,
        "cmd": area_from_1,
        "average": sum(f) / len(f),
    }
