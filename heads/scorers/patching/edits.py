"""The patch edits of activation patching: engine edits that write a recorded activation into
a forward (head outputs, queries, the residual stream, patterns, keys / values per KV head), and
`unembed_only`, the column-only unembedding of the last position."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, cast

import torch

from heads.engine.activations import ActivationEdit
from heads.engine.edits import AttentionCall, HeadOutputEdit, ProbEdit, QueryEdit, ResidualEdit
from heads.engine.unembed import unembed_columns
from heads.model.adapter import HeadModel
from heads.planning.patching import PATTERN_BLOCK_RESIDUALS

__all__: list[str] = []  # internal: the patching sweeps' edits


@dataclass(eq=False, repr=False)
class _PatchZ(HeadOutputEdit):
    """Write `source [R, T', H, d]` into the heads of `row_heads`, at the columns of `cols
    [R, T']` (None = all); columns are those of the chunk (after trimming), from the chunk's
    column `start` on (a forward that computes only the columns after a cached prefix needs
    only theirs)."""

    source: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    start: int = 0

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        a = call.q_offset - self.start
        src = cast(torch.Tensor, self.source)[:, a : a + call.q_len].to(z.dtype)
        if self.cols is None:
            return src
        c = self.cols[:, a : a + call.q_len].to(z.device)[:, :, None, None]
        return torch.where(c, src, z)


@dataclass(eq=False, repr=False)
class _PatchQuery(QueryEdit):
    """Write `source [R, T', H, d_q]` (queries after QK-norm and RoPE) into the heads of
    `row_heads`, at every column of the chunk; `source`'s first column is the chunk's column
    `start`."""

    source: torch.Tensor | None = None
    start: int = 0

    def apply(self, q: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        a = call.q_offset - self.start
        return cast(torch.Tensor, self.source)[:, a : a + call.q_len].to(q.dtype)


@dataclass(eq=False, repr=False)
class _PatchResid(ResidualEdit):
    """Replace the residual entering `layer` at the columns `cols [R, T']` by `source [R, T', D]`."""

    source: torch.Tensor | None = None
    cols: torch.Tensor | None = None

    def apply(self, x: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        sl = slice(call.q_offset, call.q_offset + call.q_len)
        src = cast(torch.Tensor, self.source)[:, sl].to(x.dtype)
        c = cast(torch.Tensor, self.cols)[:, sl].to(x.device)[:, :, None]
        return torch.where(c, src, x)


@dataclass(eq=False, repr=False)
class _PatchPattern(ProbEdit):
    """Replace the pattern of the heads in `row_heads` by `source [R, H, T', T']`."""

    source: torch.Tensor | None = None

    def apply(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        src = cast(torch.Tensor, self.source)[:, :, call.q_offset : call.q_offset + call.q_len, : call.k_len]
        mask = self.head_mask(call.batch, call.n_heads, probs.device)[:, :, None, None]
        return torch.where(mask, src.to(probs.dtype), probs)


@dataclass(eq=False, repr=False)
class _PatchPatternQK(ProbEdit):
    """Replace the pattern of the heads in `row_heads` by the one the layer computes from another
    run's rotated queries and keys, `source [R, T', H + G, d]` (the `query` and `rot_k` sites of
    that run, joined on the head axis), a block of query rows at a time (`call.pattern_of`: the
    layer's own scale, soft-cap, mask and sinks), so no `[R, H, T', T']` pattern is ever kept;
    `d_model` sizes the blocks (`block_rows`)."""

    source: torch.Tensor | None = None
    d_model: int = 0
    uses_pattern_of: ClassVar[bool] = True

    def block_rows(self, batch: int, n_heads: int, k_len: int) -> int | None:
        """`PATTERN_BLOCK_RESIDUALS x d_model / H` query rows: each `[B, H, rows, K]` block tensor
        holds at most that fraction of a residual-stream copy `[B, K, d_model]`."""
        return max(1, int(PATTERN_BLOCK_RESIDUALS * self.d_model) // max(1, n_heads))

    def apply(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        if call.pattern_of is None:  # the blocked kernel always gives it to its pattern edits
            raise RuntimeError("pattern patching ran outside the blocked kernel")
        src, H = cast(torch.Tensor, self.source), call.n_heads
        mask = self.head_mask(call.batch, H, probs.device)  # [R, H]
        heads = mask.any(0).nonzero().flatten()
        if heads.numel() == 0:
            return probs
        groups = H // (src.shape[2] - H)
        query = src[:, call.q_offset : call.q_offset + call.q_len, heads]
        key = src[:, : call.k_len, H + torch.div(heads, groups, rounding_mode="floor")]
        new = call.pattern_of(
            query.transpose(1, 2).to(probs.device), key.transpose(1, 2).to(probs.device), heads
        )
        out = probs.clone()  # a new tensor: the kernel reads the input returned as "unchanged"
        out[:, heads] = torch.where(mask[:, heads, None, None], new, probs[:, heads])
        return out


class _PatchKV(ActivationEdit):
    """Write `source [R, T', G, d]` (a KV site, `k` or `v`) into the KV heads of `row_heads`, at
    every column of the chunk; `source`'s first column is the chunk's column `start`."""

    def __init__(self, site: str, layer: int, row_heads: torch.Tensor, source: torch.Tensor, start: int = 0):
        super().__init__(site, layer, row_heads=row_heads)
        self.source, self.start = source, start

    def apply(self, x: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        a = call.q_offset - self.start
        return cast(torch.Tensor, self.source)[:, a : a + call.q_len].to(x.dtype)


@contextmanager
def unembed_only(model: HeadModel, columns: torch.Tensor | None) -> Iterator[None]:
    """Within the block this thread's row forwards compute only the vocabulary `columns` (`[K]`
    long) of the last position's logits; the other columns are NaN. For metrics that read a few
    tokens (`Metric.columns`, e.g. `logit_diff`): the unembedding of a chunk's last position costs
    `K / V` of the full one. Each computed logit is the same dot product as in the full head,
    then the model's own logit scale and soft-cap (fp32: equal within rounding). A no-op for
    `columns=None`, a backend other than Hugging Face, an LM head that is not a plain `nn.Linear`,
    or more than half the vocabulary. Nothing on the model changes
    (`heads.engine.unembed.unembed_columns`: the LM head runs on no position and the columns
    come from the final normed state); other threads are not affected."""
    with unembed_columns(model, columns):
        yield
