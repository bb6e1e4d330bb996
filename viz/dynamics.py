"""plotly figures of an analysis over checkpoints (`heads.dynamics`): score heatmaps over steps,
role timelines, overlap curves, and the induction phase change in the style of Olsson et al. 2022
(their Fig. "phase change": loss, in-context-learning score and head scores on one step axis)."""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from heads.dynamics.compare import quantity, role_timelines
from heads.dynamics.phase import PhaseChange
from heads.results.dynamics import CheckpointSeries
from viz.figures import plain_text

__all__ = ["overlap_figure", "phase_change_figure", "role_timeline_figure", "scalars_figure", "steps_heatmap"]


def _log_x(steps: list[int]) -> bool:
    pos = [s for s in steps if s > 0]
    return len(pos) > 2 and max(pos) / min(pos) >= 50


def steps_heatmap(
    series: CheckpointSeries, metric: str | None = None, *, title: str | None = None
) -> go.Figure:
    """Heads (y, `L{layer}.H{head}`) x checkpoints (x, in order, labelled by step) heatmap of
    one per-head metric."""
    wide = series.matrix(metric)
    metric = metric or series.metrics[0]
    steps = [str(s) for s in wide.index]
    fig = go.Figure(
        go.Heatmap(
            z=wide.to_numpy().T.tolist(),
            x=steps,
            y=[plain_text(c) for c in wide.columns],
            colorscale="Viridis",
            colorbar={"title": "score"},
            hovertemplate="step %{x}<br>%{y}<br>score %{z:.4g}<extra></extra>",
        )
    )
    fig.update_layout(
        title=plain_text(title or f"{metric} of every head over training"),
        xaxis={"title": "checkpoint step", "type": "category"},
        yaxis={"title": "head", "autorange": "reversed"},
        height=max(300, 16 * len(wide.columns) + 140),
    )
    return fig


def role_timeline_figure(series: CheckpointSeries, thresholds: Mapping[str, float]) -> go.Figure:
    """Per role: the best head's score over steps (hover: which head), with the threshold."""
    tl = role_timelines(series, thresholds)
    fig = go.Figure()
    for role, g in tl.groupby("role", sort=False):
        fig.add_trace(
            go.Scatter(
                x=g["step"],
                y=g["top_score"],
                mode="lines+markers",
                name=plain_text(role),
                text=[
                    plain_text(f"{h} ({n} heads past {thresholds[str(role)]})")
                    for h, n in zip(g["top_head"], g["n_heads"], strict=True)
                ],
                hovertemplate="step %{x}<br>best %{text}<br>score %{y:.3f}<extra></extra>",
            )
        )
    for role, t in thresholds.items():
        fig.add_hline(
            y=float(t), line_dash="dot", line_color="#999", annotation_text=plain_text(f"{role} {t}")
        )
    fig.update_layout(
        title="role timelines: the best head's score per role",
        xaxis={"title": "step", "type": "log" if _log_x(series.steps) else "linear"},
        yaxis={"title": "score"},
    )
    return fig


def overlap_figure(frame: pd.DataFrame, *, title: str = "circuit overlap between checkpoints") -> go.Figure:
    """Jaccard and weighted overlap per step (`edge_overlap` / `head_overlap`'s table)."""
    fig = go.Figure()
    for col in ("jaccard", "weighted"):
        fig.add_trace(go.Scatter(x=frame["step"], y=frame[col], mode="lines+markers", name=col))
    fig.update_layout(
        title=plain_text(title), xaxis={"title": "step"}, yaxis={"title": "overlap", "range": [0, 1.05]}
    )
    return fig


def scalars_figure(series: CheckpointSeries, metrics: list[str] | None = None) -> go.Figure:
    """Scalar metrics over steps, one line each."""
    fig = go.Figure()
    for m in metrics or series.scalar_metrics:
        s = series.scalar(m)
        fig.add_trace(go.Scatter(x=list(s.index), y=list(s.values), mode="lines+markers", name=plain_text(m)))
    fig.update_layout(
        title="scalars over training",
        xaxis={"title": "step", "type": "log" if _log_x(series.steps) else "linear"},
    )
    return fig


def phase_change_figure(phase: PhaseChange) -> go.Figure:
    """Olsson et al.'s phase-change view: training loss, ICL score, the induction head's and the
    previous-token head's scores, and the K-composition between them on one step axis, with each
    quantity's jump window shaded."""
    s = phase.series
    rows = [("loss", "training loss"), ("icl", "ICL score (nats)"), ("heads", "head scores")]
    if "k_composition" in s.scalar_metrics:
        rows.append(("comp", "K-composition"))
    fig = make_subplots(
        rows=len(rows), cols=1, shared_xaxes=True, vertical_spacing=0.04, subplot_titles=[r[1] for r in rows]
    )
    r = 1
    for name in ("train_loss", "train_loss_repeated", "train_loss_text"):
        if name in s.scalar_metrics:
            q = s.scalar(name).dropna()
            fig.add_trace(
                go.Scatter(x=list(q.index), y=list(q.values), name=name, mode="lines+markers"), row=r, col=1
            )
    r += 1
    q = s.scalar("icl_score")
    fig.add_trace(
        go.Scatter(x=list(q.index), y=list(q.values), name="icl_score", mode="lines+markers"), row=r, col=1
    )
    r += 1
    la, h = phase.heads["induction"]
    pl, ph = phase.heads["previous_token"]
    for metric, (a, b) in (("induction", (la, h)), ("previous_token", (pl, ph))):
        q = quantity(s, metric, head=(a, b))
        fig.add_trace(
            go.Scatter(x=list(q.index), y=list(q.values), name=f"{metric} L{a}.H{b}", mode="lines+markers"),
            row=r,
            col=1,
        )
    if "k_composition" in s.scalar_metrics:
        r += 1
        q = s.scalar("k_composition")
        fig.add_trace(
            go.Scatter(
                x=list(q.index), y=list(q.values), name="k_composition (measured)", mode="lines+markers"
            ),
            row=r,
            col=1,
        )
    colours = {
        "icl": "rgba(255,127,14,0.15)",
        "induction": "rgba(44,160,44,0.15)",
        "previous_token": "rgba(31,119,180,0.15)",
    }
    windows: dict[tuple[int, int], list[str]] = {}
    for key in colours:
        e = phase.jumps.get(key)
        if e is not None and e.step is not None and e.window[0] is not None:
            windows.setdefault((e.window[0], e.step), []).append(key)
    for (lo, hi), keys in windows.items():
        fig.add_vrect(x0=lo, x1=hi, fillcolor=colours[keys[0]], line_width=0, row="all", col=1)
        fig.add_annotation(
            x=hi,
            y=1,
            yref="y domain",
            text=plain_text(", ".join(keys) + f" jump ({lo}, {hi}]"),
            showarrow=False,
            xanchor="left",
            row=1,
            col=1,
        )
    fig.update_layout(height=230 * len(rows), title="the induction phase change", hovermode="x unified")
    fig.update_xaxes(title_text="step", row=len(rows), col=1)
    return fig
