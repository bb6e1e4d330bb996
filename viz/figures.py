"""plotly figures of head scores.

Signed values share one diverging colour convention in every figure, report, widget and the
explorer page: `DIVERGING`, ColorBrewer's colour-blind-safe RdBu as explicit colour stops, blue
for negative, white at exactly 0 (`diverging_range`: the colour range is symmetric about 0, so a
null value is white whatever the data's minimum and maximum) and red for positive. The stops are
explicit because plotly.py's named `"RdBu"` runs red to blue and plotly.js's blue to red: a name
would give the same sign opposite colours in a report and in the explorer. `sign_note` says in
words what the sign of a result means (denoising / noising patching, DLA, edge attribution).

plotly renders a small HTML subset (`<a href>`, `<b>`, `<br>`, ...) in titles, axis
labels, tick labels and hover text. Every string a figure shows goes through
`plain_text`, so a model name, a `HeadScores.method`, a relation name or a token
such as `<a href=...>` is drawn as the characters it is, never as a live link.
"""

from __future__ import annotations

import html

import plotly.graph_objects as go
import torch

from heads.errors import HeadsteerValueError
from heads.inputs.tokens import visible
from heads.results.scores import HeadScores, HeadSet
from heads.results.stability import Stability
from heads.results.views import scores_title

__all__ = [
    "DIVERGING",
    "NEGATIVE",
    "POSITIVE",
    "attention_pattern",
    "add_note",
    "DLA_NOTE",
    "direction_note",
    "diverging_range",
    "is_diverging",
    "sign_note",
    "head_heatmap",
    "mapped_pairs",
    "plain_text",
    "score_distribution",
    "span_share_by_layer",
    "stability_bars",
]


DIVERGING: list[list[float | str]] = [
    [0.0, "#053061"],
    [0.1, "#2166ac"],
    [0.2, "#4393c3"],
    [0.3, "#92c5de"],
    [0.4, "#d1e5f0"],
    [0.5, "#f7f7f7"],
    [0.6, "#fddbc7"],
    [0.7, "#f4a582"],
    [0.8, "#d6604d"],
    [0.9, "#b2182b"],
    [1.0, "#67001f"],
]
"""The diverging colour scale of signed values: ColorBrewer RdBu (11 classes, colour-blind safe),
blue = negative, white (#f7f7f7) = 0, red = positive. Use it with `diverging_range`."""
POSITIVE = "#b2182b"
"""Red of `DIVERGING` for a positive value drawn as a line or a bar."""
NEGATIVE = "#2166ac"
"""Blue of `DIVERGING` for a negative value."""

_DIVERGING_NAMES = {
    name.lower()
    for base in (
        "RdBu",
        "RdYlBu",
        "RdYlGn",
        "RdGy",
        "PiYG",
        "PRGn",
        "BrBG",
        "PuOr",
        "Spectral",
        "balance",
        "curl",
        "delta",
        "diverging",
        "bwr",
        "seismic",
        "coolwarm",
    )  # fmt: skip
    for name in (base, base + "_r")
}


def is_diverging(colorscale: object) -> bool:
    """Whether `colorscale` names a diverging scale (`"RdBu"`, `"RdBu_r"`, `"PiYG"`, ...) or is
    `DIVERGING`: signed values, to be drawn centred on 0."""
    if colorscale is DIVERGING:
        return True
    return isinstance(colorscale, str) and colorscale.lower() in _DIVERGING_NAMES


def diverging_range(values: object) -> dict[str, float]:
    """`{"zmin": -m, "zmax": m, "zmid": 0}` with m the largest finite |value| (1 when there is
    none): the symmetric colour range that puts `DIVERGING`'s white at exactly 0."""
    t = torch.as_tensor(values, dtype=torch.float64)
    finite = t[torch.isfinite(t)]
    m = float(finite.abs().max()) if finite.numel() else 0.0
    m = m if m > 0 else 1.0
    return {"zmin": -m, "zmax": m, "zmid": 0.0}


def direction_note(direction: str) -> str:
    """The sign convention of patching scores in `direction` (`"denoising"` or `"noising"`), in words."""
    if direction == "noising":
        return (
            "noising (corrupted values patched into the clean run): 1 = the site alone destroys the "
            "clean behaviour, 0 = no effect; red > 0 = the site is needed, blue < 0 = removing it helps"
        )
    return (
        "denoising (clean values patched into the corrupted run): 1 = the site alone restores the "
        "clean behaviour, 0 = no effect; red > 0 = restores, blue < 0 = pushes further away"
    )


DLA_NOTE = (
    "direct logit attribution: the answer minus counterfactual logit written; red > 0 = toward the "
    "answer, blue < 0 = toward the counterfactual"
)
"""The sign convention of direct logit attribution, in words."""


def sign_note(scores: HeadScores) -> str | None:
    """What the sign of `scores` means, in words, for the tools whose sign needs saying
    (activation and path patching by direction, DLA, circuits); None for an unsigned method."""
    method, params = scores.method, scores.params
    if method == "patching.dla":
        return DLA_NOTE
    if method.startswith("patching."):
        return direction_note(str(params.get("direction", "denoising")))
    if method.startswith("circuit"):
        return "summed |edge score| of each head's edges (unsigned: how much the head's edges matter)"
    return None


