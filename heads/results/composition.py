"""`CompositionScores`: Q-, K- and V-composition between every pair of heads, `[L, H, L, H]`.

Written by `heads.scorers.qk.composition_scores` (from the weights, Elhage et al. 2021) and
`heads.scorers.qk.data_composition_scores` (from the decomposition of a prompt set). Index
order `[writer layer, writer head, reader layer, reader head]`, as TransformerLens'
`all_composition_scores`; entries whose writer is not in an earlier layer than the reader are NaN.
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
from heads._util.validation import check_int, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.arrays import decode, encode
from heads.results.scores import HeadScores, _read_json
from heads.results.storage import check_schema_version, guarded_load, json_text

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel

__all__ = ["KINDS", "METHODS", "SCHEMA", "SCHEMA_VERSION", "CompositionScores"]

SCHEMA = "headsteer/composition-scores"
SCHEMA_VERSION = 1
KINDS = ("q", "k", "v")
METHODS = ("weights", "data")


def _check_kind(kind: object) -> str:
    if kind not in KINDS:
        raise HeadsteerValueError(f"kind must be 'q', 'k' or 'v', got {short_repr(kind)}")
    return str(kind)


@dataclass
class CompositionScores:
    """How much each head's output feeds each later head's query (Q), key (K) or value (V).

    Attributes:
        raw: `{"q" | "k" | "v": [L, H, L, H]}` fp32, `raw[kind][l1, h1, l2, h2]` the composition
            of writer (l1, h1) into reader (l2, h2); NaN unless l1 < l2. `method="weights"`:
            `||W_OV^{h1} M^{h2}||_F / (||W_OV^{h1}||_F ||M^{h2}||_F)` with M the reader's
            `W_QK` (Q), `W_QK^T` (K) or `W_OV` (V), a number in [0, 1]. `method="data"`: the
            mean |term| of the writer's output in the reader's logits (Q, K: logit units) or the
            mean norm of its share of the reader's output (V: residual units).
        baseline: the mean composition of random Gaussian matrices of the same shapes
            (Elhage et al.'s baseline; `method="weights"`), 0.0 for `"data"`.
        method: `"weights"` or `"data"`.
        model: the model id; n_kv_heads: its KV heads.
        params: how it was computed.
    """

    raw: dict[str, torch.Tensor]
    baseline: float = 0.0
    method: str = "weights"
    model: str = ""
    n_kv_heads: int | None = None
    params: dict = field(default_factory=dict)

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if set(self.raw) != set(KINDS):
            raise HeadsteerValueError(f"raw must hold 'q', 'k' and 'v', got {sorted(self.raw)}")
        shapes = {tuple(t.shape) for t in self.raw.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 4:
            raise HeadsteerValueError(f"raw scores must share one [L, H, L, H] shape, got {sorted(shapes)}")
        if self.method not in METHODS:
            raise HeadsteerValueError(f"method must be 'weights' or 'data', got {short_repr(self.method)}")

    @property
    def n_layers(self) -> int:
        return int(self.raw["q"].shape[0])

    @property
    def n_heads(self) -> int:
        return int(self.raw["q"].shape[1])

    def get(self, kind: str, *, subtract_baseline: bool = True) -> torch.Tensor:
        """`[L, H, L, H]` scores of `kind`, minus the random baseline by default."""
        t = self.raw[_check_kind(kind)]
        return t - self.baseline if subtract_baseline else t.clone()

    @property
    def q(self) -> torch.Tensor:
        """`[L, H, L, H]` Q-composition minus the baseline."""
        return self.get("q")

    @property
    def k(self) -> torch.Tensor:
        """`[L, H, L, H]` K-composition minus the baseline."""
        return self.get("k")

    @property
    def v(self) -> torch.Tensor:
        """`[L, H, L, H]` V-composition minus the baseline."""
        return self.get("v")

    def _head(self, pair: object, what: str) -> tuple[int, int]:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise HeadsteerTypeError(f"{what} must be a (layer, head) pair, got {short_repr(pair)}")
        la = check_int(f"{what} layer", pair[0], lo=0, hi=self.n_layers - 1)
        h = check_int(f"{what} head", pair[1], lo=0, hi=self.n_heads - 1)
        return la, h

    def pair(self, writer: tuple[int, int], reader: tuple[int, int]) -> dict[str, float]:
        """`{"q", "k", "v"}` scores (minus the baseline) of one writer -> reader pair (NaN unless
        the writer's layer is earlier)."""
        (l1, h1), (l2, h2) = self._head(writer, "writer"), self._head(reader, "reader")
        return {kind: float(self.get(kind)[l1, h1, l2, h2]) for kind in KINDS}

    def head_scores(
        self, kind: str = "k", *, reader: tuple[int, int] | None = None, writer: tuple[int, int] | None = None
    ) -> HeadScores:
        """`HeadScores` `[L, H]` of one kind (minus the baseline): with `reader`, every writer's
        score into it; with `writer`, its score into every reader; with neither, each reader's
        largest score over its writers (how strongly it composes with anything earlier).

        Raises:
            ValueError: both `reader` and `writer`, a bad kind or head.
        """
        t = self.get(kind)
        what: dict[str, object]
        if reader is not None and writer is not None:
            raise HeadsteerValueError("give reader or writer, not both")
        if reader is not None:
            la, h = self._head(reader, "reader")
            grid, what = t[:, :, la, h], {"reader": [la, h]}
        elif writer is not None:
            la, h = self._head(writer, "writer")
            grid, what = t[la, h], {"writer": [la, h]}
        else:
            flat = t.reshape(-1, self.n_layers, self.n_heads)
            grid = torch.where(torch.isnan(flat), -math.inf, flat).max(0).values
            grid = torch.where(torch.isinf(grid), math.nan, grid)
            what = {"reduce": "max over writers"}
        return HeadScores(
            grid.clone(),
            method=f"composition.{self.method}.{kind}",
            params={**what, **self.params},
            model=self.model,
            n_kv_heads=self.n_kv_heads,
        )

    def top(self, kind: str = "k", k: int = 10) -> list[tuple[tuple[int, int], tuple[int, int], float]]:
        """The `k` largest writer -> reader pairs of `kind`: `((l1, h1), (l2, h2), score)`; at
        most `k` (default 10): every scored pair when fewer (NaN pairs dropped), as
        `pandas.Series.nlargest`."""
        check_int("k", k, lo=1)
        t = self.get(kind)
        flat = torch.where(torch.isnan(t), -math.inf, t).flatten()
        idx = flat.argsort(descending=True)[: min(k, int((~torch.isnan(t)).sum()))].tolist()
        L, H = self.n_layers, self.n_heads
        out = []
        for i in idx:
            l1, r = divmod(i, H * L * H)
            h1, r = divmod(r, L * H)
            l2, h2 = divmod(r, H)
            out.append(((l1, h1), (l2, h2), float(flat[i])))
        return out

    def to_frame(self) -> pd.DataFrame:
        """One row per writer -> reader pair (writer layer < reader layer): `writer_layer,
        writer_head, reader_layer, reader_head, q, k, v` (minus the baseline) and `baseline`."""
        import pandas as pd

        L, H = self.n_layers, self.n_heads
        idx = torch.nonzero(~torch.isnan(self.raw["q"]))
        data: dict[str, object] = {
            "writer_layer": idx[:, 0].numpy(),
            "writer_head": idx[:, 1].numpy(),
            "reader_layer": idx[:, 2].numpy(),
            "reader_head": idx[:, 3].numpy(),
        }
        for kind in KINDS:
            data[kind] = self.get(kind)[idx[:, 0], idx[:, 1], idx[:, 2], idx[:, 3]].numpy()
        data["baseline"] = self.baseline
        del L, H
        return pd.DataFrame(data)

    def __repr__(self) -> str:
        return (
            f"CompositionScores(model={self.model!r}, method={self.method!r}, "
            f"[{self.n_layers}, {self.n_heads}, {self.n_layers}, {self.n_heads}], "
            f"baseline={self.baseline:.4g})"
        )

    # ---------------------------------------------------------------- files
    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "method": self.method,
            "model": self.model,
            "n_kv_heads": self.n_kv_heads,
            "baseline": self.baseline,
            "params": self.params,
            "scores": {k: encode(v) for k, v in self.raw.items()},
        }

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write JSON (schema `headsteer/composition-scores`, version 1; scores as base64
        float32, NaN kept); atomic, refuses an existing file unless `overwrite`, never writes
        through a symlink. Returns the path.

        Raises:
            ValueError: `path` exists (without `overwrite`), is a symlink or a folder.
        """
        return write_text(path, json_text(self.to_json()), overwrite=overwrite)

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> CompositionScores:
        """Read a file written by `save`, checked against `model`'s geometry when given.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a composition-scores file, another version, a malformed field, or a
                geometry that differs from `model`'s.
        """
        if model is not None and not hasattr(model, "n_kv_heads"):
            raise HeadsteerTypeError(f"model must be a HeadModel, got {type(model).__name__}")
        data = _read_json(path)
        name = str(path)
        if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
            raise HeadsteerValueError(f"{short_repr(name)} is not a headsteer CompositionScores file")
        check_schema_version(name, data.get("schema_version"), SCHEMA_VERSION)

        def bad(msg: str) -> HeadsteerValueError:
            return HeadsteerValueError(f"{name!r}: malformed CompositionScores file: {msg}")

        scores = data.get("scores")
        if not isinstance(scores, Mapping) or set(scores) != set(KINDS):
            raise bad("'scores' must hold 'q', 'k' and 'v'")
        base = data.get("baseline")
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base):
            raise bad(f"'baseline' must be a finite number, got {short_repr(base)}")
        params = data.get("params") or {}
        if not isinstance(params, Mapping):
            raise bad("'params' must be an object")
        n_kv = data.get("n_kv_heads")
        if n_kv is not None and (isinstance(n_kv, bool) or not isinstance(n_kv, int)):
            raise bad("'n_kv_heads' must be an int or null")
        try:
            raw = {k: decode(scores[k], f"scores.{k}", (None, None, None, None)) for k in KINDS}
            out = cls(
                raw, float(base), str(data.get("method")), str(data.get("model", "")), n_kv, dict(params)
            )
        except HeadsteerValueError as err:
            raise bad(str(err)) from None
        if model is not None:
            want = (model.n_layers, model.n_heads)
            if (out.n_layers, out.n_heads) != want:
                raise HeadsteerValueError(
                    f"{short_repr(name)} holds (n_layers, n_heads)={(out.n_layers, out.n_heads)}, "
                    f"this model has {want}"
                )
        return out
