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
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from heads._util.files import write_text
from heads._util.progress import ProgressArg
from heads._util.validation import (
    check_bool,
    check_int,
    check_number,
    check_seed,
    is_int,
    is_number,
    short_repr,
)
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores, HeadSet
from heads.results.stability import Stability, check_stability
from heads.scorers.circuits.graph import Graph, graph_of
from heads.scorers.circuits.scores import (
    METHODS,
    EdgeScores,
    _check_pairs,
    check_steps,
    edge_scores,
    patched_metrics,
)
from heads.scorers.patching.metrics import Metric, get_metric
from heads.scorers.patching.pairs import PairBatch

__all__ = [
    "SIZES",
    "Circuit",
    "areas",
    "circuit_stability",
    "evaluate",
    "faithfulness_curve",
    "find_circuit",
    "prune",
    "select",
    "size_for_faithfulness",
    "warn_most_heads",
    "DEFAULT_FAITHFULNESS",
]

SCHEMA = "headsteer/circuit"
SCHEMA_VERSION = 1
SIZES = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
"""Default circuit sizes of the faithfulness curve, in % of the graph's edges (MIB)."""

DEFAULT_FAITHFULNESS = 0.3
"""The faithfulness the default circuit reaches (`find_circuit`, `headsteer report circuit`): the
smallest size of the curve with f >= 0.3. On IOI with the embedded model that is about 1 % of the
edges, whose heads ablated drop accuracy far below as many random heads (docs/methods/circuits.md);
the old fixed 5 % held most of the model's heads."""

MAX_LAYERS = 1024
"""The most layers a circuit file may name (bounds what `Circuit.load` allocates)."""
MAX_HEADS = 1024
"""The most query heads per layer a circuit file may name."""


def _graph_of_dict(d: dict, where: str) -> Graph:
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


def _n_edges(graph: Graph) -> int:
    """The graph's edge count, computed without allocating its `[U, Dn]` mask."""
    H, S = graph.n_heads, graph.per_layer
    total = graph.n_upstream  # into the logits
    for la in range(graph.n_layers):
        before = 1 + la * (H + 1)
        total += (S - 1) * before + before + H
    return total


def _edge_index(graph: Graph) -> dict[str, tuple[int, int]]:
    e = torch.nonzero(graph.valid)
    return dict(zip(graph.edge_names(e), (tuple(x) for x in e.tolist()), strict=True))


