"""`GatingResult`: contrastive head gating's three fits and the head taxonomy (`heads.gate_heads`;
Wang et al. 2025, arXiv:2505.13737).

It follows the result protocol (`heads.results.protocol.Result`) and is re-exported from its old
home, `heads.scorers.gating.chg`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from heads._util.files import write_text
from heads._util.validation import is_number, short_repr
from heads.errors import HeadsteerValueError
from heads.results.scores import HeadScores, HeadSet, _read_json
from heads.results.storage import check_schema_version, guarded_load, json_text

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel

__all__ = ["LABELS", "SCHEMA", "SCHEMA_VERSION", "GatingResult"]

LABELS = ("facilitating", "interfering", "irrelevant", "ungated")
"""The head labels: the paper's three, and `"ungated"` for a head left out by `heads=`."""

SCHEMA = "headsteer/head-gating"
SCHEMA_VERSION = 1


@dataclass
class GatingResult:
    """The three CHG fits and the taxonomy. Gates are means over the M gate sets; NaN for heads
    left out by `heads=`.

    Attributes:
        gates: HeadScores `[L, H]` of the unregularised gates G (method `"chg"`).
        retain: HeadScores of G+ (`lam > 0`, method `"chg_retain"`).
        remove: HeadScores of G- (`lam < 0`, method `"chg_remove"`): the facilitation score.
        labels: `[L][H]` strings from `LABELS`.
        history: per stage (`"none"`, `"retain"`, `"remove"`), the training loss's NLL per update.
    """

    gates: HeadScores
    retain: HeadScores
    remove: HeadScores
    labels: list[list[str]]
    history: dict[str, list[float]] = field(default_factory=dict)

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    @property
    def scores(self) -> HeadScores:
        """G- (`remove`): high = the head is needed even under pressure to remove it."""
        return self.remove

    def head_scores(self, fit: str = "remove") -> HeadScores:
        """`[L, H]` gates of one fit: `"remove"` (default, G-: the facilitation score, as
        `scores`), `"retain"` (G+) or `"gates"` (G, unregularised).

        Raises:
            HeadsteerValueError: another fit name.
        """
        fits = {"remove": self.remove, "retain": self.retain, "gates": self.gates}
        if fit not in fits:
            raise HeadsteerValueError(f"unknown fit {short_repr(fit)}: use one of {', '.join(fits)}")
        return fits[fit]

    def heads(self, label: str) -> HeadSet:
        """The heads with `label` (one of `LABELS`)."""
        if label not in LABELS:
            raise HeadsteerValueError(f"unknown label {short_repr(label)}: use one of {', '.join(LABELS)}")
        return HeadSet((la, h) for la, row in enumerate(self.labels) for h, x in enumerate(row) if x == label)

    def counts(self) -> dict[str, int]:
        """How many heads carry each label."""
        flat = [x for row in self.labels for x in row]
        return {k: flat.count(k) for k in LABELS if k in flat}

    def to_frame(self) -> pd.DataFrame:
        """One row per head: `layer, head, kv_head, gate, retain, remove, label`."""
        df = self.gates.to_frame().rename(columns={"score": "gate"})
        df["retain"] = self.retain.scores.flatten().numpy()
        df["remove"] = self.remove.scores.flatten().numpy()
        df["label"] = [x for row in self.labels for x in row]
        return df

    def to_json(self) -> dict:
        def grid(s: HeadScores) -> list:
            return [[None if math.isnan(v) else v for v in row] for row in s.scores.tolist()]

        g = self.gates
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "model": g.model,
            "params": g.params,
            "seed": g.seed,
            "n_kv_heads": g.n_kv_heads,
            "gates": grid(g),
            "retain": grid(self.retain),
            "remove": grid(self.remove),
            "labels": self.labels,
            "history": self.history,
        }

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write JSON (schema `headsteer/head-gating`, version 1) atomically; returns the path.

        Raises:
            ValueError: `path` exists and `overwrite` is False, or is a symlink or a folder.
        """
        return write_text(path, json_text(self.to_json(), indent=1), overwrite=overwrite)

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> GatingResult:
        """Read a file written by `save` (checked against `model`'s geometry when given).

        Raises:
            ValueError: not a head-gating file, another version, malformed grids or labels, or a
                geometry other than `model`'s. FileNotFoundError: no such file.
        """
        data = _read_json(path)
        name = str(path)
        try:
            return cls._from_data(data, name, model)
        except HeadsteerValueError:
            raise
        except (TypeError, ValueError, AttributeError, OverflowError) as e:  # a malformed field
            raise HeadsteerValueError(f"{short_repr(name)} is not a valid head-gating file: {e}") from None

    @classmethod
    def _from_data(cls, data: object, name: str, model: HeadModel | None) -> GatingResult:
        """`load`'s checks and construction on the parsed JSON `data` of file `name`."""
        if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
            raise HeadsteerValueError(f"{short_repr(name)} is not a headsteer head-gating file")
        check_schema_version(name, data.get("schema_version"), SCHEMA_VERSION)

        def grid(key: str, method: str) -> HeadScores:
            rows = data.get(key)
            if not isinstance(rows, list) or not rows or any(not isinstance(r, list) for r in rows):
                raise HeadsteerValueError(
                    f"{short_repr(name)}: {short_repr(key)} must be a list of equal rows"
                )
            if len({len(r) for r in rows}) != 1:
                raise HeadsteerValueError(
                    f"{short_repr(name)}: {short_repr(key)} must be a list of equal rows"
                )
            vals = [[math.nan if v is None else v for v in r] for r in rows]
            if any(not is_number(v) for r in vals for v in r):
                raise HeadsteerValueError(
                    f"{short_repr(name)}: {short_repr(key)} holds a value that is not a number"
                )
            return HeadScores(
                torch.tensor(vals, dtype=torch.float32),
                method=method,
                params=dict(data.get("params") or {}),
                model=str(data.get("model", "")),
                n_kv_heads=data.get("n_kv_heads"),
                seed=data.get("seed"),
            )

        g, r, m = grid("gates", "chg"), grid("retain", "chg_retain"), grid("remove", "chg_remove")
        labels = data.get("labels")
        shape = (g.n_layers, g.n_heads)
        if r.scores.shape != g.scores.shape or m.scores.shape != g.scores.shape:
            raise HeadsteerValueError(f"{short_repr(name)}: the three gate grids differ in shape")
        if (
            not isinstance(labels, list)
            or len(labels) != shape[0]
            or any(not isinstance(row, list) or len(row) != shape[1] for row in labels)
            or any(x not in LABELS for row in labels for x in row)
        ):
            raise HeadsteerValueError(f"{short_repr(name)}: labels must be an [L][H] grid of {LABELS}")
        if model is not None and (model.n_layers, model.n_heads, model.n_kv_heads) != (*shape, g.n_kv_heads):
            raise HeadsteerValueError(f"{short_repr(name)} was fitted on a model of another geometry")
        hist = data.get("history") or {}
        if not isinstance(hist, Mapping) or any(not isinstance(v, list) for v in hist.values()):
            raise HeadsteerValueError(f"{short_repr(name)}: history must be an object of lists")
        return cls(g, r, m, [list(row) for row in labels], {str(k): list(v) for k, v in hist.items()})

    def __repr__(self) -> str:
        g = self.gates
        return f"GatingResult({g.model!r}, [{g.n_layers}, {g.n_heads}], {self.counts()})"
