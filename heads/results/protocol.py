"""The result protocol every analysis result implements, and the file I/O they share.

A result is what an analysis returns: `HeadScores`, `PatchResult`, `Circuit`, `QKAttribution`, ...
Each one, whatever it holds, offers the same five things, so a report, the explorer, the server
or a user's script can treat any of them alike:

* `head_scores()`: a `HeadScores` `[L, H]` summary (the analysis' documented reduction);
* `to_frame()`: a tidy pandas DataFrame (one row per head, edge, cell, ...);
* `save(path, *, overwrite=False) -> Path`: a JSON file, written atomically, refusing to
  overwrite unless asked and never through a symlink (`heads._util.files`);
* `load(path, model=None)` (a classmethod): read it back, checked against `model`'s geometry
  when given;
* `SCHEMA` / `SCHEMA_VERSION`: the file's `"schema"` and `"schema_version"` fields.

`write_result` and `read_result` hold the shared part of `save` and `load` (the header, strict
JSON, NaN as null, the schema and version checks with one wording), and `check_geometry` the
model check.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from heads._util.files import write_text
from heads._util.validation import read_json_file, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel
    from heads.results.scores import HeadScores

__all__ = ["Result", "check_geometry", "read_json", "read_result", "write_result"]


@runtime_checkable
class Result(Protocol):
    """What every analysis result offers (see the module docstring)."""

    SCHEMA: ClassVar[str]
    SCHEMA_VERSION: ClassVar[int]

    def head_scores(self) -> HeadScores: ...

    def to_frame(self) -> pd.DataFrame: ...

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path: ...

    @classmethod
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> Result: ...


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """`json` object hook: a key given twice is an error, not "the last one wins"."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise HeadsteerValueError(f"duplicate key {short_repr(key)}")
        out[key] = value
    return out


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file strictly (`heads._util.validation.read_json_file`, and a key given twice
    in one object is an error).

    Raises:
        FileNotFoundError: no such file.
        ValueError: one line naming the file: bad JSON text (line and column), a repeated key, an
            integer of more than 4300 digits, or nesting too deep to parse.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"file not found: {str(path)!r}")
    return read_json_file(path, object_pairs_hook=_no_duplicate_keys)


def write_result(
    path: str | os.PathLike, schema: str, version: int, payload: Mapping[str, Any], *, overwrite: bool = False
) -> Path:
    """Write `{"schema", "schema_version", **payload}` as JSON to `path`; returns the path.

    Atomic (temporary file, then rename), missing parent folders created; NaN must already be
    None in `payload` (JSON has no NaN).

    Raises:
        ValueError: `path` exists and `overwrite` is False; `path` is a symlink or a folder; a
            value JSON cannot hold (NaN, inf) is in `payload`.
    """
    body = {"schema": schema, "schema_version": version, **payload}
    try:
        text = json.dumps(body, indent=1, allow_nan=False) + "\n"
    except ValueError:
        raise HeadsteerValueError(
            f"a {schema} result holds NaN or +-inf, which a JSON file cannot store"
        ) from None
    return write_text(path, text, overwrite=overwrite)


def read_result(path: str | os.PathLike, schema: str, version: int, what: str) -> Mapping[str, Any]:
    """The JSON object of a file `write_result` wrote with `schema` and `version`.

    Args:
        path: the file.
        schema, version: what the file must declare.
        what: the result's name for messages (`"HeadScores"`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: one line naming the file: not JSON (line and column), a repeated key, not a
            `what` file (another or no schema), or another schema version.
    """
    data = read_json(path)
    name = short_repr(str(path))
    if not isinstance(data, Mapping) or data.get("schema") != schema:
        raise HeadsteerValueError(f"{name} is not a headsteer {what} file")
    got = data.get("schema_version")
    if got != version or isinstance(got, bool):
        raise HeadsteerValueError(
            f"{name} has schema_version {short_repr(got)}; this headsteer reads version {version}"
        )
    return data


def check_geometry(
    path: str | os.PathLike, got: tuple[int, int, int | None], model: HeadModel | None
) -> None:
    """Check a loaded result's `(n_layers, n_heads, n_kv_heads)` against `model` (None: no check).

    Raises:
        TypeError: `model` is not a `HeadModel`.
        ValueError: the geometries differ (the message names both).
    """
    if model is None:
        return
    if not hasattr(model, "n_kv_heads"):
        raise HeadsteerTypeError(f"model must be a HeadModel, got {type(model).__name__}")
    want = (model.n_layers, model.n_heads, model.n_kv_heads)
    if tuple(got) != want:
        raise HeadsteerValueError(
            f"{short_repr(str(path))} was computed on a model with (n_layers, n_heads, n_kv_heads)="
            f"{tuple(got)}, this model has {want}"
        )
