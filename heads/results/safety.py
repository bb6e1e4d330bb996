"""The safety-head results: `ShipsResult` (`heads.ships`) and `SaharaResult` (`heads.sahara`).

Both follow the result protocol (`heads.results.protocol.Result`): `head_scores()`, `to_frame()`,
`save()` / `load()`. They are re-exported where they were defined before
(`heads.scorers.safety.common.ShipsResult`, `heads.scorers.safety.ships.SaharaResult`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.results.scores import HeadScores
from heads.results.storage import check_geometry, guarded_load, read_result, write_result
from heads.results.views import html_view, top_heads_text

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel

__all__ = ["SAHARA_SCHEMA", "SHIPS_SCHEMA", "SaharaResult", "ShipsResult"]

SHIPS_SCHEMA = "headsteer/ships"
SAHARA_SCHEMA = "headsteer/sahara"

Head = tuple[int, int]


def _grid(x: torch.Tensor) -> list:
    """A float tensor as nested lists, NaN as None (JSON has no NaN)."""
    out: Any = x.double().tolist()

    def fix(v: Any) -> Any:
        return [fix(u) for u in v] if isinstance(v, list) else (None if math.isnan(v) else v)

    fixed: list = fix(out)
    return fixed


def _tensor(v: Any, where: str, what: str) -> torch.Tensor:
    def back(u: Any) -> Any:
        return [back(w) for w in u] if isinstance(u, list) else (math.nan if u is None else u)

    try:
        return torch.tensor(back(v), dtype=torch.float32)
    except (TypeError, ValueError) as exc:
        raise HeadsteerValueError(f"{short_repr(where)}: {what} is not a number grid ({exc})") from None


def _scores(v: Any, where: str, what: str) -> HeadScores:
    if not isinstance(v, dict):
        raise HeadsteerValueError(f"{short_repr(where)}: {what} must be a HeadScores object")
    return HeadScores._from_json(v, where)


@dataclass
class ShipsResult:
    """Per-prompt Ships `[N, L, H]` (nats; NaN = head not scored) and their mean.

    `estimate` is set by `method="attribution"`: the attribution estimate of every head
    (`heads.scorers.safety.attribution`), kept apart from the exact `scores`.
    """

    per_prompt: torch.Tensor
    scores: HeadScores
    estimate: HeadScores | None = None

    SCHEMA: ClassVar[str] = SHIPS_SCHEMA
    SCHEMA_VERSION: ClassVar[int] = 1

    def top(self, prompt: int, k: int = 10) -> list[Head]:
        """The `k` heads with the largest Ships on prompt `prompt` (the paper keeps 10)."""
        s = HeadScores(self.per_prompt[prompt], "ships")
        return s.ranked(k)

    def head_scores(self) -> HeadScores:
        """`[L, H]` mean Ships over the prompts (nats): `scores`."""
        return self.scores

    def to_frame(self) -> pd.DataFrame:
        """One row per head: `layer, head, kv_head, ships` (mean KL, nats) and `estimate` when
        the attribution estimate was kept."""
        df = self.scores.to_frame().rename(columns={"score": "ships"})
        if self.estimate is not None:
            df["estimate"] = self.estimate.scores.flatten().numpy()
        return df

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the result as JSON (schema `headsteer/ships`; NaN as null), atomically; returns
        the path.

        Raises:
            HeadsteerValueError: `path` exists and `overwrite` is False, is a symlink or a folder.
        """
        payload = {
            "per_prompt": _grid(self.per_prompt),
            "scores": self.scores.to_json(),
            "estimate": None if self.estimate is None else self.estimate.to_json(),
        }
        return write_result(path, SHIPS_SCHEMA, self.SCHEMA_VERSION, payload, overwrite=overwrite)

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> ShipsResult:
        """Read a file `save` wrote, checked against `model`'s geometry when given.

        Raises:
            FileNotFoundError: no such file.
            HeadsteerValueError: not a Ships file, another schema version, a malformed field, a
                model of another geometry.
        """
        where = str(path)
        data = read_result(path, SHIPS_SCHEMA, cls.SCHEMA_VERSION, "ShipsResult")
        scores = _scores(data.get("scores"), where, "scores")
        est = data.get("estimate")
        per = _tensor(data.get("per_prompt"), where, "per_prompt")
        if per.ndim != 3 or tuple(per.shape[1:]) != tuple(scores.scores.shape):
            raise HeadsteerValueError(
                f"{short_repr(where)}: per_prompt must be [N, L, H] beside scores [L, H]"
            )
        check_geometry(path, (scores.n_layers, scores.n_heads, scores.n_kv_heads), model)
        return cls(per, scores, None if est is None else _scores(est, where, "estimate"))

    def _view(self) -> tuple[str, str]:
        """(what the scores are, how they are ranked): Ships' KL (>= 0, the largest first) or, for
        an attribution to a metric (`method="attribution"`), its signed estimated change, the
        largest |change| first (a head that helps the metric matters as much as one that hurts)."""
        if self.scores.method == "attribution":
            return "mean estimated metric change", "abs"
        return "mean KL (nats)", "score"

    def __repr__(self) -> str:
        n, n_layers, n_heads = self.per_prompt.shape
        scored = int((~torch.isnan(self.scores.scores)).sum())
        label, by = self._view()
        order = " by |change|" if by == "abs" else ""
        return (
            f"ShipsResult({self.scores.model}: {n} prompts x {scored} of {n_layers * n_heads} heads; "
            f"{label} top{order} {top_heads_text(self.scores, by=by)})"
        )

    def _repr_html_(self) -> str:
        label, by = self._view()
        rows = [(f"L{la}.H{h}", self.scores.scores[la, h].item()) for la, h in self.scores.ranked(10, by=by)]
        return html_view(repr(self), rows, ("head", label)) + self.scores._repr_html_()


