"""One forward that keeps what a QK decomposition reads, through the engine's edit sites only.

* the residual stream entering every layer (the model's own `hidden_states`);
* every head's output `z` (`head_output` site: a `HeadOutputEdit` that returns `z` unchanged);
* the attention patterns of chosen layers (`probs` site: `Recorder`);
* the model's own attention logits of chosen (layer, heads): scaled and soft-capped, before the
  mask (`logits` site: a `LogitBias` that reads the logits and adds 0). It makes that layer
  compute its attention on the engine's explicit path, which changes nothing upstream of the
  layer (all that a decomposition of its logits reads).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from heads.engine.edits import AttentionCall, Edit, HeadOutputEdit, LogitBias, Recorder
from heads.engine.variants import run_rows
from heads.model.adapter import HeadModel

__all__ = ["Recording", "record"]


@dataclass(eq=False, repr=False)
class _ZRecord(HeadOutputEdit):
    """Keeps each call's head outputs `[B, T, H, d]` (fp64, CPU); returns them unchanged."""

    records: list = field(default_factory=list, init=False)

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        self.records.append(z.detach().double().cpu())
        return z


def _take(t: torch.Tensor, rows: torch.Tensor | None, call: AttentionCall) -> torch.Tensor:
    """`t [B, h, q_blk, K]` of one query block at the padded columns `rows [B, Q]` (zeros for the
    rows outside the block: summing the blocks' records gives every row), fp64 on CPU."""
    t = t.detach().double().cpu()
    if rows is None:
        return t
    rel = rows - call.q_offset  # [B, Q]
    ok = (rel >= 0) & (rel < call.q_len)
    idx = rel.clamp(0, call.q_len - 1)[:, None, :, None].expand(t.shape[0], t.shape[1], -1, t.shape[3])
    return torch.where(ok[:, None, :, None], t.gather(2, idx), 0.0)


@dataclass(eq=False, repr=False)
class _LogitRecord(LogitBias):
    """Keeps the scaled (soft-capped) logits of its heads, before the mask (at `rows` only, or
    every row); adds 0."""

    reads_scores: ClassVar[bool] = True
    rows: torch.Tensor | None = None
    records: list = field(default_factory=list, init=False)

    def score_bias(self, scores: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        heads = list(self.heads) if self.heads is not None else list(range(call.n_heads))
        self.records.append(_take(scores[:, heads], self.rows, call))
        return torch.zeros((), device=scores.device, dtype=scores.dtype)


@dataclass
class Recording:
    """What one forward kept (fp64, CPU, padded `[N, T]` columns).

    Attributes:
        resid: `L` tensors `[N, T, D]`: `resid[l]` enters layer l (up to the deepest layer asked).
        z: per layer below it `[N, T, H, d]` head outputs.
        pattern: `{layer: [N, H, T or Q, T]}` attention probabilities of the layers asked (at the
            rows asked, for the layers of `logits`, when `rows` is given).
        logits: `{layer: [N, h, T or Q, T]}` the model's logits of the heads asked (scaled,
            soft-capped, before the mask), heads in the order asked.
    """

    resid: list[torch.Tensor]
    z: list[torch.Tensor]
    pattern: dict[int, torch.Tensor]
    logits: dict[int, torch.Tensor]


def _join(records: list[torch.Tensor], rows: torch.Tensor | None) -> torch.Tensor:
    """One tensor from a recorder's per-block records: concatenated blocks (every row), or the
    sum of the blocks' row-selected records (each row lives in one block)."""
    if rows is None:
        return records[0] if len(records) == 1 else torch.cat(records, 2)
    return records[0] if len(records) == 1 else torch.stack(records).sum(0)


@torch.no_grad()
def record(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    upto: int,
    patterns: Sequence[int] = (),
    logits: dict[int, list[int]] | None = None,
    rows: torch.Tensor | None = None,
    full_patterns: bool = False,
) -> Recording:
    """Run `ids [N, T]` (left-padded, `mask [N, T]`) once with recording edits.

    Args:
        upto: keep the residual entering layers `0..upto` and the head outputs of layers
            `0..upto-1`.
        patterns: layers whose attention patterns to keep.
        logits: `{layer: heads}` whose logits to keep.
        rows: `[N, Q]` padded columns: keep only these query rows of the logits, and of the
            patterns of the layers in `logits` (memory `Q x T` instead of `T x T`); None: every row.
        full_patterns: keep every row of every pattern (the source split reads them).
    """
    logits = logits or {}
    zs = [_ZRecord(layer=la) for la in range(upto)]

    def keep(la: int) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor]:
        r = rows if la in logits and not full_patterns else None
        return lambda probs, call: _take(probs, r, call)

    recs = {la: Recorder(layer=la, fn=keep(la)) for la in patterns}
    lgs = {la: _LogitRecord(layer=la, heads=list(hs), rows=rows) for la, hs in logits.items()}
    edits: list[Edit] = [*zs, *recs.values(), *lgs.values()]
    out = run_rows(model, ids, mask, edits)
    resid = [h.detach().double().cpu() for h in out.hidden_states[: upto + 1]]
    return Recording(
        resid,
        [torch.cat(e.records, 1) if len(e.records) > 1 else e.records[0] for e in zs],
        {
            la: _join(r.records, rows if la in logits and not full_patterns else None)
            for la, r in recs.items()
        },
        {la: _join(r.records, rows) for la, r in lgs.items()},
    )
