"""Per-row edits: each request's engine edits restricted to its own row of a batch.

A batch of requests decodes as one left-padded batch; every request's edits are wrapped so that
they act on its row only (`Edit.row_heads`, per-row biases, spans and residual vectors), with the
row's own positions (`_pad_to`, `_row_call`). `_wrapper(e)` is the per-row class of an edit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from heads.engine.edits import (
    AttentionCall,
    Edit,
    HeadOutputEdit,
    LogitBias,
    ProbEdit,
    QueryEdit,
    ResidualEdit,
    SpanShareEdit,
)
from heads.errors import HeadsteerTypeError
from heads.inputs.prompts import EncodedPrompts

if TYPE_CHECKING:
    pass

__all__: list[str] = []  # internal to steer.serving


def _pad_to(enc: EncodedPrompts, width: int, pad_id: int) -> EncodedPrompts:
    """A one-row encoding left-padded to `width` columns (spans shifted by the padding)."""
    pad = width - enc.length
    if pad == 0:
        return enc
    ids = torch.cat([torch.full((1, pad), pad_id, dtype=torch.long), enc.input_ids], dim=1)
    mask = torch.cat([torch.zeros((1, pad), dtype=torch.long), enc.attention_mask], dim=1)
    spans = [[(t0 + pad, t1 + pad) for t0, t1 in enc.spans[0]]]
    return EncodedPrompts(ids, mask, spans, enc.texts, enc.char_spans)


def _row_call(call: AttentionCall) -> AttentionCall:
    """The attention call as one batch row sees it."""
    return AttentionCall(call.layer, 1, call.n_heads, call.q_len, call.k_len, call.q_offset, call.device)


@dataclass(eq=False, repr=False)
class _RowEdits:
    """Edits of one layer and kind, each applied to its own batch row only (`members`)."""

    layer: int
    members: list = field(default_factory=list)  # [(row, edit)]

    def _rows(self, x: torch.Tensor, call: AttentionCall, head_dim: int) -> torch.Tensor:
        """Apply each member's `apply` to its row slice of `x` (heads on dim `head_dim`)."""
        out = x.clone()
        sub_call = _row_call(call)
        for b, e in self.members:
            sub = out[b : b + 1]
            shape = [1] * x.ndim
            shape[head_dim] = call.n_heads
            mask = e.head_mask(1, call.n_heads, x.device).reshape(shape)
            out[b : b + 1] = torch.where(mask, e.apply(sub, sub_call), sub)
        return out


class _RowHeads(_RowEdits):
    """Row edits whose `head_mask` is each row's own members' heads (`[B, H]`), not all heads."""

    def head_mask(self, batch: int, n_heads: int, device: torch.device) -> torch.Tensor:
        mask = torch.zeros(batch, n_heads, dtype=torch.bool, device=device)
        for b, e in self.members:
            mask[b] |= e.head_mask(1, n_heads, device)[0]
        return mask


@dataclass(eq=False, repr=False)
class _RowBias(_RowHeads, LogitBias):
    """Every row's logit bias of one layer as one tensor that broadcasts like a per-call bias.

    When each row has at most one member and every member's bias is shared by its heads
    (PASTA: `[1, 1, 1, K]`), the bias is `[B, 1, 1, K]` and `row_heads` (`[B, H]`, each row's
    own heads) restricts it, so a batch costs what one per-call edit costs; otherwise
    `[B, H, 1|Q, K]` (members combined per head). `per_column` when every member is.
    """

    def bias(self, call: AttentionCall) -> torch.Tensor:
        sub_call = _row_call(call)
        parts = [(b, e, e.bias(sub_call).float()) for b, e in self.members]
        q = max(p.shape[2] for _, _, p in parts)
        rows = [b for b, _, _ in parts]
        if len(set(rows)) == len(rows) and all(p.shape[1] == 1 for _, _, p in parts):
            out = torch.zeros(call.batch, 1, q, call.k_len, device=call.device)
            for b, _, p in parts:
                out[b] = p[0].to(call.device)
            return out
        out = torch.zeros(call.batch, call.n_heads, q, call.k_len, device=call.device)
        for b, e, p in parts:
            mask = e.head_mask(1, call.n_heads, call.device)[0, :, None, None]
            out[b] += torch.where(mask, p[0].to(call.device), 0.0)
        return out