@dataclass
class SaharaResult:
    """Sahara's chosen heads in order, and every step's full score table."""

    heads: list[Head]
    steps: list[HeadScores] = field(default_factory=list)

    SCHEMA: ClassVar[str] = SAHARA_SCHEMA
    SCHEMA_VERSION: ClassVar[int] = 1

    def _rows(self) -> list[tuple[int, str, float]]:
        """(step, head added, its score at that step) per step."""
        return [
            (i + 1, f"L{la}.H{h}", table.scores[la, h].item())
            for i, ((la, h), table) in enumerate(zip(self.heads, self.steps, strict=False))
        ]

    def head_scores(self, step: int = 0) -> HeadScores:
        """`[L, H]` score table of greedy step `step` (default 0: the first, every head alone).

        Raises:
            HeadsteerValueError: no step, or `step` out of range.
        """
        if not -len(self.steps) <= step < len(self.steps) or not self.steps:
            raise HeadsteerValueError(
                f"step {short_repr(step)} out of range: this result has {len(self.steps)}"
            )
        return self.steps[step]

    def to_frame(self) -> pd.DataFrame:
        """One row per step: `step, layer, head, score` (the head added and its score then)."""
        import pandas as pd

        rows = [
            {"step": i + 1, "layer": la, "head": h, "score": float(t.scores[la, h])}
            for i, ((la, h), t) in enumerate(zip(self.heads, self.steps, strict=False))
        ]
        return pd.DataFrame(rows, columns=["step", "layer", "head", "score"])

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the result as JSON (schema `headsteer/sahara`), atomically; returns the path.

        Raises:
            HeadsteerValueError: `path` exists and `overwrite` is False, is a symlink or a folder.
        """
        payload = {"heads": [list(h) for h in self.heads], "steps": [s.to_json() for s in self.steps]}
        return write_result(path, SAHARA_SCHEMA, self.SCHEMA_VERSION, payload, overwrite=overwrite)

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> SaharaResult:
        """Read a file `save` wrote, checked against `model`'s geometry when given.

        Raises:
            FileNotFoundError: no such file.
            HeadsteerValueError: not a Sahara file, another schema version, a malformed field, a
                model of another geometry.
        """
        where = str(path)
        data = read_result(path, SAHARA_SCHEMA, cls.SCHEMA_VERSION, "SaharaResult")
        heads, steps = data.get("heads"), data.get("steps")
        if not isinstance(heads, list) or not isinstance(steps, list):
            raise HeadsteerValueError(f"{short_repr(where)}: heads and steps must be lists")
        try:
            chosen = [(int(la), int(h)) for la, h in heads]
        except (TypeError, ValueError):
            raise HeadsteerValueError(f"{short_repr(where)}: heads must be [layer, head] pairs") from None
        tables = [_scores(s, where, "a step") for s in steps]
        for t in tables[:1]:
            check_geometry(path, (t.n_layers, t.n_heads, t.n_kv_heads), model)
        return cls(chosen, tables)

    def __repr__(self) -> str:
        chosen = ", ".join(f"{head} ({score:.3g})" for _, head, score in self._rows())
        return f"SaharaResult({len(self.heads)} steps; heads added (angle): {chosen or 'none'})"

    def _repr_html_(self) -> str:
        return html_view(repr(self), self._rows(), ("step", "head added", "angle at that step"))
