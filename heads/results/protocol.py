"""The result protocol every analysis result implements, and the file I/O they share.

A result is what an analysis returns: `HeadScores`, `PatchResult`, `Circuit`, `QKAttribution`, ...
Each one, whatever it holds, offers the same five things, so a report, the explorer, the server
or a user's script can treat any of them alike:

* `head_scores()`: a `HeadScores` `[L, H]` summary (the analysis' documented reduction); a
  result with no per-head number (`SinkDims`: residual-stream dimensions) raises
  `HeadsteerValueError` naming the analysis that gives one;
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

import os
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from heads.results.storage import check_geometry, read_json, read_result, write_result

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
