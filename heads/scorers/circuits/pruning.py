"""Pruning a circuit's edge mask and the sizes of circuits: dangling edges removed (`prune`), the
top-n mask of a ranking, circuit sizes in % of the edges, and the smallest size of a faithfulness
curve reaching a target (`size_for_faithfulness`).

Re-exported by `heads.scorers.circuits.circuit`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from heads._util.validation import check_number, short_repr
from heads.errors import HeadsteerValueError
from heads.scorers.circuits.graph import Graph

__all__ = ["prune", "size_for_faithfulness"]


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
