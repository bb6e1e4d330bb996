"""`EdgeScores`: the score of every edge of a model's circuit graph (`heads.edge_scores`: EAP,
EAP-IG or exact edge patching; the method is `heads.scorers.circuits.scores`), its bootstrap, its
table and its file; and the helpers that read a graph back from a result file (shared with
`Circuit`).

It follows the result protocol (`heads.results.protocol.Result`) and is re-exported from its old
home, `heads.scorers.circuits.scores`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from heads._util.validation import check_int, is_int, is_number, short_repr
from heads.errors import HeadsteerValueError
from heads.results.graph import Graph, edge_frame, head_importance
from heads.results.scores import HeadScores
from heads.results.stability import Stability, stability_of
from heads.results.storage import check_geometry, guarded_load, read_result, write_result

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel

__all__ = [
    "MAX_HEADS",
    "MAX_LAYERS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "EdgeScores",
    "count_edges",
    "edge_index",
    "graph_of_dict",
    "parse_edge",
]

SCHEMA = "headsteer/edge-scores"
SCHEMA_VERSION = 1
MAX_LAYERS = 1024
"""The most layers a circuit file may name (bounds what `Circuit.load` allocates)."""
MAX_HEADS = 1024
"""The most query heads per layer a circuit file may name."""


def graph_of_dict(d: dict, where: str) -> Graph:
    """The `Graph` a circuit dict names, its geometry checked (positive ints, bounded, G | H)
    before anything is allocated."""
    geo = d.get("geometry")
    if not isinstance(geo, dict):
        raise HeadsteerValueError(f"{where}: geometry must be a mapping, got {short_repr(geo)}")
    L = check_int(f"{where}: geometry.n_layers", geo.get("n_layers"), lo=1, hi=MAX_LAYERS)
    H = check_int(f"{where}: geometry.n_heads", geo.get("n_heads"), lo=1, hi=MAX_HEADS)
    G = check_int(f"{where}: geometry.n_kv_heads", geo.get("n_kv_heads"), lo=1, hi=H)
    if H % G:
        raise HeadsteerValueError(f"{where}: geometry.n_kv_heads {G} does not divide n_heads {H}")
    name = d.get("model", "")
    if not isinstance(name, str):
        raise HeadsteerValueError(f"{where}: model must be a string, got {short_repr(name)}")
    return Graph(L, H, G, name)


def count_edges(graph: Graph) -> int:
    """The graph's edge count, computed without allocating its `[U, Dn]` mask."""
    H, S = graph.n_heads, graph.per_layer
    total = graph.n_upstream  # into the logits
    for la in range(graph.n_layers):
        before = 1 + la * (H + 1)
        total += (S - 1) * before + before + H
    return total


def edge_index(graph: Graph) -> dict[str, tuple[int, int]]:
    e = torch.nonzero(graph.valid)
    return dict(zip(graph.edge_names(e), (tuple(x) for x in e.tolist()), strict=True))


def parse_edge(
    graph: Graph, index: dict[str, tuple[int, int]], name: str, field_name: str, where: str
) -> tuple[int, int]:
    """`(u, v)` of edge `name` (a lookup in `index`); a name not there gets `Graph.parse_edge`'s
    message, prefixed with the file and field."""
    if name in index:
        return index[name]
    try:
        graph.parse_edge(name)
    except HeadsteerValueError as err:
        raise HeadsteerValueError(f"{where}: {field_name}: {err}") from None
    raise HeadsteerValueError(f"{where}: {field_name}: {short_repr(name)} is not an edge")  # pragma: no cover


