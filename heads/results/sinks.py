"""`SinkStats`: per-head attention-sink statistics of a prompt set (`heads.sink_stats`;
docs/methods/act.md); `SinkDims`: the residual dimensions that carry a backbone's sinks
(`heads.find_sink_dims`; docs/methods/var.md).

Both follow the result protocol (`heads.results.protocol.Result`) and are re-exported from their
old homes, `heads.scorers.sinks` and `heads.scorers.sink_dims`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd

from heads._util.validation import is_int, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.scores import HeadScores
from heads.results.storage import check_geometry, guarded_load, read_result, write_result
from heads.results.views import html_view, top_heads_text

if TYPE_CHECKING:  # pragma: no cover
    from heads.model.adapter import HeadModel

__all__ = ["DIMS_SCHEMA", "DIMS_SCHEMA_VERSION", "SCHEMA", "SCHEMA_VERSION", "STATS", "SinkDims", "SinkStats"]

SCHEMA = "headsteer/sink-stats"
SCHEMA_VERSION = 1
STATS = ("sink_mass", "first_mass", "n_sinks")
"""The per-head statistics of a `SinkStats`."""
DIMS_SCHEMA = "headsteer/sink-dims"
DIMS_SCHEMA_VERSION = 1
_EVIDENCE = ("dim", "score", "ratio_to_median_dim", "punct_score", "selected")
"""The columns of `SinkDims.evidence`."""


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
    @guarded_load
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


@dataclass
class SinkDims:
    """Result of `find_sink_dims`: the chosen dims and the evidence.

    Attributes:
        dims: the massive dimensions, strongest first.
        evidence: DataFrame, one row per dim ranked by score: `dim, score` (median over
            prompts and layers >= `from_layer` of |x_d| / RMS(x) at the first token),
            `ratio_to_median_dim` (score / the median score of all dims), `punct_score`
            (the same median at "." and "\\n" tokens, NaN without such tokens), `selected`.
        model: the model id.
        geometry: `(n_layers, n_heads, n_kv_heads, d_model)` of the model, or None (built by
            hand): `load(path, model)` checks it.
        params: how the dims were found (`from_layer`, `max_dims`, `min_ratio`).
    """

    dims: tuple[int, ...]
    evidence: pd.DataFrame
    model: str = ""
    geometry: tuple[int, int, int, int] | None = None
    params: dict = field(default_factory=dict)

    SCHEMA: ClassVar[str] = DIMS_SCHEMA
    SCHEMA_VERSION: ClassVar[int] = DIMS_SCHEMA_VERSION

    def head_scores(self) -> HeadScores:
        """Not available: sink dimensions are a property of the residual stream, not of a head,
        and `SinkDims` holds no per-head number (the per-head summary of the sinks these dims
        flag is `heads.sink_stats(model, prompts)`'s `SinkStats.head_scores()`).

        Raises:
            HeadsteerValueError: always, naming `sink_stats`.
        """
        raise HeadsteerValueError(
            "SinkDims ranks residual-stream dimensions and has no per-head score: the per-head sink "
            "statistics are heads.sink_stats(model, prompts).head_scores()"
        )

    def to_frame(self) -> pd.DataFrame:
        """The evidence: one row per residual dimension, `dim, score, ratio_to_median_dim,
        punct_score, selected`, by decreasing score (a copy)."""
        return self.evidence.copy()

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the dims and the evidence as JSON (schema `headsteer/sink-dims`; NaN as null),
        atomically; returns the path.

        Raises:
            HeadsteerValueError: `path` exists and `overwrite` is False, is a symlink or a folder.
        """
        ev = self.evidence
        payload = {
            "dims": [int(d) for d in self.dims],
            "evidence": {c: ev[c].tolist() for c in _EVIDENCE if c in ev.columns},
            "model": self.model,
            "geometry": None if self.geometry is None else list(self.geometry),
            "params": self.params,
        }
        return write_result(path, DIMS_SCHEMA, DIMS_SCHEMA_VERSION, payload, overwrite=overwrite)

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> SinkDims:
        """Read a file `save` wrote; with `model`, check its `(n_layers, n_heads, n_kv_heads)`
        and that every dim is below its `d_model`.

        Raises:
            FileNotFoundError: no such file.
            HeadsteerValueError: not a sink-dims file, another schema version, a malformed field
                (named), a model of another geometry or width.
        """
        where = short_repr(str(path))
        data = read_result(path, DIMS_SCHEMA, DIMS_SCHEMA_VERSION, "SinkDims")
        dims: Any = data.get("dims")
        if not isinstance(dims, list) or not dims or not all(is_int(d) and d >= 0 for d in dims):
            raise HeadsteerValueError(f"{where}: dims must be a non-empty list of dimension indices")
        ev: Any = data.get("evidence")
        if (
            not isinstance(ev, dict)
            or set(ev) != set(_EVIDENCE)
            or not all(isinstance(v, list) for v in ev.values())
        ):
            raise HeadsteerValueError(f"{where}: evidence must map {', '.join(_EVIDENCE)} to lists")
        if len({len(v) for v in ev.values()}) != 1:
            raise HeadsteerValueError(f"{where}: the evidence columns have different lengths")
        frame = pd.DataFrame({c: ev[c] for c in _EVIDENCE})
        for c in ("score", "ratio_to_median_dim", "punct_score"):
            frame[c] = frame[c].astype(float)  # null (NaN) back to NaN
        geo: Any = data.get("geometry")
        if geo is not None and (
            not isinstance(geo, list) or len(geo) != 4 or not all(is_int(g) and g >= 1 for g in geo)
        ):
            raise HeadsteerValueError(
                f"{where}: geometry must be [n_layers, n_heads, n_kv_heads, d_model] or null, "
                f"got {short_repr(geo)}"
            )
        name, params = data.get("model", ""), data.get("params", {})
        if not isinstance(name, str) or not isinstance(params, dict):
            raise HeadsteerValueError(f"{where}: model must be a string and params a mapping")
        out = cls(tuple(int(d) for d in dims), frame, name, None if geo is None else tuple(geo), dict(params))
        if model is not None:
            if not hasattr(model, "d_model"):
                raise HeadsteerTypeError(f"model must be a HeadModel, got {type(model).__name__}")
            if out.geometry is not None:
                g = out.geometry
                check_geometry(path, (g[0], g[1], g[2]), model)
            if max(out.dims) >= model.d_model:
                raise HeadsteerValueError(
                    f"{where}: dim {max(out.dims)} is outside this model's d_model {model.d_model} "
                    "(the dims were found on another model)"
                )
        return out

    def __repr__(self) -> str:
        return f"SinkDims({self.model or 'model'}: dims {list(self.dims)}, {len(self.evidence)} dims ranked)"
