"""Head-specific visual modulation against hallucination: dual-stream token selection and
sensitivity-proportional amplification (docs/methods/visual_modulation.md). The paper's abstract
states the rule: hallucinations come from visual grounding that degrades in deeper layers; visual
tokens that are locally informative and spatially significant are selected (two streams); each
head's visual sensitivity is measured; attention to the selected tokens is amplified per head in
proportion to that sensitivity, throughout generation. No public code was found; each step below
is headsteer's reading of that rule.

For each sample, one batched probe prefill (VHR's, `steer.vhr.method.measure_vhd`: the prompt with
and without the image, unmodified model) gives, at the last prompt position:

* head sensitivity: VHD `[L, H]`, the distance of each head's output with and without the image
  (He et al. 2025); `s_{l,h} = VHD_{l,h} / max VHD` over the edited layers' heads (in [0, 1]);
* stream 1, *locally informative* tokens: the image tokens' input features (the residual entering
  layer 0) on the image's token grid; a token's score is the distance of its feature to the mean of
  its (up to 8) grid neighbours; the top `ceil(local_ratio * n)` are selected;
* stream 2, *spatially significant* tokens: the last prompt token's attention on the image (mean
  over heads and layers); the grid is cut into `regions x regions` blocks and each block's most
  attended token is selected (coverage of the image).

The selected set S is the union. In every edited layer and head, the attention logits of every text
query row after the image (prompt rows after the image span, and every decode row) get

    bias_{l,h}[j] = log(1 + gamma * s_{l,h})   for j in S,   0 elsewhere,

so the head's attention on a selected token is multiplied by `1 + gamma * s_{l,h}` before the
renormalisation of its row. Heads and tokens are chosen once per sample at prefill and kept for
every decode step (consistent with the KV cache). `gamma = 0` is a bitwise no-op.

Text variant: `target="text"` (or `"auto"` on a batch without images) uses the marked context
passage as the "image" (a one-row grid), as VAR and VHR do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from heads._util.validation import check_int, check_layer_list, check_number, short_repr
from heads.engine.edits import AttentionCall, LogitBias, ResidualRecorder
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.scorers.image_attention import collect, image_grid, query_recorders
from steer.noop import warn_noop
from steer.span_rows import warn_rows_without_span
from steer.vhr.method import WithoutImage, _check_without, measure_vhd

__all__ = [
    "ModulationBias",
    "TokenSelection",
    "VisualModulation",
    "default_modulation_layers",
    "local_scores",
    "select_tokens",
]

Target = Literal["auto", "image", "text"]

MAX_GAMMA = 1e3
"""Largest `gamma`: log(1 + 1e3) ~ 6.9 nats on the selected logits."""


def default_modulation_layers(n_layers: int) -> list[int]:
    """The deeper half (`n_layers // 2 ..`), where the paper locates the loss of visual grounding."""
    return list(range(n_layers // 2, n_layers))


def local_scores(features: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """`[n]` stream-1 score: `|| x_j - mean of x over j's grid neighbours ||_2` for features `[n, D]`
    laid row-major on `grid` (up to 8 neighbours, fewer at the borders; 0 for a single token)."""
    rows, cols = grid
    x = features.float().reshape(rows, cols, -1)
    total = torch.zeros_like(x)
    count = torch.zeros(rows, cols, 1)
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            if dy == 0 and dx == 0:
                continue
            ys = slice(max(0, -dy), rows - max(0, dy))
            xs = slice(max(0, -dx), cols - max(0, dx))
            yd = slice(max(0, dy), rows - max(0, -dy))
            xd = slice(max(0, dx), cols - max(0, -dx))
            total[ys, xs] += x[yd, xd]
            count[ys, xs] += 1
    has = count > 0
    mean = torch.where(has, total / count.clamp(min=1), x)
    out: torch.Tensor = (x - mean).norm(dim=-1).flatten()
    return out


def _blocks(n: int, k: int) -> list[range]:
    k = max(1, min(k, n))
    edges = [round(i * n / k) for i in range(k + 1)]
    return [range(edges[i], edges[i + 1]) for i in range(k)]


@dataclass
class TokenSelection:
    """The dual-stream selection of one span (image or passage) of one sample.

    Attributes:
        span: `(t0, t1)` token columns; grid: `(rows, cols)`.
        local_score: `[n]` stream-1 scores; attention: `[n]` stream-2 attention (head/layer mean).
        local: `[n]` bool, the local stream's tokens.
        spatial: `[n]` bool, the spatial stream's tokens.
        selected: `[n]` bool, their union.
    """

    span: tuple[int, int]
    grid: tuple[int, int]
    local_score: torch.Tensor
    attention: torch.Tensor
    local: torch.Tensor
    spatial: torch.Tensor

    @property
    def selected(self) -> torch.Tensor:
        return self.local | self.spatial


def select_tokens(
    features: torch.Tensor, attention: torch.Tensor, grid: tuple[int, int], local_ratio: float, regions: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both streams on one span (module docstring): `(local_score [n], local [n] bool, spatial [n] bool)`.
    Ties go to the lower token index."""
    n = features.shape[0]
    score = local_scores(features, grid)
    k = max(1, math.ceil(local_ratio * n))
    order = torch.argsort(-score, stable=True)[:k]
    local = torch.zeros(n, dtype=torch.bool)
    local[order] = True
    rows, cols = grid
    att = attention.float().reshape(rows, cols)
    spatial = torch.zeros(rows, cols, dtype=torch.bool)
    for ry in _blocks(rows, regions):
        for rx in _blocks(cols, regions):
            block = att[ry.start : ry.stop, rx.start : rx.stop]
            i = int(torch.argmax(block.flatten()))  # the first maximum
            spatial[ry.start + i // block.shape[1], rx.start + i % block.shape[1]] = True
    return score, local, spatial.flatten()


@dataclass(eq=False, repr=False)
class ModulationBias(LogitBias):
    """`log(1 + gamma s_{l,h})` on the selected key columns of the text rows after the span.

    Attributes:
        factor: `[B, H]` fp32 log-factor per batch row and query head (0 = unchanged).
        columns: `[B, P]` bool selected prompt columns.
        start: `[B]` long, the first query position edited (the end of the row's last span).
    """

    factor: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))
    columns: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.bool))
    start: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    per_column: ClassVar[bool] = False

    def is_identity(self) -> bool:
        return not bool((self.factor != 0).any()) or not bool(self.columns.any())

    def bias(self, call: AttentionCall) -> torch.Tensor:
        dev = call.device
        p = min(self.columns.shape[1], call.k_len)
        cols = torch.zeros(call.batch, call.k_len, dtype=torch.bool, device=dev)
        cols[:, :p] = self.columns[:, :p].to(dev)
        q = torch.arange(call.q_offset, call.q_offset + call.q_len, device=dev)
        rows = q[None, :] >= self.start.to(dev)[:, None]  # [B, Q]
        f = self.factor.to(dev, torch.float32)[:, :, None, None]  # [B, H, 1, 1]
        on = rows[:, None, :, None] & cols[:, None, None, :]  # [B, 1, Q, K]
        return torch.where(on, f, 0.0)


