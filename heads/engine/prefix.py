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

Per thread: the backend places a dispatching wrapper on the skipped blocks
(`Backend.skip_placements`, reference-counted across contexts and threads like every hook) and
the skip itself is a `ContextVar` entry (`Backend.layer_skip`), so another thread running the
same model meanwhile, with another start layer or none, computes its own forward; the last
context to exit removes the wrappers (the model is then bitwise as before, also after an
exception).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from heads._util.validation import check_int
from heads.engine.state import acquire, release
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel

__all__ = ["attention_given", "starting_at"]


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

    The model is restored on exit, also after an exception. Per thread: other threads' forwards
    are not skipped (module docstring). Nested in one thread, the inner context's plan applies
    to the blocks it names.
    """
    check_int("layer", layer, lo=0, hi=model.n_layers - 1)
    layer = int(layer)
    if layer == 0:
        yield
        return
    if not isinstance(residual, torch.Tensor) or residual.dim() != 3 or residual.shape[-1] != model.d_model:
        shape = tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
        raise HeadsteerValueError(f"residual must be [batch, seq, {model.d_model}], got {shape}")

    backend = model.backend
    keys = acquire(backend.skip_placements(layer))  # shared, reference-counted dispatch wrappers
    try:
        with backend.layer_skip(layer, residual):
            yield
    finally:
        release(keys)


@contextmanager
def attention_given(model: HeadModel, outputs: dict[int, torch.Tensor]) -> Iterator[None]:
    """Within the block, this thread's forwards do not compute the attention of the layers in
    `outputs` (`{layer: [batch, seq, d_model]}`): each layer's attention module returns its tensor
    (as if every head were frozen to the run that produced it). Per thread, placed by the
    backend like `starting_at` (Hugging Face backend only; other backends: ValueError).

    Raises:
        ValueError: a backend without it, an unknown layer, or (at the forward) a tensor that
            does not match the batch.
    """
    backend: Any = model.backend
    if not hasattr(backend, "attention_placements") or backend.kind != "hf":
        raise HeadsteerValueError(
            f"attention_given runs on the Hugging Face backend only, not {backend.kind!r}"
        )
    for la in outputs:
        check_int("layer", la, lo=0, hi=model.n_layers - 1)
    keys = acquire(backend.attention_placements(sorted(outputs)))
    try:
        with backend.attention_replaced(outputs):
            yield
    finally:
        release(keys)
