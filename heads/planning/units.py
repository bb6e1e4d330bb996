"""Memory sizes as users write them: `8e9`, `"24GB"`, `"80 GiB"`, `"512MB"`."""

from __future__ import annotations

import math
import re

from heads._util.validation import is_number, short_repr
from heads.errors import HeadsteerValueError

__all__ = ["format_bytes", "parse_bytes", "parse_gib"]

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(value: object, name: str = "max_memory") -> int:
    """Bytes from a number of bytes or a string with a unit (`"24GB"` = 24e9 as accelerate reads
    `max_memory`, `"80GiB"` = 80 * 2**30; `KB MB GB TB`, `KiB MiB GiB TiB`, case-insensitive).

    Raises:
        HeadsteerValueError: not a positive finite size, a bare number with a fraction (bytes are
            whole: `1.5` is refused, `"1.5GB"` is read), or an unknown unit (naming `name`).
    """
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise HeadsteerValueError(
                f"{name} must be a size such as '24GB', '80GiB' or a number of bytes, got {short_repr(value)}"
            )
        number = float(m.group(1)) * _UNITS[unit]
        if not unit and math.isfinite(number) and number != int(number):  # '1.5': bytes are whole
            raise HeadsteerValueError(
                f"{name} {short_repr(value)} is a fractional number of bytes: give whole bytes or a "
                f"size with a unit (e.g. '{value.strip()}GB')"
            )
    elif is_number(value):
        number = float(value)
        if math.isfinite(number) and number != int(number):  # a bare number counts bytes
            raise HeadsteerValueError(
                f"{name} {short_repr(value)} is a fractional number of bytes: give whole bytes or a "
                f"size with a unit (e.g. '{short_repr(value)}GB')"
            )
    else:
        raise HeadsteerValueError(
            f"{name} must be a size such as '24GB' or a number of bytes, got {short_repr(value)}"
        )
    if not math.isfinite(number) or number < 1:
        raise HeadsteerValueError(f"{name} must be a positive size, got {short_repr(value)}")
    return int(number)


def parse_gib(value: object, name: str = "max_memory", minimum: float = 2**-10) -> float:
    """GiB from a bare number of GiB (`2`, `"0.5"`) or a size with a unit as `parse_bytes` reads
    it (`"24GB"` = 24e9 bytes = 22.4 GiB, `"512MiB"` = 0.5 GiB).

    Raises:
        HeadsteerValueError: not a finite size, an unknown unit, or below `minimum` GiB (default
            1 MiB), naming `name` and the minimum.
    """
    gib: float
    if is_number(value) and not isinstance(value, bool):
        gib = float(value)
    elif isinstance(value, str) and re.fullmatch(r"\s*[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?\s*", value):
        gib = float(value)
    else:
        gib = parse_bytes(value, name) / 2**30
    if not math.isfinite(gib) or gib < minimum:
        raise HeadsteerValueError(
            f"{name} must be at least {format_bytes(minimum * 2**30)} ({minimum:g} GiB), "
            f"got {short_repr(value)}"
        )
    return gib


def format_bytes(n: float) -> str:
    """`n` bytes as GB / MB / KB with 3 significant digits (decimal units, as `parse_bytes`)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"
