"""Running a model on an encoded batch (positions that ignore left padding)."""

from __future__ import annotations

from typing import Any

import torch

from heads.engine.context import editing
from heads.engine.edits import Recorder
from heads.engine.state import KERNEL
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, position_ids
from heads.model.adapter import HeadModel

__all__ = ["forward", "run_last"]


@torch.no_grad()
def forward(model: HeadModel, enc: EncodedPrompts, **kwargs: Any) -> Any:
    """Logits `[B, P, d_vocab]` of `model` on the left-padded batch `enc`.

    With extra keyword arguments (e.g. `output_hidden_states=True`) the model's
    whole output object is returned instead of the logits.

    `output_attentions=True` gives every layer's pattern `[B, H, P, P]` (the model's dtype) in
    `out.attentions` on every backend and attention implementation, inside an `editing()`
    context or not: the patterns are read at the engine's `probs` site (one `Recorder` per
    layer, after any pattern edit of an enclosing context), so an SDPA model (whose own kernel
    returns none) and a TransformerLens or nnsight model give the same tuple. Rows of left
    padding are all zero. Inside `editing(..., kernel="fused")` it is a ValueError (that kernel
    never builds the pattern).

    Position ids are counted over real tokens, as `generate` does, so an example
    gives the same logits alone and inside a padded batch. Prompts with images
    also pass the processor's outputs (`enc.inputs`: `pixel_values`, ...) and,
    for M-RoPE models, `[3, B, P]` positions.

    Raises:
        ValueError: the batch is longer than the model's position limit; `output_attentions`
            with `kernel="fused"`.
    """
    model.check_length(enc.length)
    device = model.device
    if kwargs.get("output_attentions"):
        if KERNEL.get() == "fused":
            raise HeadsteerValueError(
                "kernel='fused' never builds the attention pattern, so it cannot return it "
                "(output_attentions=True); use kernel='auto' or 'blocked'"
            )
        kwargs = {k: v for k, v in kwargs.items() if k != "output_attentions"}
        recs = [Recorder(layer=la) for la in range(model.n_layers)]
        with editing(model, recs):
            out = model.run(**enc.model_inputs(device), use_cache=False, **kwargs)
        dtype = model.dtype
        out.attentions = tuple(torch.cat(r.records, dim=2).to(dtype) for r in recs)  # query blocks joined
        return out
    out = model.run(**enc.model_inputs(device), use_cache=False, **kwargs)
    return out if kwargs else out.logits


def run_last(model: HeadModel, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    """`model.run` on left-padded `ids` / `mask` `[B, T]` with positions counted over real tokens,
    no KV cache and the last position's logits only (`logits_to_keep=1`): the forward the
    analyses run to read or edit engine sites (the model's output object)."""
    dev = model.device
    return model.run(
        input_ids=ids.to(dev),
        attention_mask=mask.to(dev),
        position_ids=position_ids(mask).to(dev),
        use_cache=False,
        logits_to_keep=1,
    )
