"""`headsteer report probes`: per-head linear probes on the shipped probe tasks.

The study is computed in `probes.studies.probing.probe_study` (for each task, every head's
output at the last token of the train split and a logistic-regression probe per head,
stratified 5-fold CV); this report only draws it: a layer x head heatmap of held-out accuracy
(top heads outlined), the top heads with 95% intervals, how many heads beat chance (Wilson lower
bound above the majority share), and the cosine between the tasks' mass-mean directions in
every head.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import torch

from heads import HeadModel
from heads._util.files import check_output, write_text
from heads._util.progress import ProgressArg
from heads._util.validation import check_forwarded, check_int
from heads.results.scores import HeadScores
from probes.studies.probing import (
    FIT_STEPS,
    REPORT_TASKS,
    check_probe_tasks,
    direction_cosines,
    probe_study,
)
from viz.figures import DIVERGING, head_heatmap
from viz.reports.base import Report

__all__ = ["FIT_STEPS", "REPORT_TASKS", "direction_cosines", "probes_report", "summary_frame"]
# FIT_STEPS, REPORT_TASKS and direction_cosines live in probes.studies.probing (re-exported here).


def _cosine_figure(cos: torch.Tensor, title: str) -> go.Figure:
    fig = go.Figure(
        go.Heatmap(
            z=cos.tolist(),
            x=list(range(cos.shape[1])),
            y=list(range(cos.shape[0])),
            zmin=-1,
            zmax=1,
            colorscale=DIVERGING,
            colorbar={"title": "cosine"},
            hovertemplate="layer %{y}<br>head %{x}<br>cosine %{z:.3f}<extra></extra>",
        )
    )
    fig.update_layout(
        title=title,
        xaxis_title="head",
        yaxis_title="layer",
        xaxis={"dtick": 1},
        height=max(320, 22 * cos.shape[0] + 120),
        width=max(420, 48 * cos.shape[1] + 220),
    )
    return fig


def probes_report(
    model: HeadModel,
    out: str | os.PathLike,
    *,
    tasks: Sequence[str] = REPORT_TASKS,
    top: int = 10,
    overwrite: bool = False,
    progress: ProgressArg = True,
    **study: Any,
) -> tuple[os.PathLike, dict]:
    """Write the probes report (HTML) and return its path and a JSON-able summary.

    Args:
        model: a `HeadModel` with a tokenizer.
        out: the HTML file; refused if it exists unless `overwrite`.
        tasks: probe tasks (`probes.head_probes.PROBE_TASKS`; default harmful, sentiment,
            counterfact), each on its train split.
        top: heads listed (and outlined) per task (default 10).
        study: the other keyword arguments of `probes.studies.probing.probe_study`, passed on:
            `limit` (at most `limit` examples per task, default all), `cv` (5), `seed` (0),
            `n_jobs` (1) as `fit_head_probes`; `batch_size` (16) as `collect_head_outputs`.
        progress: True (default: a tqdm bar), False / None (off) or `progress(done, total)`
            (`heads._util.progress`) in steps: each prompt whose head outputs are collected (after
            each batch), then `FIT_STEPS` when a task's probes are fitted; total known up front.

    Returns:
        (path, summary): per task, rows, best head with accuracy [interval] and AUC, the number
        of heads above chance, and the mean |cosine| of each task pair over their top heads.

    Raises:
        HeadsteerTypeError: a keyword `probe_study` does not take.
        ValueError: an unknown task, an existing `out` without `overwrite`, or bad numbers.
    """
    check_forwarded("probes_report", study, probe_study)
    tasks = check_probe_tasks(tasks)
    top = check_int("top", top, lo=1)
    check_output(out, overwrite=overwrite)
    t0 = time.perf_counter()
    result = probe_study(model, tasks=tasks, top=top, progress=progress, **study)
    summary: dict = result.summary()
    rep = Report("Per-head linear probes", model.name, result.params)
    rep.text(
        "How to read this",
        "Each head's output (its slice of the o_proj input) at the last token is a d_head vector; a "
        "logistic-regression probe per head is scored by stratified 5-fold cross-validation on the "
        "task's train split. Accuracy is pooled over held-out predictions (95% Wilson interval); "
        "AUC from pooled held-out decision scores (95% Hanley-McNeil interval). A head 'beats "
        "chance' when its accuracy interval lies above the majority-class share. Method: Li et al. "
        "2023 (ITI), section 3.1.",
    )
    for task, tp in result.tasks.items():
        res, best, above = tp.result, tp.best, tp.above_chance
        layer, head = best["head"]
        verdict = (
            f"{above} of {model.n_layers * model.n_heads} heads beat chance"
            if above
            else "no head beats chance: the probes are at chance on this task"
        )
        rep.text(
            f"{task}: {tp.description}",
            f"{res.n} rows ({res.n_positive} with label 1), majority share {tp.majority:.2f}. Best head "
            f"L{layer}H{head}: accuracy {best['accuracy']:.3f} [{best['interval'][0]:.3f}, "
            f"{best['interval'][1]:.3f}], AUC {best['auc']:.3f}. {verdict}.",
        )
        rep.figure(
            f"{task}: held-out probe accuracy",
            head_heatmap(res.accuracy, title=f"{task}: accuracy", top_k=top),
        )
        frame = res.to_frame().drop(columns=["kv_head"]).head(top)
        rep.table(f"{task}: top {top} heads", frame)
    for (a, b), cos in result.cosines.items():
        mean_abs = result.mean_abs_cosine(a, b)
        rep.figure(
            f"mass-mean direction cosine: {a} vs {b} (mean |cos| over both top-{top} sets {mean_abs:.3f}; "
            f"two random directions in d_head={model.d_head}: {math.sqrt(2 / (math.pi * model.d_head)):.3f})",
            _cosine_figure(cos, f"cos({a}, {b}) per head"),
        )
        score = HeadScores(cos.abs(), f"|cos| {a}~{b}", model=model.name, n_kv_heads=model.n_kv_heads)
        rows = score.to_frame().sort_values("score", ascending=False).head(top)
        rep.table(
            f"{a} vs {b}: heads with the most aligned directions (|cos|)", rows.drop(columns=["kv_head"])
        )
    rep.seconds = time.perf_counter() - t0
    summary["seconds"] = round(rep.seconds, 1)
    path = write_text(out, rep.to_html(), overwrite=overwrite)
    return path, summary


def summary_frame(summary: dict) -> pd.DataFrame:
    """The per-task part of a `probes_report` summary as a table."""
    rows = []
    for task, s in summary["tasks"].items():
        b = s["best"]
        rows.append(
            {
                "task": task,
                "rows": s["rows"],
                "best head": f"L{b['head'][0]}H{b['head'][1]}",
                "accuracy": b["accuracy"],
                "low": b["interval"][0],
                "high": b["interval"][1],
                "auc": b["auc"],
                "heads above chance": s["above_chance"],
            }
        )
    return pd.DataFrame(rows)
