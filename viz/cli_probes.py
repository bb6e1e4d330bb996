"""`headsteer report probes`: per-head linear probes on the shipped probe tasks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .cli_common import (
    _STATE,
    USER_ERRORS,
    JsonOpt,
    ModelOpt,
    QuietOpt,
    _fail,
    _html_out,
    _json,
    _load,
    _positive,
    _progress,
    console,
)


def report_probes(
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
    force: Annotated[bool, typer.Option("--force", help="overwrite --out")] = False,
    model: ModelOpt = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Per-head probes: accuracy heatmaps, top heads, direction cosine between tasks."""
    from probes.head_probes import PROBE_TASKS

    from .probes_report import probes_report, summary_frame

    _STATE["quiet"] = _STATE["quiet"] or quiet
    try:
        _html_out(out)
        names = [t.strip() for t in tasks.split(",") if t.strip()]
        bad = [t for t in names if t not in PROBE_TASKS]
        if bad or not names:
            raise ValueError(
                f"unknown --tasks entry {bad[0] if bad else tasks!r}: use {', '.join(PROBE_TASKS)}"
            )
        _positive(top=top, batch_size=batch_size)
        if cv < 2:
            raise ValueError(f"--cv must be at least 2, got {cv}")
        if limit is not None:
            _positive(limit=limit)
        if out.exists() and not force:
            raise ValueError(f"{out} exists; pass --force to replace it")
        hm = _load(model)
        bar, step = _progress(2 * len(names))
        with bar:
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
                overwrite=force,
                progress=step,
            )
    except USER_ERRORS as exc:
        _fail(exc)
    if as_json:
        print(_json({"html": str(path), **summary}))
        return
    console.print(summary_frame(summary).to_string(index=False), highlight=False)
    for pair, value in summary["cosine"].items():
        console.print(f"mean |cos| of mass-mean directions, {pair}: {value:.3f}", highlight=False)
    console.print(f"wrote {path}", highlight=False)
