"""`SinkStats`: per-head attention-sink statistics of a prompt set (`heads.sink_stats`;
docs/methods/act.md).

It follows the result protocol (`heads.results.protocol.Result`) and is re-exported from its old
home, `heads.scorers.sinks`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.results.scores import HeadScores
from heads.results.storage import check_geometry, read_result, write_result
from heads.results.views import html_view, top_heads_text

if TYPE_CHECKING:  # pragma: no cover
    from heads.model.adapter import HeadModel

__all__ = ["SCHEMA", "SCHEMA_VERSION", "STATS", "SinkStats"]

SCHEMA = "headsteer/sink-stats"
SCHEMA_VERSION = 1
STATS = ("sink_mass", "first_mass", "n_sinks")
"""The per-head statistics of a `SinkStats`."""


@dataclass
class SinkStats:
    """Sink statistics of every head over a prompt set.

    Attributes:
        sink_mass: HeadScores, mean share of attention (real rows) going to flagged sinks.
        first_mass: HeadScores, mean share of attention going to the first real token.
        n_sinks: HeadScores, mean number of flagged sink columns per prompt.
        flagged: DataFrame `prompt, layer, head, position, token, score` of every flagged sink
            (`token` as readable text, `heads.inputs.tokens`: `␣the`, `⏎`).
    """

    sink_mass: HeadScores
    first_mass: HeadScores
    n_sinks: HeadScores
    flagged: pd.DataFrame

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    def head_scores(self, stat: str = "sink_mass") -> HeadScores:
        """`[L, H]` one statistic: `"sink_mass"` (default), `"first_mass"` or `"n_sinks"`.

        Raises:
            HeadsteerValueError: another name.
        """
        if stat not in STATS:
            raise HeadsteerValueError(f"unknown statistic {short_repr(stat)}: use one of {', '.join(STATS)}")
        out: HeadScores = getattr(self, stat)
        return out

    def to_frame(self) -> pd.DataFrame:
        """One row per head: `layer, head, kv_head, sink_mass, first_mass, n_sinks` (the flagged
        sinks themselves are `flagged`)."""
        df = self.sink_mass.to_frame().rename(columns={"score": "sink_mass"})
        df["first_mass"] = self.first_mass.scores.flatten().numpy()
        df["n_sinks"] = self.n_sinks.scores.flatten().numpy()
        return df

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the statistics and the flagged sinks as JSON (schema `headsteer/sink-stats`),
        atomically; returns the path.

        Raises:
            HeadsteerValueError: `path` exists and `overwrite` is False, is a symlink or a folder.
        """
        import json

        payload = {s: getattr(self, s).to_json() for s in STATS}
        payload["flagged"] = json.loads(self.flagged.to_json(orient="records"))
        return write_result(path, SCHEMA, SCHEMA_VERSION, payload, overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> SinkStats:
        """Read a file `save` wrote, checked against `model`'s geometry when given.

        Raises:
            FileNotFoundError: no such file.
            HeadsteerValueError: not a sink-stats file, another schema version, a malformed field,
                a model of another geometry.
        """
        data = read_result(path, SCHEMA, SCHEMA_VERSION, "SinkStats")
        stats = [HeadScores._from_json(data.get(s) or {}, str(path)) for s in STATS]
        rows: Any = data.get("flagged")
        if not isinstance(rows, list):
            raise HeadsteerValueError(f"{short_repr(str(path))}: flagged must be a list of rows")
        columns = ["prompt", "layer", "head", "position", "token", "score"]
        flagged = pd.DataFrame(rows, columns=columns if not rows else None)
        s = stats[0]
        check_geometry(path, (s.n_layers, s.n_heads, s.n_kv_heads), model)
        return cls(stats[0], stats[1], stats[2], flagged)

    def __repr__(self) -> str:
        n = self.sink_mass.params.get("n_prompts", "?")
        return (
            f"SinkStats({self.sink_mass.model}: {n} prompts, {len(self.flagged)} flagged sinks; "
            f"sink mass top {top_heads_text(self.sink_mass)}; "
            f"mean first-token mass {self.first_mass.scores.nanmean().item():.3f})"
        )

    def _repr_html_(self) -> str:
        rows = self.flagged.sort_values("score", ascending=False).head(10)
        return html_view(repr(self), rows.itertuples(index=False), list(self.flagged.columns))
