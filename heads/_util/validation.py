"""Shared argument validators: one place for the checks every public function repeats.

Each raises `heads.errors.HeadsteerValueError` (or `HeadsteerTypeError`) with a one-line message
naming the argument and the bad value, and returns the value normalised (a numpy or torch
integer becomes a Python `int`). A `bool` is never accepted as a number (`True` is an `int` in
Python, but `layer=True` is always a mistake).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from heads.errors import HeadsteerTypeError, HeadsteerValueError

__all__ = ["check_bool", "check_int", "check_number", "check_shard", "is_int"]


def is_int(value: object) -> bool:
    """True for an integer that is not a bool (Python, numpy or torch scalar integers)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, *, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as an `int` in `[lo, hi]` (either bound optional).

    Raises:
        HeadsteerValueError: not an integer (bools included) or out of range; the message
            names `name`, the range and the value.
    """
    where = (
        f" in {lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}"
        if (lo, hi) != (None, None)
        else ""
    )
    if not is_int(value):
        raise HeadsteerValueError(f"{name} must be an int{where}, got {value!r}")
    v = int(value)  # type: ignore[call-overload]
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise HeadsteerValueError(f"{name} must be an int{where}, got {v}")
    return v


def check_number(
    name: str, value: object, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False
) -> float:
    """`value` as a finite `float` in `[lo, hi]` (`(lo, hi]` with `lo_open`).

    Raises:
        HeadsteerValueError: not a real number (bools included), not finite, or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise HeadsteerValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise HeadsteerValueError(f"{name} must be finite, got {value!r}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise HeadsteerValueError(f"{name} must be {'>' if lo_open else '>='} {lo:g}, got {value!r}")
    if hi is not None and v > hi:
        raise HeadsteerValueError(f"{name} must be <= {hi:g}, got {value!r}")
    return v


def check_bool(name: str, value: object) -> bool:
    """`value` if it is a `bool`.

    Raises:
        HeadsteerTypeError: anything else (`0`, `1`, `"yes"`, None).
    """
    if not isinstance(value, bool):
        raise HeadsteerTypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_shard(shard: object) -> tuple[int, int] | None:
    """`shard` as `(i, n)` with `0 <= i < n`, or None.

    Raises:
        HeadsteerValueError: anything else.
    """
    if shard is None:
        return None
    if (
        isinstance(shard, (str, bytes))
        or not isinstance(shard, Sequence)
        or len(shard) != 2
        or not all(is_int(x) for x in shard)
    ):
        raise HeadsteerValueError(f"shard must be a pair (i, n) of ints, got {shard!r}")
    i, n = int(shard[0]), int(shard[1])
    if not 0 <= i < n:
        raise HeadsteerValueError(f"shard must be (i, n) with 0 <= i < n, got {shard!r}")
    return i, n