@dataclass
class EdgeScores:
    """Scores of every edge of a graph.

    Attributes:
        graph: the `Graph`.
        scores: `[U, Dn]` fp32; NaN where there is no edge (`graph.valid` False).
        method: `"eap"`, `"eap-ig"` or `"exact"`.
        metric: the metric's name.
        n_pairs: pairs averaged over.
        exact: `[U, Dn]` exact scores of the confirmed edges (NaN elsewhere), or None.
        params: the call's parameters (steps, confirm, ...).
        per_pair: `[N, E]` each pair's score of every edge (`edges()` order; `scores` is their
            mean), kept for the bootstrap (`bootstrap`), or None (not saved: a loaded result
            has none).
    """

    graph: Graph
    scores: torch.Tensor
    method: str
    metric: str = "logit_diff"
    n_pairs: int = 0
    exact: torch.Tensor | None = None
    params: dict = field(default_factory=dict)
    per_pair: torch.Tensor | None = None

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    def __repr__(self) -> str:
        """One line: method, metric, number of edges, pairs (not the tensors)."""
        return (
            f"EdgeScores(method={self.method!r}, metric={self.metric!r}, n_edges={self.scores.numel()}, "
            f"n_pairs={self.n_pairs}, exact={self.exact is not None})"
        )

    def edges(self) -> torch.Tensor:
        """`[E, 2]` long (upstream, downstream) of every edge, in graph order."""
        return torch.nonzero(self.graph.valid)

    def values(self) -> torch.Tensor:
        """`[E]` the scores of `edges()`."""
        e = self.edges()
        return self.scores[e[:, 0], e[:, 1]]

    def ranking(self, absolute: bool = True) -> torch.Tensor:
        """`[E, 2]` edges from the most to the least important (by |score| or by -score)."""
        e, v = self.edges(), self.values()
        key = v.abs() if absolute else -v
        order = torch.argsort(torch.nan_to_num(key, nan=-float("inf")), descending=True, stable=True)
        return e[order]

    def bootstrap(
        self,
        n_resamples: int = 100,
        *,
        k: int = 100,
        seed: int = 0,
        templates: list | None = None,
        by: str = "pairs",
        absolute: bool = True,
        select: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Stability:
        """The bootstrap `Stability` of the edge ranking (by |score| unless `absolute=False`)
        over the pairs, from `per_pair` (no forward pass; `heads.results.stability.stability_of`).
        `select`: `[E]` scores -> `[E]` bool, a circuit's edges (`Stability.inclusion`).

        Raises:
            ValueError: no per-pair values, fewer than 2 pairs, bad arguments.
        """
        if self.per_pair is None:
            raise HeadsteerValueError("these edge scores keep no per-pair values (loaded or built by hand)")
        return stability_of(
            self.per_pair,
            n_resamples=n_resamples,
            k=k,
            seed=seed,
            absolute=absolute,
            names=self.graph.edge_names(self.edges()),
            templates=templates,
            by=by,
            select=select,
            method=f"circuit.{self.method}",
            model=self.graph.model,
            params={"metric": self.metric},
        )

    def head_scores(self) -> HeadScores:
        """`[L, H]` per head, the summed |score| of every edge touching it (its out-edges plus its
        q / k / v in-edges, a KV edge shared evenly by its group's query heads; NaN scores as 0),
        as `Circuit.head_scores()` of the full graph.
        """
        g = self.graph
        return HeadScores(
            head_importance(g, self.scores, g.valid),
            f"circuit_{self.method}" if self.method else "circuit",
            params={"metric": self.metric, "in_circuit": False},
            model=g.model,
            n_kv_heads=g.n_kv_heads,
        )

    def to_frame(self) -> pd.DataFrame:
        """One row per edge of the graph, by decreasing |score| (ties and NaN last, in graph
        order): `edge, source, target, input, source_layer, target_layer, score, exact` (as
        `Circuit.to_frame`)."""
        return edge_frame(self.graph, self.ranking(absolute=True), self.scores, self.exact)

    def to_dict(self) -> dict:
        """The JSON object `save` writes (without the per-pair values)."""
        g = self.graph
        e = self.edges()
        names = g.edge_names(e)
        exact = None
        if self.exact is not None:
            vals = self.exact[e[:, 0], e[:, 1]].tolist()
            exact = {n: float(v) for n, v in zip(names, vals, strict=True) if not math.isnan(v)}
        return {
            "model": g.model,
            "geometry": {"n_layers": g.n_layers, "n_heads": g.n_heads, "n_kv_heads": g.n_kv_heads},
            "method": self.method,
            "metric": self.metric,
            "n_pairs": self.n_pairs,
            "scores": self.values().tolist(),
            "exact": exact,
            "params": self.params,
        }

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write every edge's score as JSON (schema `headsteer/edge-scores`; graph order, NaN as
        null; the exact scores by edge name; the per-pair values are not kept), atomically;
        returns the path.

        Raises:
            HeadsteerValueError: `path` exists and `overwrite` is False, is a symlink or a folder.
        """
        return write_result(path, SCHEMA, SCHEMA_VERSION, self.to_dict(), overwrite=overwrite)

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> EdgeScores:
        """Read a file `save` wrote; with `model`, check it has the graph's geometry.

        Raises:
            FileNotFoundError: no such file.
            HeadsteerValueError: not an edge-scores file, another schema version, a malformed
                field (named: the geometry, a score count of another graph, an unknown edge name),
                a model of another geometry.
        """
        where = str(path)
        d: Any = read_result(path, SCHEMA, SCHEMA_VERSION, "EdgeScores")
        graph = graph_of_dict(d, where)
        if model is not None:
            check_geometry(path, (graph.n_layers, graph.n_heads, graph.n_kv_heads), model)
        scores = d.get("scores")
        n_edges = count_edges(graph)
        if not isinstance(scores, list) or any(s is not None and not is_number(s) for s in scores):
            raise HeadsteerValueError(f"{where}: scores must be a list of numbers (or null)")
        if len(scores) != n_edges:
            raise HeadsteerValueError(
                f"{where}: {len(scores)} scores for a graph of {n_edges} edges (another model geometry)"
            )
        e = torch.nonzero(graph.valid)
        full = torch.full((graph.n_upstream, graph.n_downstream), math.nan)
        full[e[:, 0], e[:, 1]] = torch.tensor([math.nan if s is None else float(s) for s in scores])
        raw_exact = d.get("exact")
        exact = None
        if raw_exact is not None:
            if not isinstance(raw_exact, dict) or not all(is_number(v) for v in raw_exact.values()):
                raise HeadsteerValueError(f"{where}: exact must be null or a mapping edge name -> number")
            exact = torch.full_like(full, math.nan)
            index = edge_index(graph)
            for name, val in raw_exact.items():
                u, v = parse_edge(graph, index, name, "exact", where)
                exact[u, v] = float(val)
        n_pairs, params = d.get("n_pairs", 0), d.get("params", {})
        if not is_int(n_pairs) or n_pairs < 0 or not isinstance(params, dict):
            raise HeadsteerValueError(f"{where}: n_pairs must be an int >= 0 and params a mapping")
        for key in ("method", "metric"):
            if not isinstance(d.get(key, ""), str):
                raise HeadsteerValueError(f"{where}: {key} must be a string, got {short_repr(d.get(key))}")
        return cls(graph, full, d.get("method", ""), d.get("metric", ""), int(n_pairs), exact, dict(params))
