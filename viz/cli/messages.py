"""What the `headsteer` CLI prints besides results: the consoles, warning lines, user errors
and bugs, the exit statuses, and the global `--debug` / `--quiet` state.

Used by the command skeleton (`viz.cli.common`, which re-exports these names) and the group
(`viz.cli.usage`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape

from heads.errors import HeadsteerError

__all__ = [
    "BUG_EXIT",
    "DEBUG_ENV",
    "USER_ERRORS",
    "USER_ERROR_EXIT",
    "console",
    "debug_enabled",
    "err",
    "report_bug",
    "set_global",
    "warn_line",
]

# Not a terminal (a pipe, a log file): rich would cut tables at 80 columns; use 160 unless COLUMNS says.
console = Console() if sys.stdout.isatty() or "COLUMNS" in os.environ else Console(width=160)
err = Console(stderr=True, soft_wrap=True)
_STATE = {"debug": False, "quiet": False}
USER_ERRORS: tuple[type[BaseException], ...] = (HeadsteerError, OSError)
"""What the CLI reports as the user's error (one line, exit 2): headsteer's own errors (bad
values, refused models, a missing extra) and an `OSError` about a path (not found, no permission,
disk full). Every other exception is a bug (`report_bug`, exit 1)."""
USER_ERROR_EXIT = 2
"""Exit status for a user error (a bad option or value), as click uses for usage errors."""
BUG_EXIT = 1
"""Exit status for an internal error (a bug in headsteer or a library it calls)."""
DEBUG_ENV = "HEADSTEER_DEBUG"
"""Environment variable: `HEADSTEER_DEBUG=1` is `headsteer --debug` (tracebacks)."""


def _json(obj: Any) -> str:
    """Strict JSON: NaN and infinities become null."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(obj), allow_nan=False)


def warn_line(message: str) -> None:
    """Print one `warning: ...` line on stderr (white space collapsed; also with `--quiet`).

    Every warning a command raises (`warnings.warn`: a silent fallback, a no-op parameter)
    is routed here by `command`, so the user sees one line, not a Python warning with its
    source line.
    """
    msg = " ".join(str(message).split())
    err.print(f"[yellow]warning:[/yellow] {escape(msg)}", highlight=False)


@contextlib.contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """Within: each distinct warning message printed once, as one line through `warn_line`."""
    seen: set[str] = set()

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:  # noqa: ARG001
        text = str(message)
        if text not in seen:
            seen.add(text)
            warn_line(text)

    with warnings.catch_warnings():
        warnings.filterwarnings("always", category=UserWarning)
        warnings.showwarning = show
        yield


def _quiet_transformers() -> None:
    """No per-weight progress bars or info logs from transformers in the terminal."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def debug_enabled() -> bool:
    """Whether tracebacks are shown: `headsteer --debug`, or `HEADSTEER_DEBUG` set to 1 / true / yes."""
    return _STATE["debug"] or os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes")


def report_bug(exc: BaseException) -> None:
    """Print an unexpected exception as a bug on stderr (its traceback first with --debug).

    The line is `internal error: <Type>: <message> (rerun with --debug for the traceback)`;
    with --debug the traceback comes first and the hint is left out.
    """
    if debug_enabled():
        err.print_exception()
    hint = "" if debug_enabled() else " (rerun with --debug for the traceback)"
    msg = " ".join(str(exc).split())
    what = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    err.print(f"[red]internal error:[/red] {escape(what)}{hint}", highlight=False)


def set_global(debug: bool, quiet: bool) -> None:
    """`headsteer --debug --quiet ...`: tracebacks on every error; quiet for every command."""
    _STATE["debug"] = debug
    _STATE["quiet"] = quiet