@dataclass(eq=False, repr=False)
class _RowScoreBias(_RowHeads, LogitBias):
    """Every row's logit-reading bias (AdaptVis / ScalingVis) of one layer: each member's
    `score_bias` on its own row's logits and heads, `[B, H, q_len, k_len]` (blocked kernel)."""

    reads_scores: ClassVar[bool] = True

    def bias(self, call: AttentionCall) -> torch.Tensor:
        raise NotImplementedError("a function of the logits: see score_bias")

    def score_bias(self, scores: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        sub_call = _row_call(call)
        out = torch.zeros(call.batch, scores.shape[1], call.q_len, call.k_len, device=call.device)
        for b, e in self.members:
            mask = e.head_mask(1, call.n_heads, call.device)[0, :, None, None]
            part = e.score_bias(scores[b : b + 1], sub_call).float().to(call.device)
            out[b] += torch.where(mask, part[0].expand(scores.shape[1], call.q_len, call.k_len), 0.0)
        return out


@dataclass(eq=False, repr=False)
class _RowResiduals(_RowEdits, ResidualEdit):
    """Every row's residual edit (CAA) of one layer, each applied to its own batch row."""

    def apply(self, x: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
        sub_call = _row_call(call)
        out = None
        for b, e in self.members:
            new = e.apply(x[b : b + 1] if out is None else out[b : b + 1], sub_call)
            if new is None:
                continue
            if out is None:
                out = x.clone()
            out[b : b + 1] = new.to(dtype=x.dtype, device=x.device)
        return out


@dataclass(eq=False, repr=False)
class _RowSpans(_RowHeads, SpanShareEdit):
    """Every row's span-share edit (SpotLight) of one layer as one `SpanShareEdit`, so a long
    prompt runs on the fused kernel exactly as `SteeredModel` runs it (at most one member per row)."""

    def span_columns(self, call: AttentionCall) -> torch.Tensor:
        m = torch.zeros(call.batch, call.k_len, dtype=torch.bool, device=call.device)
        sub_call = _row_call(call)
        for b, e in self.members:
            m[b] = e.span_columns(sub_call)[0].to(call.device)
        return m

    def span_beta(self, num: torch.Tensor, den: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
        sub_call = _row_call(call)
        beta = None
        for b, e in self.members:
            heads = e.head_mask(1, call.n_heads, num.device)[:, :, None]  # [1, H, 1]
            r = e.span_beta(
                torch.where(heads, num[b : b + 1], 0.0), torch.where(heads, den[b : b + 1], 0.0), sub_call
            )
            if r is None:
                continue
            if beta is None:
                beta = torch.zeros_like(num)
            beta[b] = torch.where(heads[0], r.float().expand(1, num.shape[1], num.shape[2])[0], 0.0)
        return beta


@dataclass(eq=False, repr=False)
class _RowProbs(_RowEdits, ProbEdit):
    def apply(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return self._rows(probs, call, 1)  # [B, H, q, k]


@dataclass(eq=False, repr=False)
class _RowOutputs(_RowEdits, HeadOutputEdit):
    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return self._rows(z, call, 2)  # [B, q, H, d]


@dataclass(eq=False, repr=False)
class _RowQueries(_RowEdits, QueryEdit):
    def apply(self, q: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return self._rows(q, call, 2)  # [B, q, H, d]


_RowWrapper = _RowBias | _RowScoreBias | _RowSpans | _RowProbs | _RowOutputs | _RowQueries | _RowResiduals
_WRAPPERS: dict[type[Edit], type[_RowWrapper]] = {  # first match wins: SpanShareEdit before ProbEdit
    LogitBias: _RowBias,
    SpanShareEdit: _RowSpans,
    ProbEdit: _RowProbs,
    HeadOutputEdit: _RowOutputs,
    QueryEdit: _RowQueries,
    ResidualEdit: _RowResiduals,
}


def _wrapper(e: Edit) -> type[_RowWrapper]:
    """The per-row wrapper class of edit `e` (`_WRAPPERS`; a logit-reading bias gets its own)."""
    if isinstance(e, LogitBias) and e.reads_scores:
        return _RowScoreBias
    for kind, wrapper in _WRAPPERS.items():
        if isinstance(e, kind):
            return wrapper
    raise HeadsteerTypeError(f"{type(e).__name__} cannot be served: no per-row form of its edit site")
