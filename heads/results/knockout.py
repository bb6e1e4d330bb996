"""`KnockoutResult`: the logit difference of every prompt pair with attention knocked out, per
condition (which keys are blocked) and cell (which layers / heads), beside the unedited run.

The result of `heads.knockout`. Per pair values are kept, so the intervals, a paired comparison
of two conditions or a re-cut by template are arithmetic, not new forwards. It follows the
result protocol (`heads.results.protocol`): `head_scores()`, `to_frame()`, `save()`, `load()`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from heads._util.validation import check_path, short_repr
from heads.errors import HeadsteerValueError
from heads.results.evaluation import mean_interval
from heads.results.scores import HeadScores
from heads.results.storage import check_geometry, guarded_load, read_result, write_result

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel

__all__ = ["SCHEMA", "SCHEMA_VERSION", "KnockoutResult"]

SCHEMA = "headsteer/knockout"
SCHEMA_VERSION = 1


def _nan_list(x: torch.Tensor) -> list:
    """A float tensor as nested lists with NaN as None (JSON has no NaN)."""
    out = x.double().tolist()

    def fix(v: Any) -> Any:
        if isinstance(v, list):
            return [fix(u) for u in v]
        return None if isinstance(v, float) and math.isnan(v) else v

    fixed: list = fix(out)
    return fixed


@dataclass
class KnockoutResult:
    """Attention knockout on N prompt pairs (`heads.knockout`).

    Attributes:
        conditions: the condition labels (one per set of blocked keys), `[C]`.
        keys: `{label: key positions}` as given (position names or padded columns).
        queries: the query positions whose attention was cut (names or columns).
        cells: `[S]` `(layers, heads or None)`: each cell knocks out those heads (None: every
            head) in those layers, together.
        per: how the cells were cut: `"all"`, `"layer"` or `"head"`.
        baseline: `[N]` logit difference (mean answer logit - mean counterfactual logit at the
            last position) of the unedited run, in logits.
        knocked: `[C, S, N]` the same with the knockout of condition c in cell s.
        which: the prompts run, `"clean"` or `"corrupted"`.
        factor: 0 (knockout) or the attention multiplier (modification).
        level: the confidence level of the intervals.
        model: the model's id.
        n_layers: L.
        n_heads: H.
        n_kv_heads: G.
        params: free fields (n_pairs, ...).
    """

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    conditions: list[str]
    keys: dict[str, list]
    queries: list
    cells: list[tuple[tuple[int, ...], tuple[int, ...] | None]]
    per: str
    baseline: torch.Tensor
    knocked: torch.Tensor
    which: str = "clean"
    factor: float = 0.0
    level: float = 0.95
    model: str = ""
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.baseline = torch.as_tensor(self.baseline, dtype=torch.float32).cpu()
        self.knocked = torch.as_tensor(self.knocked, dtype=torch.float32).cpu()
        want = (len(self.conditions), len(self.cells), self.baseline.numel())
        if self.baseline.ndim != 1 or tuple(self.knocked.shape) != want:
            raise HeadsteerValueError(
                f"knocked must be [conditions, cells, pairs] = {want} beside a [pairs] baseline, got "
                f"{tuple(self.knocked.shape)} and {tuple(self.baseline.shape)}"
            )
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads

    # ---------------------------------------------------------------- values
    @property
    def n(self) -> int:
        """N, the number of pairs."""
        return int(self.baseline.numel())

    def effect(self) -> torch.Tensor:
        """`[C, S, N]` knocked-out minus unedited logit difference per pair (negative: the
        blocked attention was helping the answer)."""
        return self.knocked - self.baseline

    def _condition(self, condition: str | None) -> int:
        if condition is None:
            return 0
        if condition not in self.conditions:
            raise HeadsteerValueError(
                f"unknown condition {short_repr(condition)}; this result has {self.conditions}"
            )
        return self.conditions.index(condition)

    def head_scores(self, condition: str | None = None) -> HeadScores:
        """`[L, H]` mean effect (logits) of the cell that knocks each head out, for `condition`
        (default the first); heads in no cell are NaN. With `per="all"` every knocked head holds
        the one cell's effect; with `"layer"` each head its layer's.

        Raises:
            HeadsteerValueError: an unknown condition.
        """
        c = self._condition(condition)
        out = torch.full((self.n_layers, self.n_heads), math.nan)
        mean = self.effect()[c].double().mean(-1).float()
        for s, (layers, heads) in enumerate(self.cells):
            hs = list(range(self.n_heads)) if heads is None else list(heads)
            for la in layers:
                out[la, hs] = mean[s]
        return HeadScores(
            out,
            method="knockout",
            params={
                "condition": self.conditions[c],
                "per": self.per,
                "factor": self.factor,
                "which": self.which,
            },
            model=self.model,
            n_kv_heads=self.n_kv_heads,
        )

    def to_frame(self) -> pd.DataFrame:
        """One row per (condition, cell): `condition, layers, heads, logit_diff, logit_diff_lo,
        logit_diff_hi, effect, effect_lo, effect_hi, baseline` (means over the pairs with their
        Student-t intervals at `level`)."""
        import pandas as pd

        rows = []
        base = float(self.baseline.double().mean())
        eff = self.effect()
        for c, label in enumerate(self.conditions):
            for s, (layers, heads) in enumerate(self.cells):
                lo, hi = mean_interval(self.knocked[c, s], self.level)
                elo, ehi = mean_interval(eff[c, s], self.level)
                rows.append(
                    {
                        "condition": label,
                        "layers": list(layers),
                        "heads": "all" if heads is None else list(heads),
                        "logit_diff": float(self.knocked[c, s].double().mean()),
                        "logit_diff_lo": lo,
                        "logit_diff_hi": hi,
                        "effect": float(eff[c, s].double().mean()),
                        "effect_lo": elo,
                        "effect_hi": ehi,
                        "baseline": base,
                    }
                )
        return pd.DataFrame(rows)

    # ---------------------------------------------------------------- files
    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the result as JSON (atomically, `heads.results.storage.write_result`); returns the path.

        Raises:
            HeadsteerValueError: `path` exists and `overwrite` is False, or is a symlink or a folder.
        """
        payload = {
            "conditions": list(self.conditions),
            "keys": {k: list(v) for k, v in self.keys.items()},
            "queries": list(self.queries),
            "cells": [[list(la), None if h is None else list(h)] for la, h in self.cells],
            "per": self.per,
            "baseline": _nan_list(self.baseline),
            "knocked": _nan_list(self.knocked),
            "which": self.which,
            "factor": self.factor,
            "level": self.level,
            "model": self.model,
            "geometry": [self.n_layers, self.n_heads, self.n_kv_heads],
            "params": self.params,
        }
        return write_result(check_path("path", path), SCHEMA, SCHEMA_VERSION, payload, overwrite=overwrite)

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> KnockoutResult:
        """Read a file `save` wrote, checked against `model`'s geometry when given.

        Raises:
            FileNotFoundError: no such file.
            HeadsteerValueError: not a knockout file, another schema version, a malformed field, a
                model of another geometry.
        """
        data = read_result(check_path("path", path), SCHEMA, SCHEMA_VERSION, "KnockoutResult")
        try:
            geometry = tuple(int(x) for x in data["geometry"])
            cells = [
                (tuple(int(x) for x in la), None if h is None else tuple(int(x) for x in h))
                for la, h in data["cells"]
            ]

            def tensor(v: Sequence) -> torch.Tensor:
                return torch.tensor(_nan_back(v), dtype=torch.float32)

            out = cls(
                conditions=[str(c) for c in data["conditions"]],
                keys={str(k): list(v) for k, v in dict(data["keys"]).items()},
                queries=list(data["queries"]),
                cells=cells,
                per=str(data["per"]),
                baseline=tensor(data["baseline"]),
                knocked=tensor(data["knocked"]),
                which=str(data["which"]),
                factor=float(data["factor"]),
                level=float(data["level"]),
                model=str(data["model"]),
                n_layers=geometry[0],
                n_heads=geometry[1],
                n_kv_heads=geometry[2],
                params=dict(data.get("params") or {}),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            if isinstance(exc, HeadsteerValueError):
                raise
            raise HeadsteerValueError(
                f"{short_repr(str(path))} is not a valid knockout file: {exc}"
            ) from None
        check_geometry(path, (out.n_layers, out.n_heads, out.n_kv_heads), model)
        return out

    def __repr__(self) -> str:
        best = ""
        if self.cells and self.conditions:
            eff = self.effect().double().mean(-1)
            c, s = divmod(int(eff.abs().flatten().argmax()), len(self.cells))
            la, h = self.cells[s]
            best = f"; largest effect {float(eff[c, s]):+.3f} ({self.conditions[c]}, layers {list(la)}"
            best += ")" if h is None else f", heads {list(h)})"
        return (
            f"KnockoutResult({self.model or 'model'}: {self.n} pairs, {len(self.conditions)} conditions x "
            f"{len(self.cells)} cells ({self.per}), baseline logit diff "
            f"{float(self.baseline.double().mean()):.3f}"
            f"{best})"
        )


def _nan_back(v: Any) -> Any:
    """Nested lists with None as NaN."""
    if isinstance(v, list):
        return [_nan_back(u) for u in v]
    return math.nan if v is None else v
