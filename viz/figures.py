"""plotly figures of head scores."""

from __future__ import annotations

import plotly.graph_objects as go

from heads.scores import HeadScores, HeadSet

__all__ = ["head_heatmap"]


def head_heatmap(
    scores: HeadScores,
    *,
    title: str | None = None,
    top_k: int | HeadSet | None = None,
    colorscale: str = "Viridis",
) -> go.Figure:
    """Layer x head heatmap of `scores` (`[n_layers, n_heads]`, layer on the y axis).

    Hover shows layer, head, KV head and score. `top_k` (an int or a `HeadSet`)
    outlines the selected heads with red boxes.
    """
    n_layers, n_heads = scores.n_layers, scores.n_heads
    kv = [[scores.kv_head(h) for h in range(n_heads)] for _ in range(n_layers)]
    z = scores.scores.tolist()
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(n_heads)),
            y=list(range(n_layers)),
            customdata=kv,
            colorscale=colorscale,
            colorbar={"title": "score"},
            hovertemplate="layer %{y}<br>head %{x}<br>KV head %{customdata}<br>score %{z:.4f}<extra></extra>",
        )
    )
    chosen = scores.top(top_k) if isinstance(top_k, int) else top_k
    for layer, head in chosen or ():
        fig.add_shape(
            type="rect",
            x0=head - 0.5,
            x1=head + 0.5,
            y0=layer - 0.5,
            y1=layer + 0.5,
            line={"color": "red", "width": 2},
        )
    fig.update_layout(
        title=title or f"{scores.method} — {scores.model}",
        xaxis_title="head",
        yaxis_title="layer",
        xaxis={"dtick": 1},
        height=max(320, 22 * n_layers + 120),
        width=max(420, 48 * n_heads + 220),
    )
    return fig
