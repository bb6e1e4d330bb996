"""The `headsteer` command group: a usage error (missing or unknown option, bad value, an empty
path option) is one line on stderr and exit 2 (`OneLineUsageErrors`).

Re-exported by `viz.cli.common`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from typer._click import exceptions as click_errors  # typer 0.29 vendors click: its exceptions
from typer.core import TyperGroup

from viz.cli.messages import (
    BUG_EXIT,
    USER_ERROR_EXIT,
    USER_ERRORS,
    _one_line,
    debug_enabled,
    err,
    report_bug,
)

__all__ = ["OneLineUsageErrors"]


def _path_options(group: Any) -> set[str]:
    """The option names (`--out`, ...) of every command of `group` whose type is a `Path`."""
    import typing

    names: set[str] = set()
    for cmd in group.commands.values():
        if hasattr(cmd, "commands"):
            names |= _path_options(cmd)
        for param in cmd.params:
            ann = getattr(getattr(param, "type_descriptor", None), "annotation", None)
            if ann is Path or Path in typing.get_args(ann):
                names.update(o for o in param.opts if o.startswith("--"))
    return names


def _refuse_empty_paths(group: Any, argv: list[str]) -> None:
    """A path option given an empty string (`--out ''`) is a usage error: click would read it
    as the current folder and, for `build refusal-model`, start a fine-tune writing there."""
    paths = _path_options(group)
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        empty = (eq and value == "") or (not eq and i + 1 < len(argv) and argv[i + 1] == "")
        if name in paths and empty and not value:
            raise click_errors.UsageError(f"{name} is empty: give a path")


class OneLineUsageErrors(TyperGroup):
    """The `headsteer` group: a usage error (missing or unknown option, bad value) is one line.

    click prints a usage block, a hint and the error for a usage error; here it is one line
    on stderr, `error: <what> (see: <command> --help)`, and exit 2, like every other bad
    input. Help (`--help`, a group called without a command) is printed as click does.
    """

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            argv = kwargs.get("args", args[0] if args else None)
            _refuse_empty_paths(self, sys.argv[1:] if argv is None else list(argv))
            group_main: Any = super().main  # click's main also takes standalone_mode positionally
            rv = group_main(*args, standalone_mode=False, **kwargs)
        except click_errors.NoArgsIsHelpError as exc:
            if not standalone_mode:
                raise
            exc.show()
            raise SystemExit(exc.exit_code) from None
        except click_errors.UsageError as exc:
            if not standalone_mode:
                raise
            where = exc.ctx.command_path if exc.ctx is not None else "headsteer"
            msg = " ".join(exc.format_message().split()).rstrip(".")
            err.print(f"[red]error:[/red] {escape(msg)} (see: {escape(where)} --help)", highlight=False)
            raise SystemExit(2) from None
        except click_errors.ClickException as exc:
            if not standalone_mode:
                raise
            exc.show()
            raise SystemExit(exc.exit_code) from None
        except typer.Abort:
            if not standalone_mode:
                raise
            err.print("[red]aborted[/red]", highlight=False)
            raise SystemExit(1) from None
        except typer.Exit:
            raise
        except USER_ERRORS as exc:  # outside a command (e.g. in an option callback)
            if not standalone_mode:
                raise
            if debug_enabled():
                err.print_exception()
            err.print(f"[red]error:[/red] {escape(_one_line(exc))}", highlight=False)
            raise SystemExit(USER_ERROR_EXIT) from None
        except Exception as exc:  # a bug outside a command
            if not standalone_mode:
                raise
            report_bug(exc)
            raise SystemExit(BUG_EXIT) from None
        if not standalone_mode:
            return rv
        raise SystemExit(rv if isinstance(rv, int) else 0)
