"""`headsteer report training`: analyses over the checkpoints of a training run (or two models:
base and tuned) on one page.

For each analysis, `heads.dynamics.over_checkpoints` runs it on every checkpoint (one model in
memory) and writes each checkpoint's result atomically into a folder beside the page
(`<page stem>_checkpoints/<analysis>/`), so a killed run continues where it stopped. The page
shows per analysis: every per-head metric as a heads x steps heatmap; the role timelines and the
emergence step of each role (threshold `ROLE_THRESHOLDS`); function persistence (hand-overs);
scalars over steps; circuit-edge overlap between checkpoints; with exactly two checkpoints, what
changed (the last minus the first, and the heads that changed most); for `induction_phase`, the
phase change (`heads.dynamics.phase`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from heads._util.files import check_output
from heads._util.progress import Progress, ProgressArg, offset_progress, progress_callback
from heads.dynamics import (
    ANALYSES,
    CheckpointSeries,
    Emergence,
    component_emergence,
    edge_overlap,
    emergence,
    find_checkpoints,
    over_checkpoints,
    persistence,
)
from heads.dynamics.analyses import Analysis
from heads.dynamics.phase import phase_change
from heads.errors import HeadsteerValueError
from heads.results.scores import HeadScores
from heads.scorers.roles.atlas import ROLE_THRESHOLDS
from viz.dynamics import (
    overlap_figure,
    phase_change_figure,
    role_timeline_figure,
    scalars_figure,
    steps_heatmap,
)
from viz.figures import DIVERGING, head_heatmap
from viz.reports.base import Report

__all__ = ["PAIR_ANALYSES", "default_params", "results_folder", "training_report"]

PAIR_ANALYSES = ("dla", "patching", "circuit")
"""Analyses that read clean / corrupted pairs (`--task`)."""
MAX_HEATMAPS = 6
"""Per-head metrics drawn as heatmaps per analysis (an atlas has more; the tables keep them all)."""


def default_params(analysis: str, *, task: str = "ioi", n_pairs: int = 16, n_prompts: int = 8) -> dict:
    """The parameters the CLI gives `analysis`: the shipped task's first `n_pairs` test pairs for
    `dla` / `patching` / `circuit` (`circuit`: EAP-IG, 5 % of the edges), the first `n_prompts`
    harmful test requests for `ships`, the shipped relations for `maps`, none otherwise.

    Raises:
        HeadsteerValueError: an unknown analysis or task.
    """
    if analysis not in ANALYSES:
        raise HeadsteerValueError(f"unknown analysis {analysis!r}: one of {', '.join(ANALYSES)}")
    if analysis in PAIR_ANALYSES:
        from probes.datasets.pairs import load_task_pairs

        pairs = [dataclasses.asdict(p) for p in load_task_pairs(task, split="test", n=n_pairs)]
        return {"pairs": pairs, **({"size": 5.0} if analysis == "circuit" else {})}
    if analysis == "ships":
        from probes.datasets.requests import load_requests

        return {"prompts": [r["prompt"] for r in load_requests("harmful", "test")[:n_prompts]]}
    if analysis == "maps":
        from probes.datasets.relations import relation_records

        return {"relations": {r["relation"]: r["pairs"] for r in relation_records()}}
    return {}


def results_folder(out: str | os.PathLike) -> Path:
    """Where the per-checkpoint results of the page `out` go: `<stem>_checkpoints/` beside it."""
    p = Path(out).expanduser()
    return p.with_name(f"{p.stem}_checkpoints")


def _emergence_rows(series: CheckpointSeries) -> pd.DataFrame:
    rows = []
    for role, t in ROLE_THRESHOLDS.items():
        if role not in series.metrics:
            continue
        e = emergence(series, role, threshold=t)
        p = persistence(series, role, t)
        rows.append({"role": role, "threshold": t, **_e(e), "hand-overs": p["n_handovers"]})
    return pd.DataFrame(rows)


def _e(e: Emergence) -> dict:
    return {
        "emerges at step": e.step,
        "window": f"({e.window[0]}, {e.window[1]}]" if e.step is not None else "not by the last step",
        "first": float(e.values.iloc[0]),
        "last": float(e.values.iloc[-1]),
    }


def _diff(series: CheckpointSeries, metric: str) -> HeadScores:
    first, last = series.steps[0], series.steps[-1]
    a, b = series.head_scores(first, metric), series.head_scores(last, metric)
    names = list(series.checkpoints["checkpoint"])
    return HeadScores(
        b.scores - a.scores, f"{metric}: {names[-1]} - {names[0]}", model=f"{names[0]} -> {names[-1]}"
    )


def _top_changes(series: CheckpointSeries, k: int = 10) -> pd.DataFrame:
    first, last = series.steps[0], series.steps[-1]
    s = series.scores
    a = s[s["step"] == first].set_index(["metric", "layer", "head"])["score"]
    b = s[s["step"] == last].set_index(["metric", "layer", "head"])["score"]
    d = (b - a).dropna()
    top = d.reindex(d.abs().sort_values(ascending=False).index).head(k)
    return pd.DataFrame(
        [
            {
                "metric": m,
                "head": f"L{la}.H{h}",
                "first": float(a[(m, la, h)]),
                "last": float(b[(m, la, h)]),
                "change": float(v),
            }
            for (m, la, h), v in top.items()
        ]
    )


def _edges_changed(series: CheckpointSeries) -> pd.DataFrame:
    e = series.edges
    first, last = series.steps[0], series.steps[-1]
    a = {
        f"{s}->{t}": v
        for s, t, v in e[e["step"] == first][["source", "target", "score"]].itertuples(index=False)
    }
    b = {
        f"{s}->{t}": v
        for s, t, v in e[e["step"] == last][["source", "target", "score"]].itertuples(index=False)
    }
    rows = [{"edge": k, "in": "last only", "score": b[k]} for k in b if k not in a]
    rows += [{"edge": k, "in": "first only", "score": a[k]} for k in a if k not in b]
    return pd.DataFrame(rows, columns=["edge", "in", "score"]).sort_values("score", key=abs, ascending=False)


def _section(rep: Report, name: str, series: CheckpointSeries, summary: dict) -> None:
    two = len(series.steps) == 2
    rep.text(f"Analysis: {name}", f"{len(series.steps)} checkpoints; parameters as in the page header.")
    for metric in series.metrics[:MAX_HEATMAPS]:
        rep.figure(
            f"{name}: {metric} over training",
            steps_heatmap(series, metric),
            note="Every head's score at every checkpoint (columns in step order).",
        )
        if two:
            rep.figure(
                f"{name}: {metric}, what changed",
                head_heatmap(
                    _diff(series, metric), colorscale=DIVERGING, note="last minus first: red rose, blue fell"
                ),
                note="The last checkpoint's score minus the first's, per head (white: unchanged).",
            )
    if two and not series.scores.empty:
        changes = _top_changes(series)
        rep.table(f"{name}: the heads that changed most", changes)
        summary["top_changes"] = changes.to_dict("records")
    roles = {r: t for r, t in ROLE_THRESHOLDS.items() if r in series.metrics}
    if roles and not two:
        rep.figure(
            f"{name}: role timelines",
            role_timeline_figure(series, roles),
            note="The best head's score per role at each checkpoint; dotted: the role's threshold.",
        )
        table = _emergence_rows(series)
        rep.table(
            f"{name}: when each role appears",
            table,
            note="First checkpoint from which the best head stays at or above the threshold, the window "
            "it crossed in, and how often the role moved to another head (hand-overs).",
        )
        summary["emergence"] = table.to_dict("records")
        first = next(iter(roles))
        comp = component_emergence(series, first, roles[first])
        rep.table(f"{name}: when each head becomes a {first} head", comp.head(20))
    if not series.roles.empty:
        counts = pd.crosstab(series.roles["step"], series.roles["role"])
        rep.table(f"{name}: heads per atlas role and step", counts.reset_index())
    if not series.scalars.empty:
        rep.figure(f"{name}: scalars", scalars_figure(series))
        rep.table(
            f"{name}: scalars",
            series.scalars.pivot_table(index="step", columns="metric", values="value").reset_index(),
        )
    if not series.edges.empty and len(series.steps) > 1:
        prev, final = edge_overlap(series), edge_overlap(series, reference="final")
        rep.figure(f"{name}: circuit overlap with the previous checkpoint", overlap_figure(prev))
        rep.figure(
            f"{name}: circuit overlap with the final checkpoint",
            overlap_figure(final, title="overlap with the final circuit"),
        )
        summary["edge_overlap_previous"] = prev.to_dict("records")
        if two:
            rep.table(f"{name}: edges gained and lost", _edges_changed(series))
    if name == "induction_phase":
        phase = phase_change(series)
        rep.figure(
            "The induction phase change",
            phase_change_figure(phase),
            note="Loss, in-context-learning score, the final top induction and previous-token heads, and "
            "their K-composition over training; shaded: each quantity's jump window (midpoint rule).",
        )
        rows = [
            {"quantity": k, **e.to_dict(), "first": float(e.values.iloc[0]), "last": float(e.values.iloc[-1])}
            for k, e in phase.jumps.items()
        ]
        note = (
            None
            if phase.detected
            else (
                "No induction head holds its role (score >= 0.5) by the last checkpoint: the run has not "
                "reached the phase change, and these midpoints mark no jump."
            )
        )
        rep.table("Phase change: the jump of each quantity", pd.DataFrame(rows), note=note)
        summary["phase_change"] = phase.summary()


def training_report(
    checkpoints: Any,
    out: str | os.PathLike,
    *,
    analyses: Sequence[str] = ("induction_phase",),
    params: Mapping[str, Mapping[str, Any]] | None = None,
    results_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
    progress: ProgressArg = True,
) -> dict:
    """Run `analyses` over `checkpoints` and write the page `out`.

    Args:
        checkpoints: as `heads.dynamics.over_checkpoints` (folders, a folder of checkpoint folders).
        out: the HTML page.
        analyses: names in `heads.dynamics.ANALYSES` (default the induction phase change).
        params: `{analysis: params}` (default `default_params(analysis)` for each).
        results_dir: where per-checkpoint results go (default `results_folder(out)`), one
            sub-folder per analysis; a rerun resumes from them.
        overwrite: replace `out`, and discard results of another run in `results_dir`.
        progress: True / False / `progress(done, total)` in (checkpoint, analysis) units.

    Returns:
        a summary: checkpoints, per analysis its emergence table, phase change, top changes.

    Raises:
        HeadsteerValueError: `out` exists without `overwrite`; bad checkpoints, analyses or
            parameters (all before any model loads).
    """
    check_output(out, overwrite)
    names = list(analyses)
    if not names or len(set(names)) != len(names):
        raise HeadsteerValueError(f"analyses must be distinct names, got {names}")
    series_ckpts = find_checkpoints(checkpoints)
    jobs = {a: Analysis.of(a, (params or {}).get(a, default_params(a))) for a in names}
    folder = results_folder(out) if results_dir is None else Path(results_dir).expanduser()
    per = len(series_ckpts)
    rep = Report(
        "Mechanisms across training" if len(series_ckpts) > 2 else "What changed between two models",
        ", ".join(c.name for c in series_ckpts[:3]) + (" ..." if per > 3 else ""),
        {"analyses": names, "checkpoints": per, "results": str(folder)},
    )
    summary: dict[str, Any] = {
        "checkpoints": [c.describe() for c in series_ckpts],
        "results_dir": str(folder),
    }
    with progress_callback(progress, "training report", "ckpt") as report:
        for i, name in enumerate(names):
            stage: Progress | None = offset_progress(report, i * per, per * len(names)) if report else None
            s = over_checkpoints(
                checkpoints,
                jobs[name],
                results_dir=folder / name,
                overwrite=overwrite,
                progress=stage or False,
            )
            sec: dict[str, Any] = {}
            _section(rep, name, s, sec)
            summary[name] = sec
    ckpt = pd.DataFrame([c.describe() for c in series_ckpts])
    rep.table("Checkpoints", ckpt, max_rows=500)
    rep.save(Path(out), overwrite=overwrite)
    return summary