def plain_text(value: object) -> str:
    """`str(value)` with `&`, `<` and `>` as HTML entities, so plotly shows it literally.

    Quotes are left alone: plotly decodes `&lt;`, `&gt;`, `&amp;` but not `&quot;`.
    """
    return html.escape(str(value), quote=False)


def head_heatmap(
    scores: HeadScores,
    *,
    title: str | None = None,
    top_k: int | HeadSet | None = None,
    colorscale: str | list | None = None,
    note: str | None = None,
) -> go.Figure:
    """Layer x head heatmap of `scores` (`[n_layers, n_heads]`, layer on the y axis).

    Hover shows layer, head, KV head and score. `top_k` (an int or a `HeadSet`)
    outlines the selected heads with black boxes. `title` defaults to what the scores hold
    (`heads.results.views.scores_title`: method, relation / task / span, model).

    Colours: signed scores (some below 0 and some above), or any diverging `colorscale` name
    (`"RdBu"`, `"RdBu_r"`, `"PiYG"`, ...), are drawn with `DIVERGING` on a range symmetric about
    0 (white = 0, blue < 0, red > 0); otherwise `colorscale` (default `"Viridis"`). The sign
    convention (`note`, default `sign_note(scores)`) is written under the figure.
    """
    n_layers, n_heads = scores.n_layers, scores.n_heads
    kv = [[scores.kv_head(h) for h in range(n_heads)] for _ in range(n_layers)]
    z = scores.scores.tolist()
    finite = scores.scores[torch.isfinite(scores.scores)]
    signed = bool(finite.numel()) and bool((finite < 0).any()) and bool((finite > 0).any())
    diverging = is_diverging(colorscale) if colorscale is not None else signed
    scale: dict = (
        {"colorscale": DIVERGING, **diverging_range(finite)}
        if diverging
        else {"colorscale": colorscale or "Viridis"}
    )
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(n_heads)),
            y=list(range(n_layers)),
            customdata=kv,
            colorbar={"title": "score"},
            hovertemplate="layer %{y}<br>head %{x}<br>KV head %{customdata}<br>score %{z:.4f}<extra></extra>",
            **scale,
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
            line={"color": "black" if diverging else "red", "width": 2},
        )
    words = note if note is not None else sign_note(scores)
    if words is None and diverging:
        words = "red > 0, white = 0, blue < 0"
    height = max(320, 22 * n_layers + 120)
    fig.update_layout(
        title=plain_text(title or scores_title(scores)),
        xaxis_title="head",
        yaxis_title="layer",
        xaxis={"dtick": 1},
        height=height + (40 if words else 0),
        width=max(420, 48 * n_heads + 220),
    )
    if words:
        add_note(fig, words)
    return fig


def add_note(fig: go.Figure, text: str) -> go.Figure:
    """Write `text` (plain, escaped) under the plot area of `fig`, e.g. its sign convention."""
    import textwrap

    lines = textwrap.wrap(text, 110) or [""]
    fig.add_annotation(
        text="<br>".join(plain_text(line) for line in lines),
        xref="paper",
        yref="paper",
        x=0,
        y=-0.12,
        xanchor="left",
        yanchor="top",
        showarrow=False,
        align="left",
        font={"size": 11},
    )
    fig.update_layout(margin={"b": 90 + 16 * len(lines)})
    return fig


PATTERN_KEYS = 64
"""Key columns an attention-pattern figure shows at first (from just before the span)."""
PATTERN_ROWS = 32
"""Query rows (the last ones) an attention-pattern figure shows at first."""
PATTERN_HEIGHT = 640
"""Height in px of an attention-pattern figure; its width follows the page."""


def attention_pattern(
    probs: torch.Tensor,
    tokens: list[str],
    *,
    span: tuple[int, int] | list[tuple[int, int]] | None = None,
    title: str = "attention pattern",
) -> go.Figure:
    """Heatmap of one head's attention pattern `[T, T]` (query rows, key columns).

    `tokens` label both axes; `span` (token ranges, half-open) is outlined in red on
    the key axis. The figure fits the page width (`autosize`, no fixed width; height
    `PATTERN_HEIGHT`) and opens on what matters: the last `PATTERN_ROWS` query rows and
    `PATTERN_KEYS` key columns from two tokens before the first span (the whole pattern when
    it is smaller). Zoom and pan freely; the autoscale button shows the whole pattern.
    """
    probs = probs.detach().float().cpu()
    if probs.ndim != 2 or probs.shape[0] != probs.shape[1] or probs.shape[0] != len(tokens):
        raise HeadsteerValueError(
            f"probs must be [T, T] with T = {len(tokens)} tokens, got {tuple(probs.shape)}"
        )
    n = len(tokens)
    labels = [plain_text(f"{i}:{visible(t)}") for i, t in enumerate(tokens)]
    fig = go.Figure(
        go.Heatmap(
            z=probs.tolist(),
            x=labels,
            y=labels,
            colorscale="Blues",
            colorbar={"title": "attention"},
            hovertemplate="query %{y}<br>key %{x}<br>p %{z:.4f}<extra></extra>",
        )
    )
    spans = [span] if isinstance(span, tuple) else (span or [])
    for t0, t1 in spans:
        fig.add_shape(
            type="rect",
            x0=t0 - 0.5,
            x1=t1 - 0.5,
            y0=-0.5,
            y1=n - 0.5,
            line={"color": "red", "width": 2},
        )
    k0 = max(0, min(t0 for t0, _ in spans) - 2) if spans else max(0, n - PATTERN_KEYS)
    k1 = min(n, k0 + PATTERN_KEYS)
    q0 = max(0, n - PATTERN_ROWS)
    fig.update_layout(
        title=plain_text(title),
        xaxis={"title": "key", "range": [k0 - 0.5, k1 - 0.5]},
        yaxis={"title": "query", "range": [n - 0.5, q0 - 0.5]},  # reversed: the first row on top
        autosize=True,
        height=PATTERN_HEIGHT,
        margin={"l": 120, "r": 20, "t": 60, "b": 120},
    )
    return fig


