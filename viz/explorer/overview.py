"""A long prompt's attention patterns as a navigable overview, never a full `[T, T]` transfer.

For a prompt of more than `MAX_PATTERN_TOKENS` tokens (the app's `full_pattern_tokens`) the
explorer's pattern view shows, per (layer, head), a summary computed in one forward
(`record_overview`) from the engine's pattern readers (one `Recorder` per layer, every query
block reduced as it comes: no `[H, T, T]` is kept, memory stays linear in `T`):

- `grid_mean` / `grid_max` `[L, H, G, G]`: the pattern pooled into square blocks of `block`
  tokens (`block = ceil(T / OVERVIEW_GRID)`, `G = ceil(T / block) <= OVERVIEW_GRID`). Block
  `(i, j)` covers query rows `i*block .. (i+1)*block - 1` and key columns `j*block ..`, cut at
  `T` (the last block may be smaller); `grid_mean` is the mean of its cells (the causally
  masked cells count, as 0), `grid_max` the largest cell.
- `col_mass` `[L, H, T]`: the attention each key receives, summed over every query row
  (units: rows; a sink token receives up to `T - j`).
- `row_entropy` `[L, H, T]`: each query row's entropy in nats (`-sum p log p`, `0 log 0 = 0`).
- `row_max` `[L, H, T]`: each query row's largest probability.

The same forward (the engine's `run_rows`) keeps the residual stream entering the layers
(every `stride`-th layer's within `OVERVIEW_RESIDUAL_BYTES`) and every layer's keys and values,
so that `pattern_window` computes an exact window `[q1 - q0, k1 - k0]` of one head's pattern by
running only the window's positions from the nearest kept layer, the earlier positions' keys
and values as a cache, with one `Recorder(query_range=(q0, q1))`, and stopping the forward once
those rows are read: a few hundred rows of one layer, not a forward.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Recorder
from heads.engine.forward import forward
from heads.engine.variants import run_rows
from heads.inputs.prompts import EncodedPrompts
from heads.inputs.tokens import readable_tokens
from heads.model.adapter import HeadModel
from viz.explorer.limits import OVERVIEW_GRID, OVERVIEW_RESIDUAL_BYTES
from viz.explorer.patterns import Stopped

__all__ = ["Overview", "block_size", "pattern_window", "pool_pattern", "record_overview", "significant"]

_POW10 = torch.tensor([10.0**i for i in range(23)], dtype=torch.float64)  # exact in float64


def significant(x: torch.Tensor, digits: int = 4) -> list:
    """`x` as nested lists of floats rounded to `digits` significant digits, for JSON (a few
    characters each: the rounding divides by an exact power of ten, so each float's shortest
    repr is its rounded decimal); magnitudes below 1e-9 are sent as 0."""
    v = x.double()
    a = v.abs()
    keep = a >= 1e-9
    k = (digits - 1 - torch.floor(torch.log10(torch.where(keep, a, 1.0)))).long()  # decimals to keep
    up = _POW10[k.clamp(0, 22)]
    down = _POW10[(-k).clamp(0, 22)]
    out = torch.where(k >= 0, torch.round(v * up) / up, torch.round(v / down) * down)
    return torch.where(keep, out, 0.0).tolist()


class _Read(Exception):
    """Raised by the window's recorder once its last row is read: the forward stops there."""


def block_size(n_tokens: int, grid: int = OVERVIEW_GRID) -> int:
    """Tokens per side of an overview block: `ceil(n_tokens / grid)` (at least 1)."""
    return max(1, math.ceil(n_tokens / grid))


