"""plotly figures of QK attribution and head composition.

Signed terms use the figures' diverging convention (`viz.figures.DIVERGING`: ColorBrewer RdBu,
colour-blind safe, white at exactly 0): red raises the head's logit at the cell (the key wins more
attention), blue lowers it.
"""

from __future__ import annotations

import plotly.graph_objects as go
import torch

from heads.errors import HeadsteerValueError
from heads.results.composition import CompositionScores
from heads.results.qk import QKAttribution
from viz.figures import DIVERGING, NEGATIVE, POSITIVE, plain_text

__all__ = [
    "SIGN_NOTE",
    "composition_heatmap",
    "qk_key_map",
    "qk_pair_bars",
    "qk_pair_heatmap",
    "qk_sources_heatmap",
]

SIGN_NOTE = "red = raises the logit (more attention to the key), blue = lowers it"
_DIVERGING = DIVERGING


def _cell_title(
    r: QKAttribution, prompt: int, query: int | None, key: int | None
) -> tuple[str, int, int, int]:
    n, qi, ki = r._cell(prompt, query, key)
    q, k = int(r.queries[n, qi]), int(r.keys[n, ki])
    toks = r.tokens[n] if r.tokens else []
    qt = toks[q] if q < len(toks) else ""
    kt = toks[k] if k < len(toks) else ""
    return f"L{r.layer}H{r.head}: query {q} {qt!r} -> key {k} {kt!r}", n, qi, ki


def qk_pair_bars(
    r: QKAttribution, prompt: int = 0, query: int | None = None, key: int | None = None, *, k: int = 15
) -> go.Figure:
    """The `k` largest (query component x key component) terms of one cell, ranked by |value|."""
    title, n, qi, ki = _cell_title(r, prompt, query, key)
    pairs = r.top_pairs(k, n, int(r.queries[n, qi]), int(r.keys[n, ki]))
    labels = [plain_text(f"{a} · {b}") for a, b, _ in pairs][::-1]
    vals = [v for *_, v in pairs][::-1]
    fig = go.Figure(
        go.Bar(
            x=vals,
            y=labels,
            orientation="h",
            marker={"color": [POSITIVE if v > 0 else NEGATIVE for v in vals]},
            hovertemplate="%{y}<br>%{x:.4f}<extra></extra>",
        )
    )
    fig.update_layout(
        title=plain_text(f"{title}: top terms (query component · key component)"),
        xaxis_title="logit contribution",
        height=max(300, 22 * len(vals) + 120),
        margin={"l": 200},
    )
    return fig


def _top_components(m: torch.Tensor, top: int) -> list[int]:
    return m.abs().argsort(descending=True)[:top].sort().values.tolist()


def qk_pair_heatmap(
    r: QKAttribution, prompt: int = 0, query: int | None = None, key: int | None = None, *, top: int = 12
) -> go.Figure:
    """Component x component heatmap of one cell's terms, for the `top` components of each side
    by |marginal| (the rest of the table sums to the cell's score with them)."""
    title, n, qi, ki = _cell_title(r, prompt, query, key)
    t = r.terms(n, int(r.queries[n, qi]), int(r.keys[n, ki]))
    rows, cols = _top_components(t.sum(1), top), _top_components(t.sum(0), top)
    z = t[rows][:, cols]
    fig = go.Figure(
        go.Heatmap(
            z=z.tolist(),
            x=[plain_text(r.names[c]) for c in cols],
            y=[plain_text(r.names[c]) for c in rows],
            colorscale=_DIVERGING,
            zmid=0,
            colorbar={"title": "logit"},
            hovertemplate="query %{y}<br>key %{x}<br>%{z:.4f}<extra></extra>",
        )
    )
    fig.update_layout(
        title=plain_text(f"{title}: query side (rows) x key side (columns)"),
        xaxis_title="key-side component",
        yaxis_title="query-side component",
        height=max(350, 26 * len(rows) + 160),
    )
    return fig