@dataclass(frozen=True)
class VisualModulation:
    """Head-specific visual modulation (module docstring).

    Args:
        gamma: amplification strength >= 0 (default 1: the most sensitive head's attention on a
            selected token doubles before renormalisation); 0 is a bitwise no-op (warns).
        layers: edited layers (default the deeper half).
        local_ratio: share of the span's tokens stream 1 selects, in (0, 1] (default 0.1).
        regions: blocks per grid side for stream 2, 1..64 (default 2: four blocks on a square
            grid); at most: a grid side of fewer tokens gets one block per token.
        attention_layers: layers whose attention stream 2 averages (default all).
        target: `"image"`, `"text"` (the marked passage) or `"auto"` (default).
        without_image: how the probe's second row drops the span: `"delete"` (default) or `"mask"`
            (as `Vhr`).

    After `edits`, `last` holds `"selection"` (per sample, per span: `TokenSelection`),
    `"sensitivity"` (`[B, L, H]`, NaN outside the edited layers) and `"vhd"` (`[B, L, H]`).

    Raises:
        TypeError / ValueError: a bad value (at construction); when applied, no span of `target`
            in the batch, a layer outside the model.
    """

    gamma: float = 1.0
    layers: tuple[int, ...] | None = None
    local_ratio: float = 0.1
    regions: int = 2
    attention_layers: tuple[int, ...] | None = None
    target: Target = "auto"
    without_image: WithoutImage = "delete"
    last: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_number("gamma", self.gamma, lo=0, hi=MAX_GAMMA)
        check_number("local_ratio", self.local_ratio, lo=0, hi=1, lo_open=True)
        check_int("regions", self.regions, lo=1, hi=64)
        for name in ("layers", "attention_layers"):
            v = getattr(self, name)
            if v is not None:
                check_layer_list(name, v)
                if any(int(x) < 0 for x in v):
                    raise HeadsteerValueError(f"{name} must be >= 0, got {short_repr(v)}")
                object.__setattr__(self, name, tuple(int(x) for x in v))
        if self.target not in ("auto", "image", "text"):
            raise HeadsteerValueError(
                f"unknown target {short_repr(self.target)}: use 'auto', 'image' or 'text'"
            )
        _check_without(self.without_image)
        if self.gamma == 0:
            warn_noop("VisualModulation gamma=0 is a no-op: output equals the unsteered model", stacklevel=4)

    def target_layers(self, model: HeadModel) -> list[int]:
        """The edited layers for `model`, checked."""
        layers = default_modulation_layers(model.n_layers) if self.layers is None else list(self.layers)
        for la in [*layers, *(self.attention_layers or ())]:
            model.check_head(la, 0)
        return sorted(set(layers))

    def spans(self, enc: EncodedPrompts) -> list[list[tuple[int, int]]]:
        """Per row, the spans modulated (see `target`)."""
        return enc.select_spans(self.target)

    @torch.no_grad()
    def probe(self, model: HeadModel, enc: EncodedPrompts) -> tuple[list[list[TokenSelection]], torch.Tensor]:
        """One batched probe prefill: the token selection per sample and span, and VHD `[B, L, H]`.

        Raises:
            ValueError: no span of `target` in the batch, a bad layer.
        """
        spans = self.spans(enc)
        if not any(spans):
            raise HeadsteerValueError(
                "VisualModulation needs an image or a marked context passage (**...** / emphasize=)"
            )
        self.target_layers(model)
        att_layers = None if self.attention_layers is None else list(self.attention_layers)
        recs = query_recorders(model.n_layers, enc.length - 1, att_layers)
        feats = ResidualRecorder(layer=0)
        vhd, _ = measure_vhd(model, enc, spans, self.without_image, extra=[*recs, feats])
        att = collect(recs, model.n_layers, 2 * enc.batch, enc.length)[: enc.batch]  # with-span rows
        x = feats.records[0][: enc.batch].float().cpu()  # [B, P, D] entering layer 0
        image = self.target == "image" or (self.target == "auto" and any(enc.image_spans))
        out: list[list[TokenSelection]] = []
        for b, row in enumerate(spans):
            per = []
            for i, (t0, t1) in enumerate(row):
                n = t1 - t0
                grid = image_grid(model, enc, b, i, n) if image else (1, n)
                a = att[b, :, t0:t1]
                a = a[~torch.isnan(a).any(-1)].mean(0)
                score, local, spatial = select_tokens(x[b, t0:t1], a, grid, self.local_ratio, self.regions)
                per.append(TokenSelection((t0, t1), grid, score, a, local, spatial))
            out.append(per)
        return out, vhd

    @staticmethod
    def sensitivity(vhd: torch.Tensor, layers: list[int]) -> torch.Tensor:
        """`[B, L, H]` head sensitivity `VHD / max VHD` over `layers`' heads per sample (NaN in the
        other layers; 0 where every VHD is 0)."""
        sub = vhd[:, layers]  # [B, L', H]
        top = sub.flatten(1).amax(-1)[:, None, None]
        sens = torch.full_like(vhd, float("nan"))
        sens[:, layers] = torch.where(top > 0, sub / top.clamp(min=1e-30), 0.0)
        return sens

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[ModulationBias]:
        """Probe the batch and return one `ModulationBias` per edited layer (module docstring).

        A prompt without a span is left unsteered (`UnsteeredRowsWarning`).
        """
        layers = self.target_layers(model)
        if self.gamma == 0:
            return []
        warn_rows_without_span(enc, "VisualModulation", spans=self.spans(enc))
        selection, vhd = self.probe(model, enc)
        cols = torch.zeros(enc.batch, enc.length, dtype=torch.bool)
        start = torch.full((enc.batch,), enc.length, dtype=torch.long)
        for b, per in enumerate(selection):
            for sel in per:
                t0, t1 = sel.span
                cols[b, t0:t1] |= sel.selected
                start[b] = t1 if start[b] == enc.length else max(int(start[b]), t1)
        sens = self.sensitivity(vhd, layers)
        self.last.update({"selection": selection, "sensitivity": sens, "vhd": vhd})
        out = []
        for la in layers:
            factor = torch.log1p(self.gamma * sens[:, la]).float()  # [B, H]
            out.append(ModulationBias(layer=la, factor=factor, columns=cols, start=start))
        return out
