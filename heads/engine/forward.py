"""Running a model on an encoded batch (positions that ignore left padding)."""

from __future__ import annotations

from typing import Any

import torch

from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel

__all__ = ["forward"]


@torch.no_grad()
def forward(model: HeadModel, enc: EncodedPrompts, **kwargs: Any) -> Any:
    """Logits `[B, P, d_vocab]` of `model` on the left-padded batch `enc`.

    With extra keyword arguments (e.g. `output_hidden_states=True`) the model's
    whole output object is returned instead of the logits.

    Position ids are counted over real tokens, as `generate` does, so an example
    gives the same logits alone and inside a padded batch. Prompts with images
    also pass the processor's outputs (`enc.inputs`: `pixel_values`, ...) and,
    for M-RoPE models, `[3, B, P]` positions.

    Raises:
        ValueError: the batch is longer than the model's position limit.
    """
    model.check_length(enc.length)
    device = model.device
    out = model.run(**enc.model_inputs(device), use_cache=False, **kwargs)
    return out if kwargs else out.logits
