"""Build an analysis request (`heads.scorers.request_base.Request`) from a command's options.

The CLI builds the same request object as the Python API (`heads.patch` builds `PatchRequest`),
so a value is checked in one place: the request's own `__post_init__`. A refused value becomes a
one-line usage error (exit 2) naming the command-line option of the field the message names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

import typer

from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.scorers.request_base import Request

__all__ = ["build_request"]

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