def span_share_by_layer(before: torch.Tensor, after: torch.Tensor, *, title: str | None = None) -> go.Figure:
    """Line plot of the span's attention share per layer (mean over heads), before vs after steering.

    `before`/`after`: `[n_layers, n_heads]` shares (e.g. `span_attention(...).scores`).
    """
    layers = list(range(before.shape[0]))
    fig = go.Figure()
    for name, s in (("unsteered", before), ("steered", after)):
        fig.add_trace(go.Scatter(x=layers, y=s.float().mean(1).tolist(), mode="lines+markers", name=name))
    fig.update_layout(
        title=plain_text(title or "attention share on the span (mean over heads)"),
        xaxis_title="layer",
        yaxis_title="share of last-position attention",
        height=380,
    )
    return fig


def score_distribution(scores: HeadScores, *, title: str | None = None) -> go.Figure:
    """Box plot of head scores per layer."""
    fig = go.Figure()
    for layer in range(scores.n_layers):
        fig.add_trace(
            go.Box(
                y=scores.scores[layer].tolist(),
                name=str(layer),
                boxpoints="all",
                marker={"size": 3},
                showlegend=False,
            )
        )
    fig.update_layout(
        title=plain_text(title or f"{scores.method}: score distribution per layer"),
        xaxis_title="layer",
        yaxis_title="score",
        height=380,
    )
    return fig


def mapped_pairs(salient, *, title: str = "salient operations") -> go.Figure:
    """Bar chart of a head's most amplified source tokens (sigma), labelled with their top targets.

    `salient`: the DataFrame from `heads.scorers.maps.static.salient_operations`.
    """
    src = [plain_text(repr(s)) for s in salient["source"]]
    targets = [plain_text(", ".join(repr(t) for t in ts)) for ts in salient["targets"]]
    fig = go.Figure(
        go.Bar(
            x=salient["sigma"].tolist()[::-1],
            y=src[::-1],
            orientation="h",
            text=targets[::-1],
            textposition="auto",
            hovertemplate="%{y} → %{text}<br>sigma %{x:.3f}<extra></extra>",
        )
    )
    fig.update_layout(
        title=plain_text(title),
        xaxis_title="sigma = ||e W_VO|| / ||e||",
        height=max(350, 28 * len(src) + 120),
    )
    return fig


def stability_bars(stability: Stability, k: int | None = None, *, title: str | None = None) -> go.Figure:
    """The top `k` items (default: the stability's top k, at least 10) by full-sample rank: the
    score with its 95 % bootstrap interval as error bars, the rank interval and P(in top k) in the
    hover text; stable items (`Stability.stable`) drawn dark with a star in their label.

    Raises:
        HeadsteerValueError: `k` < 1.
    """
    k = max(stability.k, 10) if k is None else k
    if k < 1:
        raise HeadsteerValueError(f"k must be >= 1, got {k}")
    f = stability.to_frame().head(k)
    names = [plain_text(n) + (" *" if s else "") for n, s in zip(f["item"], f["stable"], strict=True)]
    hover = [
        f"rank {r.rank} [{r.rank_low}, {r.rank_high}]<br>P(top {stability.k}) {r.p_top_k:.2f}"
        for r in f.itertuples()
    ]
    fig = go.Figure(
        go.Bar(
            x=names,
            y=f["score"],
            error_y={"type": "data", "symmetric": False, "array": f["high"] - f["score"],
                     "arrayminus": f["score"] - f["low"]},
            marker_color=["#1f3b73" if s else "#9db4d8" for s in f["stable"]],
            hovertext=hover,
        )
    )  # fmt: skip
    s = stability.summary()
    fig.update_layout(
        title=plain_text(
            title
            or f"{stability.method or 'ranking'}: top {k}, 95% bootstrap intervals "
            f"({stability.n_resamples} resamples); * stable in the top {stability.k}; "
            f"top-{stability.k} Jaccard {s['jaccard_mean']:.2f}"
        ),
        yaxis_title="score",
    )
    return fig
