"""`DLAResult`: direct logit attribution of every head, MLP and the embeddings on the logit
difference (`heads.direct_logit_attribution`).

It follows the result protocol (`heads.results.protocol.Result`) and is re-exported from its old
home, `heads.scorers.patching.logit`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.results.scores import HeadScores
from heads.results.stability import Stability
from heads.results.storage import check_geometry, guarded_load, read_result, write_result

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel

__all__ = ["SCHEMA", "SCHEMA_VERSION", "DLAResult"]

SCHEMA = "headsteer/dla"
SCHEMA_VERSION = 1


@dataclass
class DLAResult:
    """Direct logit attribution of one clean run (logit difference answer - counterfactual).

    A linear decomposition of the logit difference *before any output soft-cap* (Gemma 2 / 3,
    NanoChat cap the logits after the unembedding; no sum of terms reproduces the cap). Every
    term is in logit units, with the model's constant logit scale (Cohere, Granite, MiniCPM3)
    folded in and each block's residual multiplier (Granite, MiniCPM3) applied to its terms.

    Attributes:
        heads: `[N, L, H, T]` fp32 term of head (l, h)'s output at position t on the logit
            difference read at t (frozen final-norm scale of position t; padding columns 0).
            With chosen positions (`direct_logit_attribution(positions=...)`, listed in
            `params["positions"]`) the last axis of every term is those `P` columns, in order,
            and `position` below indexes them.
        mlp: `[N, L, T]` the MLP terms; `attn_bias`: `[N, L, T]` the output-projection bias terms.
        embed: `[N, T]` the embedding term (token + absolute position embeddings).
        bias: `[N, T]` the final norm's and the LM head's bias terms.
        rest: `[N, T]` what the recorded parts leave unexplained (`x_L` minus their sum).
        logit_diff: `[N, T]` the model's own logit difference at every position, before any
            output soft-cap (equal to the output's where the family has none).
        labels: `T` (or `P`) token strings of pair 0's clean row (`""` on padding).
        model: the model id.
        params: how it was computed.
        stability: the bootstrap over pairs of the last position's head ranking
            (`direct_logit_attribution(stability=B)`, `.bootstrap()`), or None.
    """

    heads: torch.Tensor
    mlp: torch.Tensor
    attn_bias: torch.Tensor
    embed: torch.Tensor
    bias: torch.Tensor
    rest: torch.Tensor
    logit_diff: torch.Tensor
    labels: list[str] = field(default_factory=list)
    model: str = ""
    n_kv_heads: int | None = None
    params: dict = field(default_factory=dict)
    stability: Stability | None = None

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    TERMS: ClassVar[tuple[str, ...]] = ("heads", "mlp", "attn_bias", "embed", "bias", "rest", "logit_diff")

    def __repr__(self) -> str:
        """One line: `[N, L, H, T]`, the model (not the tensors)."""
        n, n_layers, n_heads, t = self.heads.shape
        return (
            f"DLAResult(model={self.model!r}, n_pairs={n}, [n_layers={n_layers}, n_heads={n_heads}], "
            f"positions={t}, stability={self.stability is not None})"
        )

    def total(self) -> torch.Tensor:
        """`[N, T]` the sum of every term (equals `logit_diff` up to float error)."""
        return (
            self.heads.sum((1, 2))
            + self.mlp.sum(1)
            + self.attn_bias.sum(1)
            + self.embed
            + self.bias
            + self.rest
        )

    def head_scores(self, position: int = -1) -> HeadScores:
        """Mean over pairs of the head terms at `position` (default the last) as `HeadScores`."""
        t = self.heads.shape[-1]
        if not -t <= position < t:
            raise HeadsteerValueError(f"position {short_repr(position)} is outside 0..{t - 1}")
        st = self.stability
        if st is not None and st.params.get("position") not in (position, position - t):
            st = None
        return HeadScores(
            self.heads[..., position].mean(0),
            method="patching.dla",
            params={"position": position, **self.params},
            model=self.model,
            n_kv_heads=self.n_kv_heads,
            stability=st,
        )

    def bootstrap(
        self, n_resamples: int = 100, *, position: int = -1, absolute: bool = False, **kwargs: Any
    ) -> Stability:
        """The bootstrap `Stability` of the head ranking at `position` over the pairs, from the
        per-pair head terms (no forward pass; `heads.scorers.stability.grid_stability`, keywords
        `k`, `seed`, `templates`, `by`). `absolute`: rank by |term| (default: by term, as `top`)."""
        from heads.results.resampling import grid_stability

        t = self.heads.shape[-1]
        if not -t <= position < t:
            raise HeadsteerValueError(f"position {short_repr(position)} is outside 0..{t - 1}")
        return grid_stability(
            self.heads[..., position],
            n_resamples,
            absolute=absolute,
            method="patching.dla",
            model=self.model,
            params={"position": position},
            **kwargs,
        )

    def by_position(self) -> torch.Tensor:
        """`[L, H, T]` mean over pairs of the head terms at every position."""
        return self.heads.mean(0)

    def layer_terms(self) -> dict[str, torch.Tensor]:
        """Per layer `[L]` mean terms at the last position: `"attn"` (heads + bias), `"mlp"`."""
        return {
            "attn": (self.heads[..., -1].sum(2) + self.attn_bias[..., -1]).mean(0),
            "mlp": self.mlp[..., -1].mean(0),
        }

    def to_frame(self) -> pd.DataFrame:
        """One row per head: `layer, head, kv_head, score`: the mean head term at the last
        position (logits), as `head_scores()`."""
        return self.head_scores().to_frame()

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write every term as JSON (schema `headsteer/dla`; the stability is not kept),
        atomically; returns the path.

        Raises:
            HeadsteerValueError: `path` exists and `overwrite` is False, is a symlink or a folder;
                a term holds NaN or +-inf.
        """
        payload: dict[str, Any] = {t: getattr(self, t).tolist() for t in self.TERMS}
        payload.update(
            labels=list(self.labels), model=self.model, n_kv_heads=self.n_kv_heads, params=self.params
        )
        return write_result(path, SCHEMA, SCHEMA_VERSION, payload, overwrite=overwrite)

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> DLAResult:
        """Read a file `save` wrote, checked against `model`'s geometry when given.

        Raises:
            FileNotFoundError: no such file.
            HeadsteerValueError: not a DLA file, another schema version, a malformed term, a
                model of another geometry.
        """
        where = short_repr(str(path))
        data = read_result(path, SCHEMA, SCHEMA_VERSION, "DLAResult")
        terms: dict[str, torch.Tensor] = {}
        for t, ndim in zip(cls.TERMS, (4, 3, 3, 2, 2, 2, 2), strict=True):
            try:
                terms[t] = torch.tensor(data[t], dtype=torch.float32)
            except (KeyError, TypeError, ValueError):
                raise HeadsteerValueError(
                    f"{where} is not a valid DLA file: {t} is missing or not numbers"
                ) from None
            if terms[t].ndim != ndim:
                raise HeadsteerValueError(f"{where} is not a valid DLA file: {t} must have {ndim} axes")
        kv = data.get("n_kv_heads")
        out = cls(
            terms["heads"],
            terms["mlp"],
            terms["attn_bias"],
            terms["embed"],
            terms["bias"],
            terms["rest"],
            terms["logit_diff"],
            labels=[str(x) for x in data.get("labels") or []],
            model=str(data.get("model", "")),
            n_kv_heads=int(kv) if kv is not None else None,
            params=dict(data.get("params") or {}),
        )
        _, n_layers, n_heads, _ = out.heads.shape
        check_geometry(path, (n_layers, n_heads, out.n_kv_heads or n_heads), model)
        return out
