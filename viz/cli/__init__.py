"""The `headsteer` command line."""

from viz.cli.main import app, run

__all__ = ["app", "run"]
