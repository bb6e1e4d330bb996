"""CSV export that a spreadsheet cannot run: every CSV headsteer writes goes through `write_csv`."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from heads._util.files import write_text

__all__ = ["FORMULA_PREFIXES", "neutralise_cell", "neutralise_formulas", "write_csv"]

FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")
"""A text cell starting with one of these is read as a formula by Excel, LibreOffice and
Google Sheets (OWASP "CSV injection"); `neutralise_cell` puts a `'` in front."""


def neutralise_cell(value: object) -> object:
    """`value` with a leading `'` when it is a string starting with a `FORMULA_PREFIXES`
    character; anything else (numbers included, also negative ones) unchanged."""
    if isinstance(value, str) and value.startswith(FORMULA_PREFIXES):
        return "'" + value
    return value


def neutralise_formulas(frame: pd.DataFrame) -> pd.DataFrame:
    """A copy of `frame` whose text cells (and column names) cannot start a formula."""
    out = frame.copy()
    for col in out.columns:
        if out[col].dtype == object or pd.api.types.is_string_dtype(out[col]):
            out[col] = out[col].map(neutralise_cell)
    out.columns = [neutralise_cell(c) for c in out.columns]
    return out


def write_csv(path: str | os.PathLike, frame: pd.DataFrame, *, overwrite: bool = False) -> Path:
    """Write `frame` (no index) as CSV, formula cells neutralised, atomically (`heads._util.files`).

    Missing parent folders are created. Returns the path.

    Raises:
        ValueError: `path` exists and `overwrite` is False, or is a symlink or a folder.
    """
    return write_text(path, neutralise_formulas(frame).to_csv(index=False), overwrite=overwrite)
