"""Shared pieces of the `headsteer` command line: options, progress, errors, model loading."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

os.environ.setdefault("HF_HUB_OFFLINE", "1")

console = Console()
err = Console(stderr=True, soft_wrap=True)
_STATE = {"debug": False, "quiet": False}
USER_ERRORS = (ValueError, TypeError, OSError)

ModelOpt = Annotated[
    str | None, typer.Option("--model", help="HF model folder (default: embedded SmolLM2-135M-Instruct)")
]
EmphasizeOpt = Annotated[
    list[str] | None,
    typer.Option("--emphasize", help="substring to emphasize (repeatable), besides **markup** in the prompt"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]


QuietOpt = Annotated[bool, typer.Option("--quiet", help="no spinners or progress bars")]


def _status(msg: str):
    """A spinner on stderr, or nothing with --quiet."""
    import contextlib

    return contextlib.nullcontext() if _STATE["quiet"] else err.status(msg)


def _progress(label: str):
    """A rich progress bar on stderr (disabled with --quiet); returns (context, update).

    `update(done, total)` is a `heads.progress.Progress` callback: pass it as `progress=`.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=err,
        disable=_STATE["quiet"],
        transient=True,
    )
    task = bar.add_task(label, total=None)

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    return bar, update


def _fail(exc: Exception) -> None:
    """One line on stderr and exit code 2 (with --debug, the traceback first)."""
    if _STATE["debug"]:
        err.print_exception()
    msg = " ".join(str(exc).split()) or type(exc).__name__
    err.print(f"[red]error:[/red] {escape(msg)}", highlight=False)
    raise typer.Exit(2)


def _json(obj) -> str:
    """Strict JSON: NaN and infinities become null."""
    import math

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(obj), allow_nan=False)


def _quiet_transformers() -> None:
    """No per-weight progress bars or info logs from transformers in the terminal."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _load(model: str | None):
    from heads import load_model

    _quiet_transformers()
    with _status("loading model…"):
        return load_model(model)


def _positive(**options: int) -> None:
    """ValueError naming the first option (as --flag) that is not a positive int."""
    for name, value in options.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {value}")


def _folder_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a folder")


def _html_out(out: Path) -> None:
    if out.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"--out must name an .html file, got {str(out)!r}")
    if out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a folder; give an .html file path")
