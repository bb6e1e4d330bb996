"""The `headsteer` command line.

`run` (the console script `headsteer`) installs its Ctrl-C handler before importing the
command modules (which import torch, transformers and pandas for a few seconds), so an
interrupt at any moment prints one "interrupted" line and exits with status 130.
`app` (the typer app) is imported on first use.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["app", "run"]

INTERRUPTED_EXIT = 130
"""Exit status after Ctrl-C (128 + SIGINT), as shells report it."""


def _interrupted_while_starting(signum, frame) -> None:  # pragma: no cover - exercised in a subprocess
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(INTERRUPTED_EXIT)  # no traceback from half-imported modules, no atexit hooks


def run() -> None:
    """Entry point of the `headsteer` console script."""
    # Offline unless the user says otherwise: set here, before transformers / huggingface_hub
    # are imported (they read it at import), never at import of a viz module.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    previous = signal.signal(signal.SIGINT, _interrupted_while_starting)
    try:
        from viz.cli.main import run as main_run
    finally:
        signal.signal(signal.SIGINT, previous)  # commands handle Ctrl-C themselves from here on
    try:
        main_run()
    except KeyboardInterrupt:  # between two commands' own handlers
        sys.stderr.write("interrupted\n")
        sys.exit(INTERRUPTED_EXIT)


def __getattr__(name: str):
    if name == "app":
        from viz.cli.main import app

        return app
    raise AttributeError(f"module 'viz.cli' has no attribute {name!r}")
