"""Engine edits the patching sweeps share: read an activation and end the forward there (`StopAt`),
and replace a stream activation at chosen columns (`PatchStream`).

Both are `heads.engine.activations.ActivationEdit`s, so they run on every backend and act only on
the calling thread's forward (the engine's edits are per thread).
"""

from __future__ import annotations

from typing import cast

import torch

from heads.engine.activations import ActivationEdit
from heads.engine.edits import AttentionCall

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
