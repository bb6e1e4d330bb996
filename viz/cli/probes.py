"""`headsteer report probes`: per-head linear probes on the shipped probe tasks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from heads._util.validation import check_seed, short_repr
from heads.errors import HeadsteerValueError
from viz.cli.common import Run, _positive


def report_probes(
    run: Run,
    out: Annotated[Path, typer.Option(help="HTML file to write")],
    tasks: Annotated[
        str, typer.Option(help="comma-separated: harmful, sentiment, counterfact, sentiment_answer")
    ] = "harmful,sentiment,counterfact",
    limit: Annotated[int | None, typer.Option(help="at most N train examples per task (default all)")] = None,
    top: Annotated[int, typer.Option(help="top heads listed per task")] = 10,
    cv: Annotated[int, typer.Option(help="cross-validation folds")] = 5,
    seed: Annotated[int, typer.Option(help="fold shuffling seed")] = 0,
    batch_size: Annotated[int, typer.Option(help="prompts per forward")] = 16,
    jobs: Annotated[int, typer.Option(help="joblib workers for fitting (-1: all cores)")] = 1,
) -> dict:
    """Per-head probes: accuracy heatmaps, top heads, direction cosine between tasks."""
    from probes.head_probes import PROBE_TASKS
    from viz.reports.probes import probes_report, summary_frame

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    bad = [t for t in names if t not in PROBE_TASKS]
    if bad or not names:
        raise HeadsteerValueError(
            f"unknown --tasks entry {short_repr(bad[0] if bad else tasks)}: use {', '.join(PROBE_TASKS)}"
        )
    _positive(top=top, batch_size=batch_size)
    check_seed("--seed", seed)
    if jobs == 0 or jobs < -1:
        raise HeadsteerValueError(
            f"--jobs must be a positive number of workers or -1 (all cores), got {jobs}"
        )
    if cv < 2:
        raise HeadsteerValueError(f"--cv must be at least 2, got {cv}")
    if limit is not None:
        _positive(limit=limit)
    out = run.output(out, suffixes=(".html", ".htm"))
    hm = run.load()
    with run.progress(2 * len(names), "probes") as step:
        path, summary = probes_report(
            hm,
            out,
            tasks=names,
            limit=limit,
            top=top,
            cv=cv,
            seed=seed,
            batch_size=batch_size,
            n_jobs=jobs,
            overwrite=run.force,
            progress=step,
        )
    run.show(summary_frame(summary).to_string(index=False))
    for pair, value in summary["cosine"].items():
        run.show(f"mean |cos| of mass-mean directions, {pair}: {value:.3f}")
    return {"html": str(path), **summary}
