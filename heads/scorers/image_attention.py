"""Attention over the image tokens, per layer: the maps CARVE contrasts and the head-specific visual
modulation's spatial stream reads (docs/methods/carve.md, docs/methods/visual_modulation.md).

For one query row q of a sample with image span `[t0, t1)` (n image tokens) and layer l, the map is
the attention of row q on the image tokens, averaged over the query heads and renormalised over
the image:

    m_l[j] = mean_h A_{l,h}[q, t0 + j] / sum_k mean_h A_{l,h}[q, t0 + k]      (j = 0..n-1)

with `mass_l = sum_k mean_h A_{l,h}[q, t0 + k]` the share of the row's attention on the image.
Per layer:

* entropy: `H(m_l) / log(n)` in [0, 1] (0 = one token, 1 = uniform);
* convergence: the share of `m_l` on its top `ceil(0.1 n)` tokens (global scanning ~0.1, focused ~1).

`image_grid` lays the n tokens of a span on the image's patch grid (rows, cols): Qwen2-VL's
`image_grid_thw` after the spatial merge; a square side x side when n is a square; else one row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from heads._util.validation import check_layer_list
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Recorder
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel

__all__ = ["ImageAttention", "attention_entropy", "convergence", "image_attention", "image_grid"]


def image_grid(model: HeadModel, enc: EncodedPrompts, row: int, index: int, n: int) -> tuple[int, int]:
    """`(rows, cols)` of the `index`-th image span (n tokens) of batch row `row` (module docstring)."""
    thw = enc.inputs.get("image_grid_thw")
    merge = getattr(getattr(model.model.config, "vision_config", None), "spatial_merge_size", None)
    if thw is not None and merge:
        k = sum(len(r) for r in enc.image_spans[:row]) + index  # images are listed row by row
        if k < thw.shape[0]:
            t, h, w = (int(x) for x in thw[k])
            rows, cols = h // int(merge), w // int(merge)
            if t * rows * cols == n:
                return (t * rows, cols)
    side = math.isqrt(n)
    return (side, side) if side * side == n and n else (1, max(n, 1))


def attention_entropy(maps: torch.Tensor) -> torch.Tensor:
    """`H(m) / log(n)` of maps `[..., n]` that sum to 1 (0 for n = 1)."""
    n = maps.shape[-1]
    h = -(maps * torch.log(maps.clamp(min=1e-30))).sum(-1)
    return h / math.log(n) if n > 1 else torch.zeros_like(h)


def convergence(maps: torch.Tensor, top: float = 0.1) -> torch.Tensor:
    """The share of maps `[..., n]` (summing to 1) on their top `ceil(top * n)` tokens."""
    k = max(1, math.ceil(top * maps.shape[-1]))
    return maps.topk(k, dim=-1).values.sum(-1)


@dataclass
class ImageAttention:
    """The image attention of one image of one sample (module docstring).

    Attributes:
        maps: `[L, n]` per-layer map over the image tokens (head mean, renormalised; NaN rows in
            layers not read).
        mass: `[L]` share of the row's attention on the image (head mean).
        span: `(t0, t1)` image token columns in the padded batch.
        grid: `(rows, cols)` of the tokens on the image.
        query: the absolute query position read.
    """

    maps: torch.Tensor
    mass: torch.Tensor
    span: tuple[int, int]
    grid: tuple[int, int]
    query: int

    def __repr__(self) -> str:
        """One line: maps shape, image span and grid, query position (not the tensors)."""
        return (
            f"ImageAttention(maps={list(self.maps.shape)}, span={self.span}, grid={self.grid}, "
            f"query={self.query})"
        )

    @property
    def entropy(self) -> torch.Tensor:
        """`[L]` normalised entropy per layer."""
        return attention_entropy(self.maps)

    @property
    def convergence(self) -> torch.Tensor:
        """`[L]` top-10 % share per layer."""
        return convergence(self.maps)

    def mean_map(self, layers: list[int] | None = None) -> torch.Tensor:
        """`[n]` mean of the maps of `layers` (default all read), renormalised."""
        m = self.maps if layers is None else self.maps[layers]
        m = m[~torch.isnan(m).any(-1)]
        out = m.mean(0)
        return out / out.sum().clamp(min=1e-30)


def query_recorders(n_layers: int, query: int, layers: list[int] | None = None) -> list[Recorder]:
    """One `Recorder` per layer keeping the head-mean attention `[B, K]` of absolute query
    position `query` (the first call that holds that row)."""

    def read(probs: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
        r = query - call.q_offset
        if not 0 <= r < call.q_len:
            return None
        return probs[:, :, r, :].float().mean(1).detach().cpu()  # [B, K]

    return [Recorder(layer=la, fn=read) for la in (range(n_layers) if layers is None else layers)]


def collect(recs: list[Recorder], n_layers: int, batch: int, k_len: int) -> torch.Tensor:
    """`[B, L, K]` head-mean rows read by `query_recorders` (NaN in layers without a record)."""
    out = torch.full((batch, n_layers, k_len), float("nan"))
    for rec in recs:
        got = [r for r in rec.records if r is not None]
        if got:
            out[:, rec.layer, : got[0].shape[-1]] = got[0][:batch]
    return out


def maps_of(
    model: HeadModel, enc: EncodedPrompts, rows: torch.Tensor, query: int, spans: list[list[tuple[int, int]]]
) -> list[list[ImageAttention]]:
    """Per batch row, per span: the `ImageAttention` of `rows` `[B, L, K]` (the head-mean attention
    of `query`)."""
    out = []
    for b, row_spans in enumerate(spans):
        per = []
        for i, (t0, t1) in enumerate(row_spans):
            part = rows[b, :, t0:t1]
            mass = part.sum(-1)
            maps = part / mass[:, None].clamp(min=1e-30)
            per.append(ImageAttention(maps, mass, (t0, t1), image_grid(model, enc, b, i, t1 - t0), query))
        out.append(per)
    return out


@torch.no_grad()
def image_attention(
    model: HeadModel,
    enc: EncodedPrompts,
    *,
    layers: list[int] | None = None,
    target: str = "auto",
) -> list[list[ImageAttention]]:
    """Per batch row, per image (or marked passage with `target="text"`): the per-layer attention of
    the last prompt token on its tokens (module docstring), from one forward.

    Args:
        layers: layers to read (default all).
        target: `"image"`, `"text"` or `"auto"` (image spans if the batch has any, else the marked text).

    Raises:
        ValueError: no span of `target` in the batch, an unknown layer.
    """
    spans = enc.select_spans(target)
    if not any(spans):
        raise HeadsteerValueError("image_attention needs an image or a marked passage (**...**) in the batch")
    if layers is not None:
        check_layer_list("layers", layers)
        for la in layers:
            model.check_head(la, 0)
    model.check_length(enc.length)
    recs = query_recorders(model.n_layers, enc.length - 1, layers)
    with editing(model, recs):
        model.run(**enc.model_inputs(model.device), use_cache=False, logits_to_keep=1)
    rows = collect(recs, model.n_layers, enc.batch, enc.length)
    return maps_of(model, enc, rows, enc.length - 1, spans)
