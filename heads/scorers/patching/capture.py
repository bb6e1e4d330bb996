"""Engine edits the patching sweeps share: read an activation and end the forward there (`StopAt`),
and replace a stream activation at chosen columns (`PatchStream`).

Both are `heads.engine.activations.ActivationEdit`s, so they run on every backend and act only on
the calling thread's forward (the engine's edits are per thread).
"""

from __future__ import annotations

from typing import cast

import torch

from heads.engine.activations import ActivationEdit
from heads.engine.edits import AttentionCall, Edit
from heads.engine.variants import run_rows
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel

__all__ = ["ForwardStopped", "PatchStream", "StopAt"]


class ForwardStopped(Exception):
    """Raised by `StopAt` once the activation it waits for is read: the rest of the forward is not
    needed."""


class StopAt(ActivationEdit):
    """Reads the activation at `site` in `layer` (`seen`, detached) and ends the forward there by
    raising `ForwardStopped` (the caller catches it; `editing` restores the model on the way out)."""

    def __init__(self, site: str, layer: int = 0):
        super().__init__(site, layer)
        self.seen: torch.Tensor | None = None

    def apply(self, x: torch.Tensor, call: AttentionCall) -> None:
        self.seen = x.detach()
        raise ForwardStopped


class PatchStream(ActivationEdit):
    """Replace a stream activation `[R, T', D]` at `site` in `layer` (`attn_out`, `mlp_out`, ...)
    by `source [R, T, D]` at the columns `cols [R, T]`, both over the chunk's columns (the call's
    first row is column `call.q_offset`: the cached prefix's length). A block that returns its rows
    flattened (Llama 4's MoE: `[R * T', D]`) is reshaped."""

    def __init__(self, site: str, layer: int, source: torch.Tensor, cols: torch.Tensor):
        super().__init__(site, layer)
        self.source, self.cols = source, cols

    def apply(self, x: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        src = cast(torch.Tensor, self.source)
        t = x.numel() // (src.shape[0] * x.shape[-1])  # the call's positions (also when flattened)
        a = call.q_offset
        rows = x.reshape(src.shape[0], t, x.shape[-1])
        c = self.cols[:, a : a + t].to(x.device)[:, :, None]
        return torch.where(c, src[:, a : a + t].to(x.dtype), rows).reshape(x.shape)


def _one_column_output(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    edits: list[Edit],
    layer: int,
    residual: torch.Tensor | None,
    past: list[tuple[torch.Tensor, torch.Tensor]] | None,
) -> torch.Tensor:
    """`[R, 1, D]`: the output of decoder layer `layer` at the one column `ids [R, 1]` (after
    `past`, `mask` up to that column) with `edits`, from `residual` (its slice at that column,
    or None for layer 0); the forward stops there (`StopAt` the block's `resid_post`)."""
    stop = StopAt("resid_post", layer)
    try:
        run_rows(
            model,
            ids,
            mask,
            [*edits, stop],
            start=layer,
            residual=None if residual is None else residual[:, :1],
            past=past,
        )
    except ForwardStopped:
        pass
    if stop.seen is None:  # pragma: no cover - the edit always fires on a decoder layer
        raise HeadsteerValueError(f"layer {layer} did not run")
    return stop.seen
