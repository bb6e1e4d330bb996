"""The training data of the Attention Lens (`heads.scorers.roles.lens`): the chosen heads'
outputs `o_h(t) = z_h(t) W_O^h` at every real position of a corpus and the model's own
next-token logits there (`collect_lens_data`, recorded by a head-output edit in the engine)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from heads._util.validation import (
    check_int,
)
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, HeadOutputEdit
from heads.engine.forward import forward
from heads.engine.options import SweepOptions, sweep_rows
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import encode_prompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadSet, HeadSpec

__all__ = ["LensData", "collect_lens_data"]


class _Z(HeadOutputEdit):
    """Records the chosen heads' outputs z `[B, T, n, d]` (returns z unchanged)."""

    def __init__(self, layer: int, heads: list[int]):
        super().__init__(layer=layer)
        self.want = heads
        self.z: list[torch.Tensor] = []

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        self.z.append(z[:, :, self.want].detach().float())
        return z


@dataclass
class LensData:
    """Training material of a lens: head outputs and the model's next-token logits.

    Attributes:
        heads: the `(layer, head)` pairs, in order.
        outputs: `[n_heads, N, D]` fp32 head contributions o_h at N real positions.
        target_logits: `[N, V]` fp16 model logits at those positions.
        text_index: `[N]` long, the corpus text of each position (for the split).
        token_ids: `[N]` long, the token at each position.
    """

    heads: list[tuple[int, int]]
    outputs: torch.Tensor
    target_logits: torch.Tensor
    text_index: torch.Tensor
    token_ids: torch.Tensor


def _texts(texts: object) -> list[str]:
    if isinstance(texts, str):
        texts = [texts]
    if (
        not isinstance(texts, Sequence)
        or not texts
        or not all(isinstance(t, str) and t.strip() for t in texts)
    ):
        raise HeadsteerValueError("texts must be a non-empty list of non-empty strings")
    return list(texts)


def _heads(model: HeadModel, heads: HeadSpec | None) -> list[tuple[int, int]]:
    if heads is None:
        return [(la, h) for la in range(model.n_layers) for h in range(model.n_heads)]
    hs = list(HeadSet.parse(heads, model.n_layers, model.n_heads))
    if not hs:
        raise HeadsteerValueError("no heads to train a lens for")
    return hs


@torch.no_grad()
def collect_lens_data(
    model: HeadModel,
    texts: Sequence[str],
    heads: HeadSpec | None = None,
    *,
    max_positions: int = 4096,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> LensData:
    """Head outputs and model logits on `texts` (plain, no chat template), real positions only,
    at most `max_positions` (the first ones, in text order).

    Args:
        texts: a text or a non-empty list of non-empty texts.
        heads: a head selection (`HeadSet.parse`; default every head).
        max_positions: positions kept (a positive int, default 4096).
        options: `heads.SweepOptions`; `max_rows`: texts per forward (default 8 where
            `max_rows` is left at its default), fewer where `max_memory` needs it (the
            `"logits"` plan, the kept outputs and fp16 logits of `max_positions` positions
            beside it; refused before any forward when one text does not fit).
        **deprecated: `batch_size=` (now `max_rows`) as a keyword (one release; a
            `DeprecationWarning`; refused together with `options.max_rows` set).

    Returns:
        `LensData`: outputs `[n, N, D]` fp32, target logits `[N, V]` fp16, N <= `max_positions`.

    Raises:
        HeadsteerValueError: empty texts, unknown heads, a model without a tokenizer, bad
            `max_positions` or `batch_size` (all before the first forward).
    """
    if model.tokenizer is None:
        raise HeadsteerValueError("collect_lens_data needs a HeadModel with a tokenizer")
    texts = _texts(texts)
    max_positions = check_int("max_positions", max_positions, lo=1)
    opts = sweep_rows(options, deprecated, "collect_lens_data", default=8, takes=("max_rows", "max_memory"))
    hs = _heads(model, heads)
    batch_size = opts.max_rows
    if opts.max_memory is not None:  # texts per forward within the budget, the kept data beside them
        longest = encode_prompts(model.tokenizer, texts, chat=False, markup=False).length
        kept = max_positions * (len(hs) * model.d_model * 4 + model.d_vocab * 2 + 16)
        batch_size = opts.within(model, longest, "logits", reserve=kept).max_rows
    by_layer: dict[int, list[int]] = {}
    for la, h in hs:
        by_layer.setdefault(la, []).append(h)
    outs, logits, tidx, toks = [], [], [], []
    n = 0
    for start in range(0, len(texts), batch_size):
        if n >= max_positions:
            break
        chunk = texts[start : start + batch_size]
        enc = encode_prompts(model.tokenizer, chunk, chat=False, markup=False)
        recs = {la: _Z(la, h) for la, h in by_layer.items()}
        with editing(model, list(recs.values())):
            lg = forward(model, enc)  # [B, T, V]
        real = enc.attention_mask.bool()
        per_head = []
        for la, h in hs:
            z = recs[la].z[0][:, :, recs[la].want.index(h)]  # [B, T, d]
            w_o = model.layer_weights(la)["W_O"][h].float()  # [d, D]
            per_head.append((z.to(w_o.device) @ w_o)[real.to(w_o.device)].cpu())  # [n, D]
        outs.append(torch.stack(per_head))
        logits.append(lg[real.to(lg.device)].to(torch.float16).cpu())
        tidx.append(torch.arange(start, start + len(chunk))[:, None].expand_as(real)[real])
        toks.append(enc.input_ids[real])
        n += int(real.sum())
    o = torch.cat(outs, 1)[:, :max_positions]
    return LensData(
        hs,
        o,
        torch.cat(logits)[:max_positions],
        torch.cat(tidx)[:max_positions],
        torch.cat(toks)[:max_positions],
    )


def _check_data(model: HeadModel, data: object, heads: list[tuple[int, int]]) -> None:
    """`data` must be `LensData` of this model's width and vocabulary holding `heads`."""
    if not isinstance(data, LensData):
        raise HeadsteerTypeError(f"data must be LensData (collect_lens_data), got {type(data).__name__}")
    missing = [h for h in heads if h not in data.heads]
    if missing:
        raise HeadsteerValueError(f"the LensData lacks heads {missing}")
    o, t = data.outputs, data.target_logits
    n_pos = t.shape[0] if isinstance(t, torch.Tensor) and t.ndim == 2 else -1
    if (
        not isinstance(o, torch.Tensor)
        or o.ndim != 3
        or tuple(o.shape[::2]) != (len(data.heads), model.d_model)
        or n_pos != o.shape[1]
        or t.shape[1] != model.d_vocab
        or not isinstance(data.text_index, torch.Tensor)
        or tuple(data.text_index.shape) != (n_pos,)
    ):
        raise HeadsteerValueError(
            f"the LensData does not fit this model: outputs {tuple(getattr(o, 'shape', ()))}, target logits "
            f"{tuple(getattr(t, 'shape', ()))}; want [{len(data.heads)}, N, {model.d_model}] and "
            f"[N, {model.d_vocab}]"
        )
