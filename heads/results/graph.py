"""The node / edge layout of a circuit graph (`Graph`) and the arithmetic on edge masks that the
circuit results stand on: pruning dangling edges (`prune`), the top-n mask of a ranking, circuit
sizes in % of the edges, the smallest size of a faithfulness curve reaching a target
(`size_for_faithfulness`), each node's summed |score| (`node_importance`) and the edge table
(`edge_frame`).

The layout itself (node and edge indices, names, GQA's KV inputs) is documented in
`heads.scorers.circuits.layout`, which also decides which families a graph covers (`graph_of`);
the decomposed forward that scores edges is `heads.scorers.circuits.graph`. Nothing here runs a
model or imports `heads.scorers` (the results sit below the analyses; `tests/test_layering.py`).

Moved from `heads.scorers.circuits.layout` (`Graph`, still imported there) and
`heads.scorers.circuits.pruning` (that path still imports, with a `DeprecationWarning`, until 0.3.0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from heads._util.validation import check_number, short_repr
from heads.errors import HeadsteerValueError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel

__all__ = ["Graph", "edge_frame", "node_importance", "prune", "size_for_faithfulness"]

EDGE_COLUMNS = ["edge", "source", "target", "input", "source_layer", "target_layer", "score", "exact"]
"""The columns of `edge_frame`."""


@dataclass(frozen=True)
class Graph:
    """The node / edge layout of a model with L layers, H query heads and G KV heads.

    Attributes:
        n_layers: L.
        n_heads: H.
        n_kv_heads: G.
        model: the model name (recorded in saved circuits).
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    model: str = ""

    # ---------------------------------------------------------------- sizes and indices
    @property
    def per_layer(self) -> int:
        """S = H + 2 G + 1 downstream inputs per layer."""
        return self.n_heads + 2 * self.n_kv_heads + 1

    @property
    def n_upstream(self) -> int:
        """U = 1 + L (H + 1) nodes that write to the residual stream."""
        return 1 + self.n_layers * (self.n_heads + 1)

    @property
    def n_downstream(self) -> int:
        """Dn = L S + 1 inputs that read it."""
        return self.n_layers * self.per_layer + 1

    def head_node(self, layer: int, head: int) -> int:
        return 1 + layer * (self.n_heads + 1) + head

    def mlp_node(self, layer: int) -> int:
        return 1 + layer * (self.n_heads + 1) + self.n_heads

    def q_input(self, layer: int, head: int) -> int:
        return layer * self.per_layer + head

    def k_input(self, layer: int, kv: int) -> int:
        return layer * self.per_layer + self.n_heads + kv

    def v_input(self, layer: int, kv: int) -> int:
        return layer * self.per_layer + self.n_heads + self.n_kv_heads + kv

    def mlp_input(self, layer: int) -> int:
        return layer * self.per_layer + self.n_heads + 2 * self.n_kv_heads

    @property
    def logits_input(self) -> int:
        return self.n_layers * self.per_layer

    def n_before(self) -> torch.Tensor:
        """`[Dn]` long: how many upstream nodes precede each downstream input (its possible sources)."""
        H, S = self.n_heads, self.per_layer
        out = torch.empty(self.n_downstream, dtype=torch.long)
        for la in range(self.n_layers):
            out[la * S : (la + 1) * S - 1] = 1 + la * (H + 1)
            out[la * S + S - 1] = 1 + la * (H + 1) + H
        out[-1] = self.n_upstream
        return out

    @property
    def valid(self) -> torch.Tensor:
        """`[U, Dn]` bool: the edges of the graph (u upstream of v)."""
        return torch.arange(self.n_upstream)[:, None] < self.n_before()[None, :]

    @property
    def n_edges(self) -> int:
        return int(self.valid.sum())

    # ---------------------------------------------------------------- names
    def upstream_names(self) -> list[str]:
        names = ["input"]
        for la in range(self.n_layers):
            names += [f"a{la}.h{h}" for h in range(self.n_heads)] + [f"m{la}"]
        return names

    def downstream_names(self) -> list[str]:
        H, G = self.n_heads, self.n_kv_heads
        names: list[str] = []
        for la in range(self.n_layers):
            names += [f"a{la}.h{h}<q>" for h in range(H)]
            kv = "h" if G == H else "g"
            names += [f"a{la}.{kv}{g}<k>" for g in range(G)] + [f"a{la}.{kv}{g}<v>" for g in range(G)]
            names.append(f"m{la}")
        return [*names, "logits"]

    def edge_names(self, index: torch.Tensor) -> list[str]:
        """Names `"u->v"` of edges `index [E, 2]` (upstream, downstream)."""
        up, down = self.upstream_names(), self.downstream_names()
        return [f"{up[u]}->{down[d]}" for u, d in index.tolist()]

    def parse_edge(self, name: str) -> tuple[int, int]:
        """`(u, v)` of an edge name `"a0.h1->m2"`.

        Raises:
            ValueError: an unknown node name or a pair that is not an edge.
        """
        if not isinstance(name, str) or "->" not in name:
            raise HeadsteerValueError(f"edge name must look like 'a0.h1->m2', got {short_repr(name)}")
        a, b = name.split("->", 1)
        up, down = self.upstream_names(), self.downstream_names()
        if a not in up or b not in down:
            raise HeadsteerValueError(f"edge {short_repr(name)} names a node this graph does not have")
        u, d = up.index(a), down.index(b)
        if not bool(self.valid[u, d]):
            raise HeadsteerValueError(f"{short_repr(name)} is not an edge: {a} is not upstream of {b}")
        return u, d

    # ---------------------------------------------------------------- node maps
    def upstream_layer(self) -> torch.Tensor:
        """`[U]` the layer of each upstream node (-1 for input)."""
        out = torch.full((self.n_upstream,), -1, dtype=torch.long)
        for la in range(self.n_layers):
            s = 1 + la * (self.n_heads + 1)
            out[s : s + self.n_heads + 1] = la
        return out

    def down_to_node(self) -> torch.Tensor:
        """`[Dn, U + 1]` bool: which nodes each downstream input belongs to (column U = logits);
        a KV input belongs to every query head of its group."""
        H, G = self.n_heads, self.n_kv_heads
        m = torch.zeros(self.n_downstream, self.n_upstream + 1, dtype=torch.bool)
        grp = H // G
        for la in range(self.n_layers):
            for h in range(H):
                m[self.q_input(la, h), self.head_node(la, h)] = True
                m[self.k_input(la, h // grp), self.head_node(la, h)] = True
                m[self.v_input(la, h // grp), self.head_node(la, h)] = True
            m[self.mlp_input(la), self.mlp_node(la)] = True
        m[self.logits_input, self.n_upstream] = True
        return m

    def check_model(self, model: HeadModel) -> None:
        """ValueError when `model`'s geometry is not this graph's."""
        got = (model.n_layers, model.n_heads, model.n_kv_heads)
        want = (self.n_layers, self.n_heads, self.n_kv_heads)
        if got != want:
            raise HeadsteerValueError(
                f"the circuit is for (n_layers, n_heads, n_kv_heads) = {want}, the model has {got}"
            )


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


def node_importance(graph: Graph, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[U + 1]` summed |score| of the edges of `mask` `[U, Dn]` touching each node (logits last);
    a KV input's edges are shared evenly by its group's query heads. NaN scores count as 0."""
    s = torch.nan_to_num(scores.abs() * mask, nan=0.0)
    out = torch.zeros(graph.n_upstream + 1)
    out[: graph.n_upstream] += s.sum(1)
    d2n = graph.down_to_node().float()
    share = d2n / d2n.sum(1, keepdim=True).clamp(min=1)
    out += s.sum(0) @ share
    return out


def head_importance(graph: Graph, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[L, H]` each head's entry of `node_importance`: the summed |score| of its out-edges plus
    its q / k / v in-edges (KV edges shared by the group)."""
    imp = node_importance(graph, scores, mask)
    idx = torch.tensor(
        [[graph.head_node(la, h) for h in range(graph.n_heads)] for la in range(graph.n_layers)]
    )
    return imp[idx].float()


def edge_frame(
    graph: Graph, edges: torch.Tensor, scores: torch.Tensor, exact: torch.Tensor | None
) -> pd.DataFrame:
    """One row per edge of `edges` `[E, 2]` (upstream, downstream), in that order: `edge, source,
    target, input` (q / k / v / mlp / logits), `source_layer, target_layer` (L for the logits),
    `score` (from `scores` `[U, Dn]`), `exact` (NaN unless `exact` holds it)."""
    import pandas as pd

    names = graph.edge_names(edges)
    up_layer = graph.upstream_layer()
    S = graph.per_layer
    rows = []
    for (u, d), name in zip(edges.tolist(), names, strict=True):
        src, dst = name.split("->")
        kind = dst[dst.index("<") + 1 : -1] if "<" in dst else ("logits" if dst == "logits" else "mlp")
        rows.append(
            {
                "edge": name,
                "source": src,
                "target": dst,
                "input": kind,
                "source_layer": int(up_layer[u]),
                "target_layer": d // S if dst != "logits" else graph.n_layers,
                "score": float(scores[u, d]),
                "exact": float(exact[u, d]) if exact is not None else float("nan"),
            }
        )
    return pd.DataFrame(rows, columns=EDGE_COLUMNS)