def pool_pattern(probs: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A full pattern `[..., T, T]` pooled into `block x block` blocks (the last ones cut at `T`):
    `(mean, max)`, each `[..., G, G]`, `G = ceil(T / block)`. The reference the overview equals;
    it holds the whole pattern, so it is for short prompts and tests."""
    t = probs.shape[-1]
    g = math.ceil(t / block)
    pad = g * block - t
    x = torch.nn.functional.pad(probs.float(), (0, pad, 0, pad))
    x = x.reshape(*probs.shape[:-2], g, block, g, block)
    sizes = torch.full((g,), block, dtype=torch.float32)
    sizes[-1] = t - (g - 1) * block
    mean = x.sum((-3, -1)) / (sizes[:, None] * sizes[None, :])
    top = x.amax((-3, -1))  # padding is 0, never above a probability
    return mean, top


@dataclass
class Overview:
    """One prompt's pattern overview (module docstring), all heads, fp32 on the CPU.

    Attributes:
        grid_mean: `[L, H, G, G]` block mean of each pattern.
        grid_max: `[L, H, G, G]` block max of each pattern.
        col_mass: `[L, H, T]` attention received per key, summed over query rows.
        row_entropy: `[L, H, T]` entropy of each query row (nats).
        row_max: `[L, H, T]` largest probability of each query row.
        block: tokens per block side.
        tokens: the `T` tokens as readable text.
        spans: the `**…**` token ranges.
        residuals: `{layer: [1, T, D]}` the residual stream entering each kept layer (the
            model's dtype; layer 0 needs none: the embeddings are recomputed).
        enc: the encoded prompt (a window runs on it without encoding it again).
        kv: per layer the keys and values `[1, G, T, d]` of the prompt (Hugging Face backend),
            so a window runs only its query rows, the earlier positions' keys passed as a cache.
    """

    grid_mean: torch.Tensor
    grid_max: torch.Tensor
    col_mass: torch.Tensor
    row_entropy: torch.Tensor
    row_max: torch.Tensor
    block: int
    tokens: list[str]
    spans: list[tuple[int, int]]
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    enc: EncodedPrompts | None = None
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def nbytes(self) -> int:
        parts = [self.grid_mean, self.grid_max, self.col_mass, self.row_entropy, self.row_max]
        parts += list(self.residuals.values()) + [t for pair in self.kv or [] for t in pair]
        return sum(p.numel() * p.element_size() for p in parts)

    def start_layer(self, layer: int) -> int:
        """The layer a window of `layer` is computed from: the highest kept one `<= layer`, or 0."""
        kept = [la for la in self.residuals if la <= layer]
        return max(kept, default=0)


def residual_stride(n_layers: int, n_tokens: int, d_model: int, itemsize: int) -> int:
    """Keep the residual of every `stride`-th layer (from layer 1) within `OVERVIEW_RESIDUAL_BYTES`;
    0: not even one fits (a window then runs from layer 0)."""
    one = n_tokens * d_model * itemsize
    if n_layers < 2 or one > OVERVIEW_RESIDUAL_BYTES:
        return 0
    fit = OVERVIEW_RESIDUAL_BYTES // one  # how many layers' residuals fit
    return max(1, math.ceil((n_layers - 1) / fit))


class _Reducer:
    """The per-layer accumulators one `Recorder` fills block by block (`[H, ...]`, fp32).

    Block sums are one matrix product with the key-block indicator (`[T, G]`), block maxima a
    view of the whole blocks plus the cut last one (no padded copy of the rows)."""

    def __init__(self, n_heads: int, t: int, block: int, indicator: torch.Tensor):
        g = math.ceil(t / block)
        self.t, self.block, self.g = t, block, g
        self.whole = t // block  # key blocks of `block` tokens; a last cut one when g > whole
        self.indicator = indicator  # [T, G], shared by the layers
        self.sums = torch.zeros(n_heads, g, g)
        self.tops = torch.zeros(n_heads, g, g)
        self.col = torch.zeros(n_heads, t)
        self.ent = torch.zeros(n_heads, t)
        self.rmax = torch.zeros(n_heads, t)

    def __call__(self, probs: torch.Tensor, call: AttentionCall) -> None:
        p = probs[0].detach().float().cpu()  # [H, q, T]
        h, q, t = p.shape
        r0 = call.q_offset
        b, g, whole = self.block, self.g, self.whole
        self.col += p.sum(1)
        self.ent[:, r0 : r0 + q] = -torch.special.xlogy(p, p).sum(-1)
        self.rmax[:, r0 : r0 + q] = p.amax(-1)
        sums = (p.reshape(h * q, t) @ self.indicator).reshape(h, q, g)  # [H, q, G]
        tops = p[..., : whole * b].reshape(h, q, whole, b).amax(-1)
        if g > whole:
            tops = torch.cat([tops, p[..., whole * b :].amax(-1, keepdim=True)], dim=-1)
        bins = (torch.arange(r0, r0 + q) // b).expand(h, g, q).transpose(1, 2)  # [H, q, G]: row -> block
        self.sums.scatter_add_(1, bins, sums)
        self.tops.scatter_reduce_(1, bins, tops, reduce="amax")

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        sizes = self.indicator.sum(0)  # tokens per block
        return self.sums / (sizes[:, None] * sizes[None, :]), self.tops


def record_overview(
    model: HeadModel,
    enc: EncodedPrompts,
    *,
    grid: int = OVERVIEW_GRID,
    stop: threading.Event | None = None,
) -> Overview:
    """Every head's overview of the one prompt in `enc` from one forward (the model's own
    attention: the recorders only read), and the residuals `pattern_window` starts from.

    Args:
        enc: one prompt (`encode_prompts`), no padding.
        grid: at most this many blocks per side (default `OVERVIEW_GRID`).
        stop: once set, the forward stops at the next query block (`Stopped`).

    Raises:
        ValueError: a batch of more than one prompt; the prompt is longer than the model's
            positions.
        Stopped: `stop` was set.
    """
    if enc.batch != 1:
        raise ValueError(f"record_overview takes one prompt, got {enc.batch}")
    t, n_layers = enc.length, model.n_layers
    block = block_size(t, grid)
    g = math.ceil(t / block)
    indicator = (torch.arange(t)[:, None] // block == torch.arange(g)[None, :]).float()  # [T, G]
    reducers = [_Reducer(model.n_heads, t, block, indicator) for _ in range(n_layers)]

    def reader(red: _Reducer):  # type: ignore[no-untyped-def]
        def read(probs: torch.Tensor, call: AttentionCall) -> None:
            if stop is not None and stop.is_set():
                raise Stopped
            red(probs, call)

        return read

    recorders: list = [Recorder(layer=la, fn=reader(red)) for la, red in enumerate(reducers)]
    residuals: dict[int, torch.Tensor] = {}
    kv = None
    if model.backend.kind == "hf":  # the engine's row forward: residuals and keys / values kept
        itemsize = torch.empty((), dtype=model.dtype).element_size()
        stride = residual_stride(n_layers, t, model.d_model, itemsize)
        out = run_rows(model, enc.input_ids, enc.attention_mask, recorders, keep_cache=True)
        kept = range(1, n_layers, stride) if stride else range(0)
        residuals = {la: out.hidden_states[la].detach() for la in kept}  # enters layer la
        kv = [(layer.keys.detach(), layer.values.detach()) for layer in out.past_key_values.layers]
        del out
    else:  # other backends: windows run from layer 0 over the prompt
        with editing(model, recorders):
            forward(model, enc)
    pooled = [red.finish() for red in reducers]
    return Overview(
        grid_mean=torch.stack([m for m, _ in pooled]),
        grid_max=torch.stack([x for _, x in pooled]),
        col_mass=torch.stack([r.col for r in reducers]),
        row_entropy=torch.stack([r.ent for r in reducers]),
        row_max=torch.stack([r.rmax for r in reducers]),
        block=block,
        tokens=readable_tokens(model.tokenizer, enc.input_ids[0]),
        spans=list(enc.spans[0]),
        residuals=residuals,
        enc=enc,
        kv=kv,
    )


def pattern_window(
    model: HeadModel,
    enc: EncodedPrompts,
    layer: int,
    head: int,
    window: tuple[int, int, int, int],
    overview: Overview | None = None,
) -> torch.Tensor:
    """The exact window `probs[q0:q1, k0:k1]` of one head's pattern on the prompt of `enc`, fp32
    `[q1 - q0, k1 - k0]` (the model's own attention: the recorder only reads).

    With the `overview` of this prompt (Hugging Face backend) only the positions `q0 ..
    max(q1, k1) - 1` run, from the nearest layer at or below `layer` whose residual it kept
    (`heads.engine.variants.run_rows`: layer-prefix reuse), the keys and values of the earlier
    positions passed as a cache (position-prefix reuse), and the forward stops once the rows of
    `layer` are read (`Recorder(query_range=(q0, q1))`): a few hundred rows of a layer or two,
    not a forward. Without it, a forward over the prompt that stops at `layer`.

    Args:
        window: `(q0, q1, k0, k1)`, `0 <= q0 < q1 <= T`, `0 <= k0 < k1 <= T` (checked by the caller).
    """
    q0, q1, k0, k1 = window
    got: list[torch.Tensor] = []

    def read(probs: torch.Tensor, call: AttentionCall) -> None:
        got.append(probs[0, head, :, k0:k1].detach().float().cpu())
        if call.q_offset + call.q_len >= q1:
            raise _Read

    rec = Recorder(layer=layer, fn=read, query_range=(q0, q1))
    try:
        if overview is not None and overview.kv is not None:  # only rows q0..q1-1, from `start`
            # the rows run: q0 .. the last row or key asked (a key after the last row is still a
            # column of the run, whatever the model's mask makes of it)
            start, end = overview.start_layer(layer), max(q1, k1)
            # the engine places no pattern reader on a sliding-window layer fed a key cache: there
            # the window's rows run with every earlier position (still from the kept residual)
            first = q0 if model.sliding_window(layer) is None else 0
            residual = overview.residuals[start][:, first:end] if start else None
            # the cache takes a copy of what it is given: the real keys only for the layers that
            # run (and layer 0, whose length the model reads as the cache's), none above `layer`
            past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
            if first:
                past = [
                    (k[:, :, :first], v[:, :, :first])
                    if la == 0 or la >= start
                    else (k[:, :, :0], v[:, :, :0])
                    for la, (k, v) in enumerate(overview.kv[: layer + 1])
                ]
            ids, mask = enc.input_ids[:, first:end], enc.attention_mask[:, :end]
            run_rows(model, ids, mask, [rec], start=start, residual=residual, past=past)
        else:
            with editing(model, [rec]):
                forward(model, enc)
    except _Read:
        pass
    return torch.cat(got, dim=0)
