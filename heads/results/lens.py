"""`LensResult`: the logit lens at the last position, per layer (`heads.logit_lens`), and with
`logit_inspection` each head's direct logits (comp-mech's logit inspection).

It follows the result protocol (`heads.results.protocol.Result`) and is re-exported from its old
home, `heads.scorers.patching.logit`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from heads._util.validation import is_int, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.arrays import decode, encode
from heads.results.scores import HeadScores
from heads.results.storage import check_geometry, guarded_load, read_result, write_result

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel

__all__ = ["SCHEMA", "SCHEMA_VERSION", "LensResult"]

SCHEMA = "headsteer/logit-lens"
SCHEMA_VERSION = 1

_PER_LAYER = ("answer_logit", "counterfactual_logit", "answer_rank", "counterfactual_rank", "logit_diff")
"""The `[N, L + 1]` fields."""
_PER_HEAD = ("head_answer", "head_counterfactual")
"""The `[N, L, H]` fields (None unless `logit_inspection` filled them)."""


@dataclass
class LensResult:
    """The logit lens at the last position (or at chosen positions), per layer.

    Entry l (< L) is the model's own output function (final norm, unembedding, logit scale,
    output soft-cap: `output_logits`) applied to the residual entering layer l; entry L is the
    model's output itself.

    Attributes:
        answer_logit: `[N, L + 1]` logits of the answer token (mean over a pair's tokens) read
            from the residual entering layer l (index `L`: the final residual, i.e. the model's
            output). With chosen positions (`logit_lens(positions=...)`, listed in
            `params["positions"]`) every per-layer field is `[N, L + 1, P]`.
        counterfactual_logit: `[N, L + 1]` the same for the counterfactual token.
        answer_rank: `[N, L + 1]` ranks (0 = top) of the first answer token.
        counterfactual_rank: `[N, L + 1]` ranks of the first counterfactual token.
        logit_diff: `[N, L + 1]` answer minus counterfactual.
        top_tokens: per layer, the `k` most likely tokens of pair 0 (at the last position read).
        head_answer: `[N, L, H]` each head's direct logit (frozen final scale, last position)
            of the answer token (`head_logits`); None unless asked for: `logit_lens` leaves it
            None, `logit_inspection` fills it (or call `head_logits(model, pairs)` directly).
        head_counterfactual: `[N, L, H]` the same for the counterfactual token; None unless
            asked for, as `head_answer`.
        model: the model id.
        params: how it was computed (`which`, `k`).
        n_heads: the model's query heads per layer (for `load(path, model)`'s geometry check;
            None on a result built by hand).
        n_kv_heads: the model's KV heads per layer (the same check; None on a result built by
            hand).
    """

    answer_logit: torch.Tensor
    counterfactual_logit: torch.Tensor
    answer_rank: torch.Tensor
    counterfactual_rank: torch.Tensor
    logit_diff: torch.Tensor
    top_tokens: list[list[str]] = field(default_factory=list)
    head_answer: torch.Tensor | None = None
    head_counterfactual: torch.Tensor | None = None
    model: str = ""
    params: dict = field(default_factory=dict)
    n_heads: int | None = None
    n_kv_heads: int | None = None

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    def __repr__(self) -> str:
        """One line: `[N, L + 1]`, the model, whether per-head logits are held (not the tensors)."""
        n, points = self.logit_diff.shape[:2]
        return (
            f"LensResult(model={self.model!r}, n_pairs={n}, points={points}, "
            f"head_logits={self.head_answer is not None})"
        )

    @property
    def n_layers(self) -> int:
        """L (the lens has L + 1 points: the residual entering each layer, and the output)."""
        return int(self.logit_diff.shape[1]) - 1

    def winner_share(self) -> torch.Tensor:
        """`[L + 1]` (`[L + 1, P]` at chosen positions) share of pairs whose answer token
        out-scores the counterfactual per layer."""
        return (self.logit_diff > 0).float().mean(0)

    def head_scores(self) -> HeadScores:
        """`[L, H]` each head's direct logit difference at the last position (answer minus
        counterfactual, frozen final-norm scale; logit units), the mean over the pairs: the
        per-head half of the logit inspection (`head_answer - head_counterfactual`, equal to
        DLA's head term at the last position).

        Raises:
            HeadsteerValueError: the result holds no per-head logits (`logit_lens` keeps the
                per-layer lens only: use `logit_inspection`, or fill `head_answer` /
                `head_counterfactual` from `head_logits`).
        """
        if self.head_answer is None or self.head_counterfactual is None:
            raise HeadsteerValueError(
                "this LensResult holds no per-head logits (logit_lens reads layers only): use "
                "logit_inspection(model, pairs) for the per-head direct logits"
            )
        diff = (self.head_answer - self.head_counterfactual).float().mean(0)
        return HeadScores(
            diff,
            "logit_inspection",
            params={"which": self.params.get("which", "clean"), "score": "direct logit difference"},
            model=self.model,
            n_kv_heads=self.n_kv_heads,
        )

    def to_frame(self) -> pd.DataFrame:
        """One row per lens point (layer `0 .. L`, `L` = the model's output; with chosen
        positions one row per point and position, a `position` column added): mean logits, logit
        difference, share where the answer wins, median ranks."""
        import pandas as pd

        n = self.logit_diff.shape[1]
        columns = {
            "answer_logit": self.answer_logit.mean(0),
            "counterfactual_logit": self.counterfactual_logit.mean(0),
            "logit_diff": self.logit_diff.mean(0),
            "answer_wins": self.winner_share(),
            "answer_rank": self.answer_rank.float().median(0).values,
            "counterfactual_rank": self.counterfactual_rank.float().median(0).values,
        }
        if self.logit_diff.ndim == 2:
            return pd.DataFrame({"layer": list(range(n)), **{k: v.numpy() for k, v in columns.items()}})
        # chosen positions ([N, L + 1, P]): one row per lens point and position
        positions = list(self.params.get("positions") or range(self.logit_diff.shape[2]))
        return pd.DataFrame(
            {
                "layer": [la for la in range(n) for _ in positions],
                "position": positions * n,
                **{k: v.reshape(-1).numpy() for k, v in columns.items()},
            }
        )

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the lens (and the per-head logits when held) as JSON (schema
        `headsteer/logit-lens`; tensors as float32 base64, `heads.results.arrays`), atomically;
        returns the path.

        Raises:
            HeadsteerValueError: `path` exists and `overwrite` is False, is a symlink or a folder.
        """
        payload: dict[str, Any] = {f: encode(getattr(self, f)) for f in _PER_LAYER}
        for f in _PER_HEAD:
            t = getattr(self, f)
            payload[f] = None if t is None else encode(t)
        payload.update(
            top_tokens=[list(x) for x in self.top_tokens],
            model=self.model,
            params=self.params,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
        )
        return write_result(path, SCHEMA, SCHEMA_VERSION, payload, overwrite=overwrite)

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> LensResult:
        """Read a file `save` wrote, checked against `model`'s geometry when given.

        Raises:
            FileNotFoundError: no such file.
            HeadsteerValueError: not a logit-lens file, another schema version, a malformed field
                (named), a model of another geometry.
        """
        where = short_repr(str(path))
        data = read_result(path, SCHEMA, SCHEMA_VERSION, "LensResult")
        first = decode(data.get("logit_diff"), f"{where}: logit_diff")
        if first.ndim not in (2, 3):
            raise HeadsteerValueError(f"{where}: logit_diff must be [N, L + 1] or [N, L + 1, P]")
        n, points = first.shape[:2]
        if points < 1:
            raise HeadsteerValueError(f"{where}: logit_diff must have at least one lens point")
        per_layer = {f: decode(data.get(f), f"{where}: {f}", tuple(first.shape)) for f in _PER_LAYER}
        for f in ("answer_rank", "counterfactual_rank"):
            per_layer[f] = per_layer[f].long()
        heads_ = {
            f: None if data.get(f) is None else decode(data.get(f), f"{where}: {f}", (n, points - 1, None))
            for f in _PER_HEAD
        }
        if (heads_["head_answer"] is None) != (heads_["head_counterfactual"] is None) or (
            heads_["head_answer"] is not None
            and heads_["head_counterfactual"] is not None
            and heads_["head_answer"].shape != heads_["head_counterfactual"].shape
        ):
            raise HeadsteerValueError(f"{where}: head_answer and head_counterfactual must come together")
        top: Any = data.get("top_tokens", [])
        if not isinstance(top, list) or not all(
            isinstance(row, list) and all(isinstance(x, str) for x in row) for row in top
        ):
            raise HeadsteerValueError(f"{where}: top_tokens must be lists of strings")
        geometry: dict[str, int | None] = {}
        for key in ("n_heads", "n_kv_heads"):
            v = data.get(key)
            if v is not None and not (is_int(v) and v >= 1):
                raise HeadsteerValueError(
                    f"{where}: {key} must be a positive int or null, got {short_repr(v)}"
                )
            geometry[key] = None if v is None else int(v)
        params, name = data.get("params", {}), data.get("model", "")
        if not isinstance(params, dict) or not isinstance(name, str):
            raise HeadsteerValueError(f"{where}: params must be a mapping and model a string")
        out = cls(
            **per_layer,
            top_tokens=top,
            head_answer=heads_["head_answer"],
            head_counterfactual=heads_["head_counterfactual"],
            model=name,
            params=dict(params),
            n_heads=geometry["n_heads"],
            n_kv_heads=geometry["n_kv_heads"],
        )
        if model is not None:
            if not hasattr(model, "n_kv_heads"):
                raise HeadsteerTypeError(f"model must be a HeadModel, got {type(model).__name__}")
            n_heads = out.n_heads
            if n_heads is None and out.head_answer is not None:
                n_heads = int(out.head_answer.shape[-1])
            # a field the file leaves out (a result built by hand) is taken as the model's
            got = (
                out.n_layers,
                model.n_heads if n_heads is None else n_heads,
                model.n_kv_heads if out.n_kv_heads is None else out.n_kv_heads,
            )
            check_geometry(path, got, model)
        return out
