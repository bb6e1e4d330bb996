"""The model's output function (final normed state -> logits) and the row forward's column-only
unembedding.

`output_logits(model, normed)` is everything a causal LM does after its final norm: the
unembedding, then, where the family has them (`heads.model.families.Family`), a constant logit
scale (Cohere's `logit_scale`, Granite's `logits_scaling`; MiniCPM3 divides the normed state
before the unembedding) and the output soft-cap `c * tanh(logits / c)` (Gemma 2 / 3, NanoChat).
The logit lens reads every layer through it, and the tests check on every family that it gives
the model's own output.

`unembed_columns(model, columns)`: within the block the calling thread's row forwards
(`heads.engine.variants.run_rows`) compute only the vocabulary `columns` of the last position's
logits, from the final normed state, and fill the others with NaN: for a metric that reads a few
tokens (the logit difference) the unembedding costs `K / V` of the full one. The model's own LM
head is not run (`logits_to_keep` selects no position) and nothing on the model changes; other
threads are not affected (a `ContextVar`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:  # pragma: no cover
    from heads.model.adapter import HeadModel

__all__ = ["column_logits", "logit_transform", "output_logits", "unembed_columns", "wanted_columns"]

_COLUMNS: ContextVar[torch.Tensor | None] = ContextVar("headsteer_unembed_columns", default=None)


def _config(model: HeadModel) -> Any:
    cfg = model.model.config
    return getattr(cfg, "text_config", None) or cfg


def logit_transform(model: HeadModel) -> tuple[float, bool, float | None]:
    """`(scale, before_unembed, cap)`: the constant the model multiplies its output logits by (1 if
    none), whether it is applied to the normed state before the unembedding (MiniCPM3) rather
    than to the logits, and the output soft-cap (None if none)."""
    fam, cfg = model.family, _config(model)
    scale, before = 1.0, False
    if fam.logit_scale is not None:
        field, op = fam.logit_scale
        value = float(getattr(cfg, field))
        scale, before = (value if op == "mul" else 1.0 / value), op == "div_hidden"
    cap = getattr(cfg, fam.final_softcap, None) if fam.final_softcap is not None else None
    return scale, before, (float(cap) if cap else None)


def output_logits(
    model: HeadModel, normed: torch.Tensor, columns: torch.Tensor | None = None
) -> torch.Tensor:
    """The model's own output logits from final-normed states `normed [..., D]`: `[..., V]`, or
    `[..., K]` for the vocabulary `columns` `[K]` only (the same dot products as the full head),
    in the model's dtype (see the module docstring)."""
    scale, before, cap = logit_transform(model)
    x = normed * scale if before and scale != 1.0 else normed
    head = model.unembed
    if columns is None:
        logits = cast(torch.Tensor, head(x))
    else:
        weight = cast(torch.Tensor, head.weight)
        cols = columns.to(weight.device)
        bias = getattr(head, "bias", None)
        b = None if bias is None else bias[cols].to(x.dtype)
        logits = torch.nn.functional.linear(x.to(weight.device), weight[cols].to(x.dtype), b)
    if not before and scale != 1.0:
        logits = logits * scale
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def wanted_columns(model: HeadModel) -> torch.Tensor | None:
    """The columns `unembed_columns` set for this thread's row forwards on `model`, or None."""
    return _COLUMNS.get()


@contextmanager
def unembed_columns(model: HeadModel, columns: torch.Tensor | None) -> Iterator[None]:
    """Within the block, this thread's row forwards compute only `columns` (`[K]` long) of the
    last position's logits; the others are NaN (module docstring). A no-op for `columns=None`, a
    backend other than Hugging Face (its output's last hidden state is not always the normed
    one), an LM head that is not a plain `nn.Linear`, or more than half the vocabulary."""
    head = model.unembed
    if (
        columns is None
        or model.backend.kind != "hf"
        or type(head) is not torch.nn.Linear
        or columns.numel() * 2 > head.out_features
    ):
        yield
        return
    token = _COLUMNS.set(columns)
    try:
        yield
    finally:
        _COLUMNS.reset(token)


def column_logits(model: HeadModel, normed_last: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """`[R, 1, V]` logits of the final normed states `normed_last [R, 1, D]` with only `columns`
    computed (NaN elsewhere), as a row forward returns them under `unembed_columns`."""
    part = output_logits(model, normed_last, columns)
    out = part.new_full((*part.shape[:-1], model.d_vocab), math.nan)
    out[..., columns.to(out.device)] = part
    return out
