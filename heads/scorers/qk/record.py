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

from collections.abc import Sequence
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


@dataclass(eq=False, repr=False)
class _LogitRecord(LogitBias):
    """Keeps the scaled (soft-capped) logits of its heads, before the mask; adds 0."""

    reads_scores: ClassVar[bool] = True
    records: list = field(default_factory=list, init=False)

    def score_bias(self, scores: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        heads = list(self.heads) if self.heads is not None else list(range(call.n_heads))
        self.records.append(scores[:, heads].detach().double().cpu())
        return torch.zeros((), device=scores.device, dtype=scores.dtype)


@dataclass
class Recording:
    """What one forward kept (fp64, CPU, padded `[N, T]` columns).

    Attributes:
        resid: `L` tensors `[N, T, D]`: `resid[l]` enters layer l (up to the deepest layer asked).
        z: per layer below it `[N, T, H, d]` head outputs.
        pattern: `{layer: [N, H, T, T]}` attention probabilities of the layers asked.
        logits: `{layer: [N, h, T, T]}` the model's logits of the heads asked (scaled,
            soft-capped, before the mask), heads in the order asked.
    """

    resid: list[torch.Tensor]
    z: list[torch.Tensor]
    pattern: dict[int, torch.Tensor]
    logits: dict[int, torch.Tensor]


@torch.no_grad()
def record(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    upto: int,
    patterns: Sequence[int] = (),
    logits: dict[int, list[int]] | None = None,
) -> Recording:
    """Run `ids [N, T]` (left-padded, `mask [N, T]`) once with recording edits.

    Args:
        upto: keep the residual entering layers `0..upto` and the head outputs of layers
            `0..upto-1`.
        patterns: layers whose attention patterns to keep.
        logits: `{layer: heads}` whose logits to keep.
    """
    zs = [_ZRecord(layer=la) for la in range(upto)]
    recs = {la: Recorder(layer=la) for la in patterns}
    lgs = {la: _LogitRecord(layer=la, heads=list(hs)) for la, hs in (logits or {}).items()}
    edits: list[Edit] = [*zs, *recs.values(), *lgs.values()]
    out = run_rows(model, ids, mask, edits)
    resid = [h.detach().double().cpu() for h in out.hidden_states[: upto + 1]]
    return Recording(
        resid,
        [torch.cat(e.records, 1) if len(e.records) > 1 else e.records[0] for e in zs],
        {la: torch.cat(r.records, 2).double().cpu() for la, r in recs.items()},
        {la: torch.cat(r.records, 2) for la, r in lgs.items()},
    )