def _parse(
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


# ------------------------------------------------------------------------------ pruning
def prune(graph: Graph, mask: torch.Tensor) -> torch.Tensor:
    """`[U, Dn]` bool: `mask` without dangling edges (repeated until nothing changes).

    An edge u -> v is kept when u is fed (u is the input, or has a kept edge from a fed node
    into one of its inputs) and v's node reaches the logits through kept edges.
    """
    m = mask.clone() & graph.valid
    d2n = graph.down_to_node()  # [Dn, U + 1]
    U = graph.n_upstream
    while True:
        # fed: forward in node order (upstream index order is topological)
        fed = torch.zeros(U + 1, dtype=torch.bool)
        fed[0] = True
        for u in range(1, U + 1):
            downs = d2n[:, u]
            fed[u] = bool((m[:, downs] & fed[:U, None]).any())
        # live: reaches the logits
        live = torch.zeros(U + 1, dtype=torch.bool)
        live[U] = True
        target_live = torch.zeros(graph.n_downstream, dtype=torch.bool)
        for u in range(U, -1, -1):
            if u < U:
                live[u] = bool((m[u] & target_live).any())
            if bool(live[u] and fed[u]):
                target_live |= d2n[:, u]
        new = m & fed[:U, None] & target_live[None, :]
        if torch.equal(new, m):
            return new
        m = new


def _check_sizes(sizes: Any) -> tuple[float, ...]:
    """`sizes` (a non-empty list / tuple of real numbers in (0, 100], never a string or bool) as a
    sorted tuple of distinct floats."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, (list, tuple, range, torch.Tensor)):
        raise HeadsteerValueError(
            f"sizes must be a list of numbers in (0, 100] (% of edges), got {short_repr(sizes)}"
        )
    items = sizes.tolist() if isinstance(sizes, torch.Tensor) else list(sizes)
    if not items:
        raise HeadsteerValueError(
            f"sizes must be a non-empty list of numbers in (0, 100], got {short_repr(sizes)}"
        )
    vals = tuple(
        check_number("sizes", s, lo=0, hi=100, lo_open=True, what="numbers in (0, 100] (% of edges)")
        for s in items
    )
    return tuple(sorted(set(vals)))


def _n_of(graph: Graph, size: float) -> int:
    return max(1, min(graph.n_edges, round(size / 100.0 * graph.n_edges)))


def _top_mask(graph: Graph, ranking: torch.Tensor, n: int) -> torch.Tensor:
    m = torch.zeros(graph.n_upstream, graph.n_downstream, dtype=torch.bool)
    top = ranking[:n]
    m[top[:, 0], top[:, 1]] = True
    return m


def size_for_faithfulness(curve: dict | None, target: float) -> int:
    """The edge count of the smallest circuit of a faithfulness `curve` (`faithfulness_curve`'s
    dict) whose faithfulness reaches `target` (the first size, in increasing order, with
    f >= target).

    Raises:
        ValueError: no curve, or no size of it reaches `target` (names the best f and its size).
    """
    if not isinstance(curve, dict) or not curve.get("faithfulness") or not curve.get("n_edges"):
        raise HeadsteerValueError(
            "choosing a circuit by faithfulness needs its faithfulness curve (find_circuit(curve=True) "
            "or faithfulness_curve)"
        )
    pts = sorted(
        zip(curve["n_edges"], curve["faithfulness"], curve.get("sizes", curve["n_edges"]), strict=True)
    )
    for n, f, _ in pts:
        if f is not None and f >= target:
            return int(n)
    best = max(pts, key=lambda p: -math.inf if p[1] is None else p[1])
    raise HeadsteerValueError(
        f"no circuit of the curve reaches faithfulness {target:g}: the best is {best[1]:.3f} at "
        f"{best[2]:g} % of the edges ({best[0]} edges)"
    )


# ------------------------------------------------------------------------------ the result
@dataclass
class Circuit:
    """A circuit: a set of edges of a model's graph, their scores and its faithfulness.

    Attributes:
        graph: the `Graph`.
        mask: `[U, Dn]` bool, the circuit's edges (after pruning).
        scores: `[U, Dn]` the scores of every edge (NaN off the graph), from `EdgeScores`.
        method, metric: how the scores were made.
        exact: `[U, Dn]` exact scores of confirmed edges (NaN elsewhere), or None.
        faithfulness: f(C) when evaluated, else None.
        curve: the faithfulness curve (`faithfulness_curve`'s dict), or None.
        params: free JSON-serialisable fields (n, threshold, n_pairs, ...).
        stability: the bootstrap over pairs of the edge ranking, with each edge's inclusion
            frequency in the re-selected circuit (`find_circuit(stability=B)`), or None; saved
            on its own (`Stability.save`).
    """

    graph: Graph
    mask: torch.Tensor
    scores: torch.Tensor
    method: str = ""
    metric: str = "logit_diff"
    exact: torch.Tensor | None = None
    faithfulness: float | None = None
    curve: dict | None = None
    params: dict = field(default_factory=dict)
    stability: Stability | None = None

    # ---------------------------------------------------------------- views
    @property
    def n_edges(self) -> int:
        return int(self.mask.sum())

    @property
    def edges(self) -> torch.Tensor:
        """`[E, 2]` (upstream, downstream) of the circuit's edges, by decreasing |score|."""
        e = torch.nonzero(self.mask)
        v = self.scores[e[:, 0], e[:, 1]].abs()
        return e[torch.argsort(torch.nan_to_num(v, nan=-1.0), descending=True, stable=True)]

    def edge_names(self) -> list[str]:
        return self.graph.edge_names(self.edges)

    @property
    def nodes(self) -> list[str]:
        """Names of the circuit's nodes: the sources of its edges, and logits when it has any edge."""
        up = self.graph.upstream_names()
        src = torch.nonzero(self.mask.any(1)).flatten().tolist()
        return [up[i] for i in src] + (["logits"] if self.n_edges else [])

    def node_importance(self) -> torch.Tensor:
        """`[U + 1]` summed |score| of the circuit edges touching each node (logits last);
        a KV input's edges are shared evenly by its group's query heads."""
        g = self.graph
        s = torch.nan_to_num(self.scores.abs() * self.mask, nan=0.0)
        out = torch.zeros(g.n_upstream + 1)
        out[: g.n_upstream] += s.sum(1)
        d2n = g.down_to_node().float()
        share = d2n / d2n.sum(1, keepdim=True).clamp(min=1)
        out += s.sum(0) @ share
        return out

    @property
    def heads(self) -> HeadSet:
        """The circuit's attention heads (those with an outgoing circuit edge; after pruning these
        are fed from the input and reach the logits) as a `HeadSet`, the form `steer.Ablate`
        and the other head steerers take: `Ablate(circuit.heads)`."""
        g = self.graph
        src = self.mask.any(1)
        return HeadSet(
            (la, h) for la in range(g.n_layers) for h in range(g.n_heads) if bool(src[g.head_node(la, h)])
        )

    def head_scores(self, in_circuit: bool = False) -> HeadScores:
        """`[L, H]` `HeadScores`: per head, the summed |score| of its edges (out-edges plus its
        q / k / v in-edges, KV edges shared by the group); every edge of the graph unless
        `in_circuit`."""
        g = self.graph
        c = Circuit(g, self.mask if in_circuit else g.valid, self.scores)
        imp = c.node_importance()
        idx = torch.tensor([[g.head_node(la, h) for h in range(g.n_heads)] for la in range(g.n_layers)])
        return HeadScores(
            imp[idx].float(),
            f"circuit_{self.method}" if self.method else "circuit",
            params={"metric": self.metric, "in_circuit": in_circuit},
            model=g.model,
            n_kv_heads=g.n_kv_heads,
        )

    def to_frame(self):
        """A pandas DataFrame, one row per circuit edge: edge, source, target, input (q/k/v/mlp/
        logits), source / target layer, score, exact (NaN unless confirmed)."""
        import pandas as pd

        e = self.edges
        names = self.graph.edge_names(e)
        rows = []
        up_layer = self.graph.upstream_layer()
        S = self.graph.per_layer
        for (u, d), name in zip(e.tolist(), names, strict=True):
            src, dst = name.split("->")
            kind = dst[dst.index("<") + 1 : -1] if "<" in dst else ("logits" if dst == "logits" else "mlp")
            rows.append(
                {
                    "edge": name,
                    "source": src,
                    "target": dst,
                    "input": kind,
                    "source_layer": int(up_layer[u]),
                    "target_layer": d // S if dst != "logits" else self.graph.n_layers,
                    "score": float(self.scores[u, d]),
                    "exact": float(self.exact[u, d]) if self.exact is not None else float("nan"),
                }
            )
        return pd.DataFrame(
            rows,
            columns=["edge", "source", "target", "input", "source_layer", "target_layer", "score", "exact"],
        )

    def select(
        self,
        *,
        edges: int | None = None,
        fraction: float | None = None,
        faithfulness: float | None = None,
        threshold: float | None = None,
    ) -> Circuit:
        """This circuit re-cut from its saved edge scores, without rescoring (no forward).

        Give exactly one of:

        * `edges`: the top `edges` edges (by |score|, or by the ranking the circuit was selected
          with), pruned as `select` prunes;
        * `fraction`: the top `fraction` of the graph's edges, in (0, 1] (0.01 = 1 %);
        * `faithfulness`: the smallest circuit of the saved faithfulness curve whose exact
          faithfulness f reaches it (needs `curve`; f in the curve's units, 1 = the full model);
        * `threshold`: every edge with |score| >= threshold.

        The new circuit keeps the scores, the curve and the method; its `faithfulness` is the
        curve's value when its size is one of the curve's sizes (the curve evaluated exactly that
        circuit), else None (`evaluate(model, pairs, circuit)` computes it). Its `stability` is
        None (the bootstrap was of the old cut).

        Raises:
            ValueError: not exactly one option; `edges` outside 1..E; `fraction` outside (0, 1];
                `faithfulness` without a saved curve, or above every point of it (the message
                gives the curve's best f and its size).
        """
        given = {k: v for k, v in (("edges", edges), ("fraction", fraction), ("faithfulness", faithfulness),
                                   ("threshold", threshold)) if v is not None}  # fmt: skip
        if len(given) != 1:
            raise HeadsteerValueError(
                "give exactly one of edges=, fraction=, faithfulness= or threshold=, got "
                + (", ".join(given) or "none")
            )
        g = self.graph
        absolute = self.params.get("absolute", True) is not False
        n: int | None = None
        if edges is not None:
            n = check_int("edges", edges, lo=1, hi=g.n_edges)
        elif fraction is not None:
            fr = check_number("fraction", fraction, lo=0, hi=1, lo_open=True)
            n = _n_of(g, 100.0 * fr)
        elif faithfulness is not None:
            target = check_number("faithfulness", faithfulness)
            n = size_for_faithfulness(self.curve, target)
        cut = ("n", "threshold", "absolute", "prune_dangling", "size", "recut_from", "faithfulness_target")
        kept = {k: v for k, v in self.params.items() if k not in cut}
        n_pairs = self.params.get("n_pairs", 0)
        sc = EdgeScores(
            g, self.scores, self.method, self.metric, n_pairs if is_int(n_pairs) else 0, self.exact, kept
        )
        out = select(sc, n, threshold=threshold, absolute=absolute,
                     prune_dangling=self.params.get("prune_dangling", True) is not False)  # fmt: skip
        out.curve = self.curve
        curve = self.curve or {}
        if n is not None and n in curve.get("n_edges", []) and absolute:
            out.faithfulness = float(curve["faithfulness"][curve["n_edges"].index(n)])
        out.params.update(recut_from=self.n_edges)
        warn_most_heads(out)
        return out

    def __repr__(self) -> str:
        f = "" if self.faithfulness is None else f", faithfulness={self.faithfulness:.3f}"
        return (
            f"Circuit({self.graph.model!r}, method={self.method!r}, "
            f"edges={self.n_edges}/{self.graph.n_edges}, "
            f"heads={len(self.heads.heads)}{f})"
        )

    # ---------------------------------------------------------------- MIB format
    def to_mib(
        self,
        path: str | os.PathLike,
        *,
        d_model: int | None = None,
        binary: bool = False,
        overwrite: bool = False,
    ) -> list[Path]:
        """Write the circuit in MIB's circuit-track format: one JSON of importance scores for every
        edge (`in_graph` = this circuit), or with `binary=True` a folder of the nine binary
        circuits at 0.1 .. 50 % of the edges; returns the paths. MIB's importance is -score
        (module `heads.scorers.circuits.mib`: naming, sign, GQA).

        Raises:
            ValueError: no `d_model` (given, or recorded by `edge_scores`), an existing file
                without `overwrite`, a symlink, a folder for a file or the reverse.
        """
        from heads.scorers.circuits.mib import write_mib

        width = d_model if d_model is not None else self.params.get("d_model")
        if width is None:
            raise HeadsteerValueError("MIB's cfg needs the model width: pass d_model=")
        return write_mib(
            self.graph, self.scores, self.mask, path, d_model=width, binary=binary, overwrite=overwrite
        )

    @classmethod
    def from_mib(cls, path: str | os.PathLike, model: HeadModel | None = None) -> Circuit:
        """Read a circuit in MIB's format (importance scores or a binary circuit): `scores` =
        -importance, the `in_graph` edges pruned; `model` checks the geometry and gives the KV
        heads. Raises ValueError for a missing or malformed file (`mib.read_mib`)."""
        from heads.scorers.circuits.mib import read_mib

        graph, scores, mask, d_model = read_mib(path, model)
        params = {"d_model": d_model, "source": os.fspath(path)}
        return cls(graph, prune(graph, mask), scores, "mib", params=params)

    # ---------------------------------------------------------------- save / load
    def to_dict(self) -> dict:
        def num(x: float) -> float | None:
            return None if math.isnan(x) else x

        g = self.graph
        e = torch.nonzero(g.valid)
        all_scores = [num(float(v)) for v in self.scores[e[:, 0], e[:, 1]].tolist()]
        return {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "model": g.model,
            "geometry": {"n_layers": g.n_layers, "n_heads": g.n_heads, "n_kv_heads": g.n_kv_heads},
            "method": self.method,
            "metric": self.metric,
            "edges": self.edge_names(),
            "scores": all_scores,
            "exact": (
                None
                if self.exact is None
                else {
                    n: float(self.exact[u, d])
                    for (u, d), n in zip(e.tolist(), g.edge_names(e), strict=True)
                    if not math.isnan(float(self.exact[u, d]))
                }
            ),
            "faithfulness": self.faithfulness,
            "curve": self.curve,
            "params": self.params,
        }

    def save(self, path: str | os.PathLike, overwrite: bool = False) -> str:
        """Write the circuit as JSON (schema `headsteer/circuit`, version 1); returns the path.

        Raises:
            ValueError: `path` exists and `overwrite` is False, or is a symlink / folder.
        """
        text = json.dumps(self.to_dict(), indent=1, allow_nan=False)
        return str(write_text(path, text, overwrite=overwrite))

    @classmethod
    def from_dict(cls, d: Any, model: HeadModel | None = None, where: str = "circuit") -> Circuit:
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise HeadsteerValueError(
                f"{where}: not a headsteer circuit (schema must be {short_repr(SCHEMA)})"
            )
        if d.get("version") != SCHEMA_VERSION or isinstance(d.get("version"), bool):
            raise HeadsteerValueError(
                f"{where}: circuit schema version {short_repr(d.get('version'))}, this headsteer reads "
                f"{SCHEMA_VERSION}"
            )
        graph = _graph_of_dict(d, where)
        if model is not None:
            graph.check_model(model)
        scores = d.get("scores")
        if not isinstance(scores, list) or any(s is not None and not is_number(s) for s in scores):
            raise HeadsteerValueError(
                f"{where}: scores must be a list of numbers (or null), got {short_repr(scores)}"
            )
        n_edges = _n_edges(graph)
        if len(scores) != n_edges:
            raise HeadsteerValueError(
                f"{where}: {len(scores)} scores for a graph of {n_edges} edges (another model geometry)"
            )
        edges = d.get("edges")
        if not isinstance(edges, list) or not all(isinstance(x, str) for x in edges):
            raise HeadsteerValueError(f"{where}: edges must be a list of edge names, got {short_repr(edges)}")
        raw_exact = d.get("exact")
        if raw_exact is not None and (
            not isinstance(raw_exact, dict)
            or not all(isinstance(k, str) and is_number(v) for k, v in raw_exact.items())
        ):
            raise HeadsteerValueError(
                f"{where}: exact must be null or a mapping edge name -> number, got {short_repr(raw_exact)}"
            )
        faith = d.get("faithfulness")
        if faith is not None and not is_number(faith):
            raise HeadsteerValueError(
                f"{where}: faithfulness must be a number or null, got {short_repr(faith)}"
            )
        curve = d.get("curve")
        if curve is not None and not isinstance(curve, dict):
            raise HeadsteerValueError(f"{where}: curve must be a mapping or null, got {short_repr(curve)}")
        params = d.get("params")
        if params is not None and not isinstance(params, dict):
            raise HeadsteerValueError(f"{where}: params must be a mapping or null, got {short_repr(params)}")
        for key in ("method", "metric"):
            if not isinstance(d.get(key, ""), str):
                raise HeadsteerValueError(f"{where}: {key} must be a string, got {short_repr(d.get(key))}")
        e = torch.nonzero(graph.valid)
        full = torch.full((graph.n_upstream, graph.n_downstream), float("nan"))
        full[e[:, 0], e[:, 1]] = torch.tensor(
            [float("nan") if s is None else float(s) for s in scores], dtype=full.dtype
        )
        index = _edge_index(graph)

        mask = torch.zeros_like(full, dtype=torch.bool)
        for name in edges:
            u, v = _parse(graph, index, name, "edges", where)
            mask[u, v] = True
        pruned = (params or {}).get("prune_dangling", True) is not False  # select(prune_dangling=False)
        if pruned and bool((prune(graph, mask) != mask).any()):
            raise HeadsteerValueError(
                f"{where}: edges include dangling edges (not fed from the input or not reaching the logits)"
            )
        exact = None
        if raw_exact is not None:
            exact = torch.full_like(full, float("nan"))
            for name, val in raw_exact.items():
                u, v = _parse(graph, index, name, "exact", where)
                exact[u, v] = float(val)
        return cls(
            graph,
            mask,
            full,
            str(d.get("method", "")),
            str(d.get("metric", "")),
            exact,
            None if faith is None else float(faith),
            curve,
            dict(params or {}),
        )

    @classmethod
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> Circuit:
        """Read a circuit saved by `save`; with `model`, check it has the circuit's geometry.

        Raises:
            ValueError: a missing or malformed file (not UTF-8 JSON, with line and column; an
                integer of more than 4300 digits: "a number in '<file>' is too large ..."),
                another schema version, or a model whose
                (n_layers, n_heads, n_kv_heads) differ from the circuit's.
        """
        if not os.path.isfile(path):
            raise HeadsteerValueError(f"circuit file {os.fspath(path)!r} does not exist")
        from heads._util.validation import read_json_file

        d = read_json_file(path)  # one line: not JSON (line, column), not UTF-8, a number too large
        return cls.from_dict(d, model, where=os.fspath(path))


# ------------------------------------------------------------------------------ selection
def select(
    scores: EdgeScores,
    n: int | None = None,
    *,
    threshold: float | None = None,
    absolute: bool = True,
    prune_dangling: bool = True,
) -> Circuit:
    """A circuit of the top `n` edges (by |score|, or by -score with `absolute=False`: the
    edges whose corruption lowers the metric most), or of the edges with |score| >= threshold.

    Raises:
        ValueError: neither or both of n and threshold; n outside 1..E.
    """
    if not isinstance(scores, EdgeScores):
        raise HeadsteerTypeError(f"scores must be EdgeScores, got {type(scores).__name__}")
    g = scores.graph
    if (n is None) == (threshold is None):
        raise HeadsteerValueError("give exactly one of n= (top-n edges) or threshold=")
    if n is not None:
        n = check_int("n", n, lo=1, hi=g.n_edges)
        mask = _top_mask(g, scores.ranking(absolute), n)
    else:
        t = check_number("threshold", threshold)
        v = scores.scores.abs() if absolute else -scores.scores
        mask = torch.nan_to_num(v, nan=-float("inf")) >= t
    if prune_dangling:
        mask = prune(g, mask)
    params = {
        "n": n,
        "threshold": threshold,
        "absolute": absolute,
        "prune_dangling": prune_dangling,
        "n_pairs": scores.n_pairs,
    }
    params.update(scores.params)
    return Circuit(g, mask, scores.scores, scores.method, scores.metric, scores.exact, params=params)


# ------------------------------------------------------------------------------ evaluation
def evaluate(
    model: HeadModel,
    pairs: PairBatch,
    circuits: Circuit | torch.Tensor | list[Circuit],
    *,
    metric: str | Metric | Any = "logit_diff",
    batch_rows: int = 64,
    progress: ProgressArg = None,
) -> torch.Tensor:
    """`[K]` exact faithfulness f(C) of K circuits (every non-circuit edge corrupted).

    Args:
        circuits: a `Circuit`, a list of them, or `[K, U, Dn]` bool edge masks.

    Raises:
        ValueError: masks of another graph's shape; a model other than the circuit's geometry.
    """
    check_int("batch_rows", batch_rows, lo=1)
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
    batch_rows: int = 64,
    progress: ProgressArg = None,
) -> dict:
    """The faithfulness curve of `scores`' ranking (and of random circuits of the same sizes).

    Args:
        sizes: circuit sizes in % of the edges, each in (0, 100] (default `SIZES`).
        random: also evaluate random circuits of the same sizes (one per size and draw, each
            draw a random edge order seeded by `seed`), pruned alike.
        n_random: random draws, 1..1000 (default 1); the random curve is the mean over draws,
            `cpr_random` / `cmd_random` the means of the draws' CPR / CMD.
        metric: default the metric the scores were made with.

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
    check_int("batch_rows", batch_rows, lo=1)
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
    f = evaluate(model, pairs, torch.stack(masks), metric=met, batch_rows=batch_rows, progress=progress)
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
    batch_size: int = 8,
    batch_rows: int = 64,
    progress: ProgressArg = True,
    stability: int = 0,
    faithfulness: float | None = None,
) -> Circuit:
    """Score every edge, select a circuit, evaluate it exactly and (optionally) its curve.

    Args:
        method: `"eap"` or `"eap-ig"` (default) or `"exact"`.
        n / size / threshold / faithfulness: the circuit: top `n` edges, the top `size` % of the
            edges, |score| >= threshold, or the smallest size of `sizes` whose exact
            faithfulness reaches `faithfulness` (read from the curve). Default: the smallest
            size reaching `DEFAULT_FAITHFULNESS` (0.3); the method's curve is evaluated for it
            even with `curve=False` (then without the random baseline, and not kept).
        confirm: rerun the top `confirm` edges exactly (`EdgeScores.exact`).
        curve: also compute the faithfulness curve over `sizes` with a random baseline.
        stability: bootstrap resamples of the pairs (default 0: none; e.g. 100): the circuit is
            re-selected (same rule, pruned) on each resample's mean per-pair edge scores, giving
            every edge's inclusion frequency (`circuit.stability`; no extra forward).

    Raises:
        ValueError: bad arguments (checked before any forward; see `edge_scores`, `select`).
    """
    if sum(x is not None for x in (n, size, threshold, faithfulness)) > 1:
        raise HeadsteerValueError("give at most one of n=, size=, threshold= or faithfulness=")
    by_curve = n is None and size is None and threshold is None
    target = DEFAULT_FAITHFULNESS if faithfulness is None else check_number("faithfulness", faithfulness)
    graph = graph_of(model)
    if size is not None:
        (size,) = _check_sizes([size])
    if curve or by_curve:
        _check_sizes(sizes)
    if method not in METHODS:
        raise HeadsteerValueError(f"method must be one of {METHODS}, got {short_repr(method)}")
    check_steps(method, steps)
    check_int("confirm", confirm, lo=0, hi=graph.n_edges)
    check_int("batch_size", batch_size, lo=1)
    check_int("batch_rows", batch_rows, lo=1)
    check_bool("curve", curve)
    stability = check_stability(stability)
    if stability and isinstance(pairs, PairBatch) and pairs.n < 2:
        raise HeadsteerValueError(f"stability={stability} needs at least 2 pairs, got {pairs.n}")
    if n is not None:
        check_int("n", n, lo=1, hi=graph.n_edges)
    if threshold is not None:
        check_number("threshold", threshold)
    if size is not None:
        n = _n_of(graph, size)
    met = get_metric(metric)
    sc = edge_scores(
        model,
        pairs,
        method=method,
        steps=steps,
        metric=met,
        confirm=confirm,
        batch_size=batch_size,
        batch_rows=batch_rows,
        progress=progress,
    )
    fc = None
    if curve or by_curve:
        fc = faithfulness_curve(
            model, pairs, sc, sizes=sizes, random=curve, metric=met, batch_rows=batch_rows
        )
    if by_curve:
        assert fc is not None
        n = size_for_faithfulness(fc, target) if faithfulness is not None else _default_size(fc, target)
    c = select(sc, n, threshold=threshold)
    if by_curve:
        c.params.update(faithfulness_target=target)
    if stability:
        c.stability = circuit_stability(sc, stability, n=n, threshold=threshold, pairs=pairs)
    c.curve = fc if curve else None
    if by_curve and fc is not None and n in fc["n_edges"]:  # the curve evaluated this very circuit
        c.faithfulness = float(fc["faithfulness"][fc["n_edges"].index(n)])
    else:
        c.faithfulness = float(evaluate(model, pairs, c, metric=met, batch_rows=batch_rows)[0])
    warn_most_heads(c)
    return c


def _default_size(curve: dict, target: float) -> int:
    """`size_for_faithfulness`, or, when no size of the curve reaches `target`, the most faithful
    size with a `UserWarning` saying so (the default must give a circuit)."""
    try:
        return size_for_faithfulness(curve, target)
    except HeadsteerValueError as err:
        warnings.warn(f"{err}; taking the most faithful size", UserWarning, stacklevel=3)
        best = max(range(len(curve["n_edges"])), key=lambda i: curve["faithfulness"][i])
        return int(curve["n_edges"][best])


MOST_HEADS = 0.5
"""`warn_most_heads` warns when a circuit holds more than this share of the model's heads."""


def warn_most_heads(circuit: Circuit) -> bool:
    """Warn (`UserWarning`) when `circuit` holds more than `MOST_HEADS` of the model's heads: its
    heads are then most of the model, and ablating them tells little more than ablating as
    many random heads. Returns whether it warned."""
    g = circuit.graph
    k, total = len(circuit.heads), g.n_layers * g.n_heads
    if k <= MOST_HEADS * total:
        return False
    warnings.warn(
        f"the circuit holds {k} of the model's {total} heads ({100 * k / total:.0f} %): ablating them is "
        "close to ablating the model; a smaller cut (circuit.select(fraction=...) or "
        "select(faithfulness=...)) names fewer heads",
        UserWarning,
        stacklevel=3,
    )
    return True
