"""Clean-prefix reuse: start a forward pass at layer `l` from a cached residual stream.

A head in layer `l` cannot change anything computed below `l`, so when many variants ablate
or steer heads in layers >= l, the residual stream entering layer `l` is the same as in the
clean run. Scorers run the clean pass once (`hidden_states[l]` of a `transformers` forward with
`output_hidden_states=True`: the residual entering layer `l`), then evaluate each variant
from layer `l` up with `starting_at(model, l, residual)`.

Inside the context the decoder layers below `l` are not computed: layers `0 .. l-2` pass
their input through and layer `l-1` returns the cached residual. Embeddings, masks and
positional tables are still built by the model as usual (cheap), so the layers from `l` on
see exactly the inputs of a full run. Hooks on the skipped layers still fire, which keeps
`output_hidden_states` well formed (the entries below `l` are then meaningless).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from heads._util.validation import check_int
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel

__all__ = ["starting_at"]


@contextmanager
def starting_at(model: HeadModel, layer: int, residual: torch.Tensor | None) -> Iterator[None]:
    """Within the block, forward passes skip layers `< layer` and feed `residual` to `layer`.

    Args:
        model: the model.
        layer: first layer to compute, `0 .. n_layers - 1`; 0 runs the whole model (then
            `residual` is ignored and may be None).
        residual: `[batch, seq, d_model]`, the clean residual stream entering `layer`
            (`hidden_states[layer]`), already repeated to the batch of the forward to run.

    Raises:
        ValueError: `layer` out of range, or `residual` is not `[batch, seq, d_model]`.

    The model is restored on exit, also after an exception. Not re-entrant per model.
    """
    check_int("layer", layer, lo=0, hi=model.n_layers - 1)
    layer = int(layer)
    if layer == 0:
        yield
        return
    if not isinstance(residual, torch.Tensor) or residual.dim() != 3 or residual.shape[-1] != model.d_model:
        shape = tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
        raise HeadsteerValueError(f"residual must be [batch, seq, {model.d_model}], got {shape}")

    def passthrough(hidden_states, *args, **kwargs):
        return hidden_states

    def feed(hidden_states, *args, **kwargs):
        if hidden_states.shape != residual.shape:
            want, got = tuple(residual.shape), tuple(hidden_states.shape)
            raise HeadsteerValueError(f"cached residual {want} does not match the batch {got}")
        return residual.to(hidden_states.device, hidden_states.dtype)

    skipped = model.layers[:layer]
    # accelerate (device_map) may already have put a wrapped `forward` on the instance
    saved = [block.__dict__.get("forward") for block in skipped]
    for block in skipped[:-1]:
        block.forward = passthrough
    skipped[-1].forward = feed
    try:
        yield
    finally:
        for block, old in zip(skipped, saved, strict=True):
            if old is None:
                del block.forward  # the class method shows through again
            else:
                block.forward = old
