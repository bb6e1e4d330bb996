"""`CheckpointSeries`: one analysis run over the checkpoints of a training run, as tidy tables.

Tables (pandas DataFrames, one row per value):

* `checkpoints`: `checkpoint, step, tokens, path, seconds` (load + analysis time);
* `scores`: `checkpoint, step, metric, layer, head, score` (every per-head score);
* `scalars`: `checkpoint, step, metric, value` (ICL score, training loss from the checkpoint's
  metadata, a circuit's faithfulness, ...);
* `edges`: `checkpoint, step, metric, source, target, score` (circuit edges);
* `roles`: `checkpoint, step, layer, head, role` (role labels of an atlas).

The comparisons across steps (emergence, role timelines, edge overlap, function persistence) are
functions of `heads.dynamics`, which take a `CheckpointSeries`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import torch

from heads._util.validation import check_path, short_repr
from heads.errors import HeadsteerValueError
from heads.results.scores import HeadScores
from heads.results.storage import guarded_load, read_result, write_result

__all__ = ["SERIES_SCHEMA", "SERIES_SCHEMA_VERSION", "CheckpointSeries"]

SERIES_SCHEMA = "headsteer/checkpoint-series"
SERIES_SCHEMA_VERSION = 1
_COLUMNS = {
    "checkpoints": ["checkpoint", "step", "tokens", "path", "seconds"],
    "scores": ["checkpoint", "step", "metric", "layer", "head", "score"],
    "scalars": ["checkpoint", "step", "metric", "value"],
    "edges": ["checkpoint", "step", "metric", "source", "target", "score"],
    "roles": ["checkpoint", "step", "layer", "head", "role"],
}


def _frame(rows: list[dict], name: str) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=_COLUMNS[name])


@dataclass
class CheckpointSeries:
    """An analysis over a series of checkpoints (see the module docstring).

    Attributes:
        analysis: `{"analysis": name, "params": {...}}`: what ran on each checkpoint.
        checkpoints: the checkpoints table.
        scores: the per-head scores table.
        scalars: the scalars table.
        edges: the edges table.
        roles: the roles table.
    """

    SCHEMA: ClassVar[str] = SERIES_SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SERIES_SCHEMA_VERSION

    analysis: dict
    checkpoints: pd.DataFrame
    scores: pd.DataFrame = field(default_factory=lambda: _frame([], "scores"))
    scalars: pd.DataFrame = field(default_factory=lambda: _frame([], "scalars"))
    edges: pd.DataFrame = field(default_factory=lambda: _frame([], "edges"))
    roles: pd.DataFrame = field(default_factory=lambda: _frame([], "roles"))

    @classmethod
    def from_parts(cls, analysis: dict, parts: list[dict]) -> CheckpointSeries:
        """The series from per-checkpoint parts (`{"checkpoint": {name, step, tokens, path},
        "seconds": s, "rows": Tidy.to_json()}`, in step order)."""
        tables: dict[str, list[dict]] = {k: [] for k in _COLUMNS}
        for part in parts:
            c = part["checkpoint"]
            tables["checkpoints"].append(
                {
                    "checkpoint": c["name"],
                    "step": c["step"],
                    "tokens": c.get("tokens"),
                    "path": c.get("path"),
                    "seconds": part.get("seconds"),
                }
            )
            key = {"checkpoint": c["name"], "step": c["step"]}
            for name in ("scores", "scalars", "edges", "roles"):
                tables[name] += [{**key, **r} for r in part["rows"].get(name, [])]
        frames = {k: _frame(v, k) for k, v in tables.items()}
        frames["scores"]["score"] = frames["scores"]["score"].astype(float)
        frames["scalars"]["value"] = frames["scalars"]["value"].astype(float)
        return cls(analysis, **frames)

    # ------------------------------------------------------------------ views
    @property
    def steps(self) -> list[int]:
        """The checkpoints' steps, ascending."""
        return [int(s) for s in self.checkpoints["step"]]

    @property
    def metrics(self) -> list[str]:
        """The per-head metrics present (`scores.metric`), in first-seen order."""
        return list(dict.fromkeys(self.scores["metric"]))

    @property
    def scalar_metrics(self) -> list[str]:
        """The scalar metrics present, in first-seen order."""
        return list(dict.fromkeys(self.scalars["metric"]))

    def to_frame(self) -> pd.DataFrame:
        """The per-head table: `checkpoint, step, metric, layer, head, score`."""
        return self.scores.copy()

    def _check_metric(self, metric: str | None, pool: list[str], what: str) -> str:
        if metric is None:
            if len(pool) != 1:
                raise HeadsteerValueError(f"name the {what}: one of {', '.join(pool) or 'none'}")
            return pool[0]
        if metric not in pool:
            raise HeadsteerValueError(
                f"no {what} {short_repr(metric)} in this series: {', '.join(pool) or 'none'}"
            )
        return metric

    def _check_step(self, step: int | None) -> int:
        if step is None:
            return self.steps[-1]
        if step not in self.steps:
            raise HeadsteerValueError(f"no checkpoint at step {short_repr(step)}: steps {self.steps}")
        return int(step)

    def head_scores(self, step: int | None = None, metric: str | None = None) -> HeadScores:
        """The `[L, H]` `HeadScores` of `metric` at `step` (default: the last checkpoint and the
        first metric of the series).

        Raises:
            HeadsteerValueError: an unknown step or metric.
        """
        metric = self._check_metric(
            metric if metric is not None else next(iter(self.metrics), None), self.metrics, "metric"
        )
        step = self._check_step(step)
        sub = self.scores[(self.scores["metric"] == metric) & (self.scores["step"] == step)]
        n_layers, n_heads = int(sub["layer"].max()) + 1, int(sub["head"].max()) + 1
        t = torch.full((n_layers, n_heads), math.nan)
        for la, h, v in zip(sub["layer"], sub["head"], sub["score"], strict=True):
            t[int(la), int(h)] = float(v)
        name = str(self.checkpoints.loc[self.checkpoints["step"] == step, "checkpoint"].iloc[0])
        return HeadScores(t, metric, {"step": step, **self.analysis}, model=name)

    def matrix(self, metric: str | None = None) -> pd.DataFrame:
        """`metric` as a steps x heads table: rows steps, columns `"L{layer}.H{head}"`."""
        metric = self._check_metric(metric, self.metrics, "metric")
        sub = self.scores[self.scores["metric"] == metric].copy()
        sub["head_name"] = [f"L{int(a)}.H{int(b)}" for a, b in zip(sub["layer"], sub["head"], strict=True)]
        wide = sub.pivot_table(index="step", columns="head_name", values="score", aggfunc="first", sort=False)
        order = sorted(wide.columns, key=lambda n: tuple(int(x[1:]) for x in n.split(".")))
        return wide[order].sort_index()

    def scalar(self, metric: str) -> pd.Series:
        """One scalar metric over steps (index: step)."""
        metric = self._check_metric(metric, self.scalar_metrics, "scalar metric")
        sub = self.scalars[self.scalars["metric"] == metric]
        return pd.Series(sub["value"].to_numpy(float), index=sub["step"].to_numpy(int), name=metric)

    # ------------------------------------------------------------------ files
    def to_json(self) -> dict:
        """JSON-ready dict (schema `headsteer/checkpoint-series`; NaN as null)."""
        return {"schema": SERIES_SCHEMA, "schema_version": SERIES_SCHEMA_VERSION, **self._payload()}

    def _payload(self) -> dict:
        def rows(df: pd.DataFrame) -> list[dict]:
            return [
                {k: (None if isinstance(v, float) and math.isnan(v) else _plain(v)) for k, v in r.items()}
                for r in df.to_dict("records")
            ]

        return {"analysis": self.analysis, **{k: rows(getattr(self, k)) for k in _COLUMNS}}

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the series as JSON, atomically; returns the path.

        Raises:
            HeadsteerValueError: `path` exists without `overwrite`, is a folder or a symlink.
        """
        return write_result(
            check_path("path", path),
            SERIES_SCHEMA,
            SERIES_SCHEMA_VERSION,
            self._payload(),
            overwrite=overwrite,
        )

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: Any = None) -> CheckpointSeries:  # noqa: ARG003
        """Read a series written by `save` (`model` is accepted for the result protocol and unused:
        a series spans several models).

        Raises:
            HeadsteerValueError: not a checkpoint-series file, or another schema version.
        """
        data = read_result(check_path("path", path), SERIES_SCHEMA, SERIES_SCHEMA_VERSION, "CheckpointSeries")
        frames = {}
        for k in _COLUMNS:
            rows = data.get(k, [])
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise HeadsteerValueError(f"{str(path)!r}: {k} must be a list of rows")
            frames[k] = _frame(rows, k)
        frames["scores"]["score"] = frames["scores"]["score"].astype(float)
        frames["scalars"]["value"] = frames["scalars"]["value"].astype(float)
        return cls(dict(data.get("analysis", {})), **frames)

    def __repr__(self) -> str:
        return (
            f"CheckpointSeries({self.analysis.get('analysis')!r}: {len(self.checkpoints)} checkpoints, "
            f"steps {self.steps[:1]}..{self.steps[-1:]}, metrics {self.metrics + self.scalar_metrics})"
        )


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return v
