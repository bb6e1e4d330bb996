"""The `Circuit` result (a set of edges of a model's graph, their scores and its faithfulness):
its views, re-cutting without rescoring, its JSON and MIB files; and `select`, which cuts a
circuit from edge scores (top n or above a threshold, pruned).

It follows the result protocol (`heads.results.protocol.Result`). Moved from
`heads.scorers.circuits.result` (that path still imports, with a `DeprecationWarning`, until
0.3.0); re-exported by `heads.scorers.circuits.circuit` (see its docstring for the method).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from heads._util.files import write_text
from heads._util.validation import check_int, check_number, is_int, is_number, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.edges import (
    MAX_HEADS,
    MAX_LAYERS,
    EdgeScores,
    count_edges,
    edge_index,
    graph_of_dict,
    parse_edge,
)
from heads.results.graph import (
    Graph,
    _n_of,
    _top_mask,
    edge_frame,
    head_importance,
    node_importance,
    prune,
    size_for_faithfulness,
)
from heads.results.mib import read_mib, write_mib
from heads.results.scores import HeadScores, HeadSet
from heads.results.stability import Stability
from heads.results.storage import check_schema_version, guarded_load, json_text, nan_for_none

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel

__all__ = [
    "MAX_HEADS",
    "MAX_LAYERS",
    "MOST_HEADS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "Circuit",
    "select",
    "warn_most_heads",
]

SCHEMA = "headsteer/circuit"
SCHEMA_VERSION = 1

# the helpers' old private names (heads.scorers.circuits.circuit re-exports them)
_graph_of_dict, _n_edges, _edge_index, _parse = graph_of_dict, count_edges, edge_index, parse_edge


# ------------------------------------------------------------------------------ the result
@dataclass
class Circuit:
    """A circuit: a set of edges of a model's graph, their scores and its faithfulness.

    Attributes:
        graph: the `Graph`.
        mask: `[U, Dn]` bool, the circuit's edges (after pruning).
        scores: `[U, Dn]` the scores of every edge (NaN off the graph), from `EdgeScores`.
        method: the scoring method of the edges.
        metric: the metric they were scored on.
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

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

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
        return node_importance(self.graph, self.scores, self.mask)

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
        return HeadScores(
            head_importance(g, self.scores, self.mask if in_circuit else g.valid),
            f"circuit_{self.method}" if self.method else "circuit",
            params={"metric": self.metric, "in_circuit": in_circuit},
            model=g.model,
            n_kv_heads=g.n_kv_heads,
        )

    def to_frame(self) -> pd.DataFrame:
        """A pandas DataFrame, one row per circuit edge (by decreasing |score|): edge, source,
        target, input (q/k/v/mlp/logits), source / target layer, score, exact (NaN unless
        confirmed)."""
        return edge_frame(self.graph, self.edges, self.scores, self.exact)

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
                a cut that keeps no edge (a `threshold` above every score, or a `faithfulness`
                reached only by an empty circuit), naming the value;
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
        if out.n_edges == 0:
            ((key, value),) = given.items()
            raise HeadsteerValueError(
                f"select({key}={value!r}) keeps no edge (after pruning); give a cut that keeps at least one"
            )
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
        (`heads.results.mib`; the conventions: `heads.scorers.circuits.mib`).

        Raises:
            ValueError: no `d_model` (given, or recorded by `edge_scores`), an existing file
                without `overwrite`, a symlink, a folder for a file or the reverse.
        """
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
            "schema_version": SCHEMA_VERSION,  # the result protocol's name for "version"
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

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the circuit as JSON (schema `headsteer/circuit`, version 1); returns the path
        (a `Path`; `overwrite` is keyword-only, as every result's `save`).

        Raises:
            ValueError: `path` exists and `overwrite` is False, or is a symlink / folder.
        """
        text = json_text(self.to_dict(), indent=1)
        return write_text(path, text, overwrite=overwrite)

    @classmethod
    def from_dict(cls, d: Any, model: HeadModel | None = None, where: str = "circuit") -> Circuit:
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise HeadsteerValueError(
                f"{where}: not a headsteer circuit (schema must be {short_repr(SCHEMA)})"
            )
        check_schema_version(where, d.get("schema_version"), SCHEMA_VERSION, "circuit")
        if "version" in d:  # the older name, still written: it must agree
            check_schema_version(where, d["version"], SCHEMA_VERSION, "circuit (key 'version')")
        graph = graph_of_dict(d, where)
        if model is not None:
            graph.check_model(model)
        scores = d.get("scores")
        if not isinstance(scores, list) or any(s is not None and not is_number(s) for s in scores):
            raise HeadsteerValueError(
                f"{where}: scores must be a list of numbers (or null), got {short_repr(scores)}"
            )
        n_edges = count_edges(graph)
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
        if curve is not None:  # NaN is saved as null (`json_text`): read it back as NaN
            curve = nan_for_none(curve)
            for key in ("cpr", "cmd", "cpr_random", "cmd_random"):
                if key in curve and curve[key] is None:
                    curve[key] = float("nan")
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
        index = edge_index(graph)

        mask = torch.zeros_like(full, dtype=torch.bool)
        for name in edges:
            u, v = parse_edge(graph, index, name, "edges", where)
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
                u, v = parse_edge(graph, index, name, "exact", where)
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
    @guarded_load
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
