"""Memory sizes as users write them: `8e9`, `"24GB"`, `"80 GiB"`, `"512MB"`."""

from __future__ import annotations

import math
import re

from heads._util.validation import is_number, short_repr
from heads.errors import HeadsteerValueError

__all__ = ["format_bytes", "parse_bytes"]

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
        HeadsteerValueError: not a positive finite size, or an unknown unit (naming `name`).
    """
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise HeadsteerValueError(
                f"{name} must be a size such as '24GB', '80GiB' or a number of bytes, got {short_repr(value)}"
            )
        number = float(m.group(1)) * _UNITS[unit]
    elif is_number(value):
        number = float(value)
    else:
        raise HeadsteerValueError(
            f"{name} must be a size such as '24GB' or a number of bytes, got {short_repr(value)}"
        )
    if not math.isfinite(number) or number < 1:
        raise HeadsteerValueError(f"{name} must be a positive size, got {short_repr(value)}")
    return int(number)


def format_bytes(n: float) -> str:
    """`n` bytes as GB / MB / KB with 3 significant digits (decimal units, as `parse_bytes`)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"