def qk_key_map(
    r: QKAttribution, side: str = "key", prompt: int = 0, query: int | None = None, *, top: int = 12
) -> go.Figure:
    """For one query, each key position's `side` marginals (components x keys, `top` components by
    mean |marginal| over the keys), the model's pattern above as hover: which components make
    each key win."""
    n, qi, _ = r._cell(prompt, query, None)
    m = r.marginals(side)[n, qi]  # [K, C + 1]
    ok = r.valid[n, qi]
    m = m[ok]
    keys = r.keys[n][ok].tolist()
    comps = _top_components(m.abs().mean(0), top)
    toks = r.tokens[n] if r.tokens else []
    x = [plain_text(f"{k} {toks[k]!r}") if k < len(toks) else str(k) for k in keys]
    pat = r.pattern[n, qi][ok].tolist()
    fig = go.Figure(
        go.Heatmap(
            z=m[:, comps].T.tolist(),
            x=x,
            y=[plain_text(r.names[c]) for c in comps],
            customdata=[pat for _ in comps],
            colorscale=_DIVERGING,
            zmid=0,
            colorbar={"title": "logit"},
            hovertemplate="%{y}<br>key %{x}<br>%{z:.4f}<br>attention %{customdata:.3f}<extra></extra>",
        )
    )
    q = int(r.queries[n, qi])
    fig.update_layout(
        title=plain_text(f"L{r.layer}H{r.head}, query {q}: {side}-side marginals per key"),
        xaxis_title="key position",
        height=max(350, 26 * len(comps) + 160),
    )
    return fig


def qk_sources_heatmap(
    r: QKAttribution,
    side: str = "key",
    prompt: int = 0,
    query: int | None = None,
    key: int | None = None,
    *,
    top: int = 10,
) -> go.Figure:
    """Upstream heads x source tokens of one cell's `side` marginal (`by="source_token"`): which
    head copied which token into the query / key."""
    if r.sources is None:
        raise HeadsteerValueError("this attribution has no source split: compute it with by='source_token'")
    title, n, qi, ki = _cell_title(r, prompt, query, key)
    s = r.sources[side][n, qi, ki]  # [U, T]
    heads = s.abs().sum(1).argsort(descending=True)[:top].tolist()
    length = len(r.tokens[n]) if r.tokens else s.shape[1]
    toks = r.tokens[n] if r.tokens else [str(i) for i in range(length)]
    fig = go.Figure(
        go.Heatmap(
            z=s[heads, :length].tolist(),
            x=[plain_text(f"{u} {t!r}") for u, t in enumerate(toks)],
            y=[plain_text(r.source_heads[h]) for h in heads],
            colorscale=_DIVERGING,
            zmid=0,
            colorbar={"title": "logit"},
            hovertemplate="head %{y}<br>source %{x}<br>%{z:.4f}<extra></extra>",
        )
    )
    fig.update_layout(
        title=plain_text(f"{title}: {side} side by upstream head and source token"),
        xaxis_title="source position (the token the upstream head read)",
        height=max(300, 26 * len(heads) + 160),
    )
    return fig


def composition_heatmap(
    cs: CompositionScores, kind: str = "k", *, reader: tuple[int, int] | None = None
) -> go.Figure:
    """Composition of `kind` (minus the baseline): every writer head (rows) into every reader head
    (columns), `[L*H, L*H]`; or, with `reader`, a layer x head map of the writers into it."""
    t = cs.get(kind)
    L, H = cs.n_layers, cs.n_heads
    what = {"q": "Q", "k": "K", "v": "V"}[kind]
    if reader is not None:
        hs = cs.head_scores(kind, reader=reader)
        z = hs.scores.tolist()
        x: list = list(range(H))
        y: list = list(range(L))
        xt, yt = "writer head", "writer layer"
        title = f"{what}-composition into L{reader[0]}H{reader[1]} ({cs.method})"
    else:
        z = t.reshape(L * H, L * H).tolist()
        names = [f"L{la}H{h}" for la in range(L) for h in range(H)]
        x, y = names, names
        xt, yt = "reader head", "writer head"
        title = f"{what}-composition, writer -> reader ({cs.method})"
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=x,
            y=y,
            colorscale=_DIVERGING,
            zmid=0,
            colorbar={"title": "score - baseline" if cs.method == "weights" else "score"},
            hovertemplate="%{y} -> %{x}<br>%{z:.4f}<extra></extra>",
        )
    )
    fig.update_layout(title=plain_text(f"{title}; {cs.model}"), xaxis_title=xt, yaxis_title=yt, height=600)
    return fig
