"""Circuit figures: the circuit graph and the faithfulness curve (plotly).

`circuit_figure(circuit)`: layers as rows from the input (top) to the logits (bottom), heads
left to right with each layer's MLP at the right end; node size grows with the node's summed
|edge score| in the circuit, edge width with |score|, edge colour the score's sign (red: the
metric rises when the edge is corrupted, blue: it falls). Edges into a KV input are drawn to
the first query head of the group (the hover names the KV head).

`circuit_figure(circuit, heads_only=True)` leaves the input, the MLPs and their edges out (the
head-to-head and head-to-logits edges remain); `threshold=` draws only edges with |score| >= it.

`curve_figure(circuit.curve)`: faithfulness f over circuit size (% of edges, log axis labelled at
the measured sizes) for the method and for random circuits of the same sizes, with CPR / CMD in
the legend.

Colours follow the figures' diverging convention (`viz.figures.DIVERGING`): red for a positive
score, blue for a negative one. An EAP / EAP-IG / exact score is the change of the metric when
the edge alone is corrupted, so an edge the behaviour relies on is blue.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
import torch

from heads._util.validation import check_bool, check_number, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.scorers.circuits import Circuit
from viz.figures import NEGATIVE, POSITIVE

__all__ = ["circuit_figure", "curve_figure"]

_POS, _NEG = POSITIVE, NEGATIVE


def _positions(circuit: Circuit) -> dict[int, tuple[float, float]]:
    """Upstream node index (and U for logits) -> (x, y); y = -row so the input is on top."""
    g = circuit.graph
    pos: dict[int, tuple[float, float]] = {0: ((g.n_heads) / 2.0, 0.0)}
    for la in range(g.n_layers):
        for h in range(g.n_heads):
            pos[g.head_node(la, h)] = (float(h), -(2.0 * la + 1))
        pos[g.mlp_node(la)] = (float(g.n_heads) + 0.5, -(2.0 * la + 2))
    pos[g.n_upstream] = (g.n_heads / 2.0, -(2.0 * g.n_layers + 1))
    return pos


def _target_node(circuit: Circuit, d: int) -> int:
    g = circuit.graph
    if d == g.logits_input:
        return g.n_upstream
    la, r = divmod(d, g.per_layer)
    H, G = g.n_heads, g.n_kv_heads
    if r < H:
        return g.head_node(la, r)
    if r < H + 2 * G:
        kv = (r - H) % G
        return g.head_node(la, kv * (H // G))
    return g.mlp_node(la)


def _is_head(circuit: Circuit, node: int) -> bool:
    g = circuit.graph
    return 0 < node < g.n_upstream and (node - 1) % (g.n_heads + 1) != g.n_heads


def circuit_figure(
    circuit: Circuit,
    *,
    max_edges: int = 400,
    title: str | None = None,
    heads_only: bool = False,
    threshold: float | None = None,
) -> go.Figure:
    """The circuit as a layered graph (see the module docstring).

    Args:
        max_edges: draw at most this many edges (the largest |score|; default 400).
        title: the figure's title (default: the circuit's edge and head counts).
        heads_only: leave out the input, the MLPs and every edge from or into them (default
            False): heads, their edges and the logits only.
        threshold: draw only edges with |score| >= threshold (default None: all).

    Raises:
        TypeError: not a `Circuit`.
        ValueError: max_edges < 1; a threshold that is not a finite number >= 0.
    """
    if not isinstance(circuit, Circuit):
        raise HeadsteerTypeError(f"circuit_figure needs a Circuit, got {type(circuit).__name__}")
    if isinstance(max_edges, bool) or not isinstance(max_edges, int) or max_edges < 1:
        raise HeadsteerValueError(f"max_edges must be a positive int, got {short_repr(max_edges)}")
    check_bool("heads_only", heads_only)
    if threshold is not None:
        check_number("threshold", threshold, lo=0)
    g = circuit.graph
    pos = _positions(circuit)
    names = [*g.upstream_names(), "logits"]
    down = g.downstream_names()
    edges = circuit.edges
    if heads_only and len(edges):
        tgt = torch.tensor([_target_node(circuit, int(d)) for d in edges[:, 1].tolist()])
        keep = torch.tensor([_is_head(circuit, int(u)) for u in edges[:, 0].tolist()])
        keep &= torch.tensor([t == g.n_upstream or _is_head(circuit, int(t)) for t in tgt.tolist()])
        edges = edges[keep]
    if threshold is not None and len(edges):
        edges = edges[circuit.scores[edges[:, 0], edges[:, 1]].abs() >= threshold]
    edges = edges[:max_edges]
    scores = circuit.scores[edges[:, 0], edges[:, 1]] if len(edges) else torch.zeros(0)
    top = float(scores.abs().max()) if len(scores) else 1.0
    fig = go.Figure()
    # edges binned by width (4 bins) and sign: one trace each
    for sign, color in ((1, _POS), (-1, _NEG)):
        for b in range(4):
            lo, hi = b / 4 * top, (b + 1) / 4 * top
            xs: list[float | None] = []
            ys: list[float | None] = []
            for (u, d), s in zip(edges.tolist(), scores.tolist(), strict=True):
                a = abs(s)
                if (s >= 0) != (sign > 0) or not (lo <= a <= hi if b == 3 else lo <= a < hi):
                    continue
                (x0, y0), (x1, y1) = pos[u], pos[_target_node(circuit, d)]
                xs += [x0, x1, None]
                ys += [y0, y1, None]
            if xs:
                fig.add_trace(
                    go.Scatter(
                        x=xs,
                        y=ys,
                        mode="lines",
                        line={"width": 0.8 + 5 * (b + 1) / 4, "color": color},
                        opacity=0.55,
                        hoverinfo="skip",
                        showlegend=False,
                    )
                )
    # edge midpoints carry the hover text
    if len(edges):
        mx, my, txt = [], [], []
        for (u, d), s in zip(edges.tolist(), scores.tolist(), strict=True):
            (x0, y0), (x1, y1) = pos[u], pos[_target_node(circuit, d)]
            mx.append((x0 + x1) / 2)
            my.append((y0 + y1) / 2)
            txt.append(f"{names[u]} -> {down[d]}<br>score {s:+.4g}")
        fig.add_trace(
            go.Scatter(
                x=mx, y=my, mode="markers", marker={"size": 4, "opacity": 0}, text=txt,
                hovertemplate="%{text}<extra></extra>", showlegend=False,
            )
        )  # fmt: skip
    imp = circuit.node_importance()
    on = set(circuit.mask.any(1).nonzero().flatten().tolist()) | {g.n_upstream}
    for d in circuit.mask.any(0).nonzero().flatten().tolist():
        on.add(_target_node(circuit, d))
    mx_imp = float(imp.max()) if float(imp.max()) > 0 else 1.0
    xs2, ys2, sizes, texts, colors = [], [], [], [], []
    for n, (x, y) in pos.items():
        if heads_only and not (_is_head(circuit, n) or n == g.n_upstream):
            continue
        active = n in on
        xs2.append(x)
        ys2.append(y)
        sizes.append(6 + 26 * math.sqrt(float(imp[n]) / mx_imp) if active else 4)
        texts.append(f"{names[n]}<br>importance {float(imp[n]):.4g}")
        kind = "#444" if n in (0, g.n_upstream) else ("#2ca02c" if names[n].startswith("m") else "#ff7f0e")
        colors.append(kind if active else "#dddddd")
    fig.add_trace(
        go.Scatter(
            x=xs2, y=ys2, mode="markers", marker={"size": sizes, "color": colors, "line": {"width": 0}},
            text=texts, hovertemplate="%{text}<extra></extra>", showlegend=False,
        )
    )  # fmt: skip
    ticks = [0.0] + [-(2.0 * la + 1) for la in range(g.n_layers)] + [-(2.0 * g.n_layers + 1)]
    labels = ["input"] + [f"layer {la}" for la in range(g.n_layers)] + ["logits"]
    view = " (heads only)" if heads_only else ""
    view += f", |score| >= {threshold:g}" if threshold is not None else ""
    fig.update_layout(
        title=title or f"circuit: {circuit.n_edges} edges, {len(circuit.heads.heads)} heads{view}",
        xaxis={"title": "head (MLP at the right)", "zeroline": False},
        yaxis={"tickvals": ticks, "ticktext": labels, "zeroline": False},
        height=max(420, 28 * g.n_layers + 160),
        plot_bgcolor="white",
    )
    return fig


def curve_figure(curve: dict, *, method: str = "method") -> go.Figure:
    """Faithfulness over circuit size for the method and the random baseline.

    Raises:
        ValueError: a dict without `sizes` and `faithfulness` (a `faithfulness_curve` result).
    """
    if not isinstance(curve, dict) or "sizes" not in curve or "faithfulness" not in curve:
        raise HeadsteerValueError("curve_figure needs a faithfulness_curve dict (sizes, faithfulness)")
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=curve["sizes"], y=curve["faithfulness"], mode="lines+markers",
            name=f"{method} (CPR {curve['cpr']:.3f}, CMD {curve['cmd']:.3f})",
        )
    )  # fmt: skip
    if "random" in curve:
        fig.add_trace(
            go.Scatter(
                x=curve["sizes"], y=curve["random"], mode="lines+markers", line={"dash": "dot"},
                name=f"random (CPR {curve['cpr_random']:.3f}, CMD {curve['cmd_random']:.3f})",
            )
        )  # fmt: skip
    fig.add_hline(y=1.0, line={"color": "#999", "dash": "dash"})
    ticks = [float(x) for x in curve["sizes"]]
    fig.update_layout(
        # one label per measured size (plotly's own log ticks label the minor ticks "2 5 1 2 5")
        xaxis={
            "title": "circuit size (% of edges)",
            "type": "log",
            "tickvals": ticks,
            "ticktext": [f"{x:g}" for x in ticks],
        },  # fmt: skip
        yaxis={"title": "faithfulness f(C)"},
        height=380,
    )
    return fig
