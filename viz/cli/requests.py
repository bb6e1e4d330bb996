"""Build an analysis request (`heads.scorers.request_base.Request`) from a command's options.

The CLI builds the same request object as the Python API (`heads.patch` builds `PatchRequest`),
so a value is checked in one place: the request's own `__post_init__`. A refused value becomes a
one-line usage error (exit 2) naming the command-line option of the field the message names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.scorers.request_base import Request

if TYPE_CHECKING:
    from heads.engine.options import SweepOptions
    from viz.cli.common import Run

__all__ = ["build_request", "check_request", "sweep_options"]

R = TypeVar("R", bound=Request)


def _option_named(message: str, options: Mapping[str, str]) -> str | None:
    """The option of the field the message names first (a whole word), None if none."""
    best: tuple[int, str] | None = None
    for field, option in options.items():
        m = re.search(rf"\b{re.escape(field)}\b", message)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), option)
    return None if best is None else best[1]


def build_request(cls: type[R], options: Mapping[str, str], **values: Any) -> R:
    """`cls(**values)`, or a `typer.BadParameter` (one line, exit 2) naming the option.

    Args:
        cls: the request class (`PatchRequest`, ...).
        options: field name -> the command-line option that gave it (`{"kind": "--kind"}`).
        **values: the request's fields.

    Raises:
        typer.BadParameter: the request refused a value; the message is the request's own, with
            the option of the field it names as the parameter hint.
    """
    try:
        return cls(**values)
    except (HeadsteerValueError, HeadsteerTypeError) as exc:
        raise typer.BadParameter(str(exc), param_hint=_option_named(str(exc), options)) from None


def sweep_options(options: Mapping[str, str], **values: Any) -> SweepOptions:
    """`SweepOptions(**values)`, or a `typer.BadParameter` naming the option (as `build_request`)."""
    from heads.engine.options import SweepOptions

    try:
        return SweepOptions(**values)
    except (HeadsteerValueError, HeadsteerTypeError) as exc:
        raise typer.BadParameter(str(exc), param_hint=_option_named(str(exc), options)) from None


def check_request(run: Run, options: Mapping[str, str], *requests: Request) -> None:
    """Check `requests` against `--model`'s config (`Request.check_model`: `config.json` only),
    before any weight is read.

    Args:
        run: the command's run (its `--model`; None: the embedded model).
        options: field name -> command-line option, as for `build_request`.
        *requests: the requests the command will run.

    Raises:
        typer.BadParameter: a request the model cannot run (a layer or head out of range, a
            family without the analysis), naming the option of the field the message names.
        HeadsteerValueError / FileNotFoundError: a missing model folder or a refused config, as
            `load_model` would raise them (one line, exit 2 in the command skeleton).
    """
    for request in requests:
        try:
            request.check_model(run.model)
        except (HeadsteerValueError, HeadsteerTypeError) as exc:
            hint = _option_named(str(exc), options)
            if hint is None:
                raise
            raise typer.BadParameter(str(exc), param_hint=hint) from None
