"""AdaptVis and ScalingVis: a temperature on the attention to the image, set by the model's
confidence (Chen, Zhu, Lu, Li, Sun and Chen, "Why Is Spatial Reasoning Hard for VLMs? An Attention
Mechanism Perspective on Focus Areas", ICML 2025, arXiv:2503.01773; reference code
`shiqichen17/AdaptVis`; docs/methods/adaptvis.md).

Rule. In every edited layer and head, the raw attention logits `S = q k^T / sqrt(d)` of the *last
prompt token* on the image keys I are multiplied by a weight alpha before the mask and the softmax:

    S'_{P-1, j} = alpha * S_{P-1, j}   for j in I,   every other logit unchanged.

alpha > 1 sharpens the attention inside the image (a lower temperature), alpha < 1 flattens it.
Only the prefill is edited (the reference edits a layer's logits only when they are square, i.e.
the uncached prompt pass) and only its last query row; decoding steps read the changed keys and
values of that row through the cache.

ScalingVis applies one fixed alpha. AdaptVis first runs the unsteered prompt and takes the
confidence c = max_v softmax(logits of the first generated token)_v of each prompt; c < threshold
picks `weight1` (the reference's example 0.5: flatten when unsure), else `weight2` (1.5: sharpen
when confident).

As a logit edit `S' = S + (alpha - 1) S 1[row P-1, j in I]`: a bias that is a function of the logits
(`LogitBias.reads_scores`), so it runs on the blocked kernel.

Text variant: `target="text"` (or `"auto"` on a text-only batch) scales the logits on the
emphasized context passage (`**...**` / `emphasize=`) instead of the image, as VAR and VHR do.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from heads._util.validation import is_number, short_repr
from heads.engine.edits import AttentionCall, LogitBias
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from steer.noop import warn_noop
from steer.span_rows import warn_rows_without_span

__all__ = ["AdaptVis", "AdaptVisScale", "ScalingVis", "first_token_confidence"]

Target = Literal["auto", "image", "text"]

MAX_WEIGHT = 100.0
"""Largest accepted alpha: beyond it the scaled logits overflow fp16 for ordinary models."""

DEFAULT_SCALING_WEIGHT = 0.8
"""`ScalingVis.weight` default: the reference's `run.sh` example (`--method scaling_vis --weight 0.8`)."""
DEFAULT_WEIGHT1, DEFAULT_WEIGHT2, DEFAULT_THRESHOLD = 0.5, 1.5, 0.4
"""`AdaptVis` defaults: the reference's `run.sh` example (`--weight1 0.5 --weight2 1.5 --threshold 0.4`)."""


def _weight(name: str, x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise HeadsteerTypeError(f"{name} must be a number, got {short_repr(x)}")
    if not is_number(x) or not math.isfinite(x) or not 0 <= x <= MAX_WEIGHT:  # 10**400: no float
        raise HeadsteerValueError(f"{name} must be in [0, {MAX_WEIGHT:g}], got {short_repr(x)}")
    return float(x)


def _layers(name: str, layers: object) -> tuple[int, ...] | None:
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple, range)) or not layers:
        raise HeadsteerValueError(
            f"{name} layers must be a non-empty list of layer indices, got {short_repr(layers)}"
        )
    if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in layers):
        raise HeadsteerTypeError(f"{name} layers must be ints, got {short_repr(layers)}")
    return tuple(int(x) for x in layers)


@dataclass(eq=False, repr=False)
class AdaptVisScale(LogitBias):
    """Multiply the logits of query position `row` on the `region` keys by `weight` (per batch row).

    Attributes:
        region: `[B, P]` bool, the image (or context) key columns of each batch row.
        weight: `[B]` fp32 alpha per batch row (1 = unchanged).
        row: the absolute query position edited (the last prompt position P - 1).
    """

    reads_scores: ClassVar[bool] = True
    region: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.bool))
    weight: torch.Tensor = field(default_factory=lambda: torch.ones(0))
    row: int = 0

    def is_identity(self) -> bool:
        return bool((self.weight == 1).all()) or not bool(self.region.any())

    def bias(self, call: AttentionCall) -> torch.Tensor:
        raise NotImplementedError("AdaptVisScale is a function of the logits: see score_bias")

    def score_bias(self, scores: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """`(alpha_b - 1) * S` on row `row`'s region columns, 0 elsewhere (`[B, 1, q_len, k_len]`)."""
        r = self.row - call.q_offset
        out = torch.zeros(call.batch, 1, call.q_len, call.k_len, device=call.device)
        if not 0 <= r < call.q_len:  # decoding, or a query block without the last prompt row
            return out
        p = min(self.region.shape[1], call.k_len)
        cols = torch.zeros(call.batch, call.k_len, dtype=torch.bool, device=call.device)
        cols[:, :p] = self.region[:, :p].to(call.device)
        w = (self.weight.to(call.device, torch.float32) - 1)[:, None, None]  # [B, 1, 1]
        s = scores[:, :, r, :].float()  # [B, H, K]
        out = out.expand(call.batch, scores.shape[1], call.q_len, call.k_len).clone()
        out[:, :, r, :] = torch.where(cols[:, None, :], w * s, 0.0)
        return out


def _region(enc: EncodedPrompts, target: Target, method: str) -> torch.Tensor:
    spans = enc.select_spans(target)
    if not any(spans):
        raise HeadsteerValueError(
            f"{method} needs an image or a marked context passage (**...** / emphasize=), "
            f"target={short_repr(target)}"
        )
    warn_rows_without_span(enc, method, spans=spans, stacklevel=4)
    region = torch.zeros(enc.batch, enc.length, dtype=torch.bool)
    for b, row in enumerate(spans):
        for t0, t1 in row:
            region[b, t0:t1] = True
    return region


def _scale_edits(
    model: HeadModel, layers: tuple[int, ...] | None, region: torch.Tensor, weight: torch.Tensor, row: int
) -> list[AdaptVisScale]:
    ls = range(model.n_layers) if layers is None else layers
    bad = [la for la in ls if not 0 <= la < model.n_layers]
    if bad:
        raise HeadsteerValueError(
            f"AdaptVis layer(s) {short_repr(bad[:5])}{' ...' if len(bad) > 5 else ''} outside the model's "
            f"0..{model.n_layers - 1}"
        )
    if bool((weight == 1).all()):
        return []
    return [AdaptVisScale(layer=la, region=region, weight=weight, row=row) for la in sorted(set(ls))]


@dataclass(frozen=True)
class ScalingVis:
    """ScalingVis: multiply the last prompt token's attention logits on the image by `weight`.

    Args:
        weight: alpha >= 0 (default `DEFAULT_SCALING_WEIGHT` = 0.8); 1 is a no-op (warns), at most 100.
        target: `"image"`, `"text"` (the emphasized context) or `"auto"` (default: the image spans
            when the batch has an image, else the emphasized text).
        layers: edited layers, None (default) = all (the reference: every layer, every head).

    Raises:
        TypeError: weight not a number; layers not ints.
        ValueError: weight not finite or outside [0, 100]; unknown target; when applied, no span of
            the target in any prompt, or a layer outside the model.

    Source: arXiv:2503.01773 §4 (Eq. for ScalingVis); reference `model_zoo/llama/
    modeling_llama_add_attn.py` (`attn_weights[:, :, mask] *= weight` on the last row, image keys).
    """

    weight: float = DEFAULT_SCALING_WEIGHT
    target: Target = "auto"
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        w = _weight("ScalingVis weight", self.weight)
        if self.target not in ("auto", "image", "text"):
            raise HeadsteerValueError(
                f"unknown ScalingVis target {short_repr(self.target)}: use 'auto', 'image' or 'text'"
            )
        object.__setattr__(self, "layers", _layers("ScalingVis", self.layers))
        if w == 1:
            warn_noop("ScalingVis weight=1 is a no-op: output equals the unsteered model", stacklevel=4)

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[AdaptVisScale]:
        """One `AdaptVisScale` (all heads) per edited layer for the batch `enc`."""
        region = _region(enc, self.target, "ScalingVis")
        weight = torch.full((enc.batch,), float(self.weight))
        return _scale_edits(model, self.layers, region, weight, enc.length - 1)


@torch.no_grad()
def first_token_confidence(model: HeadModel, enc: EncodedPrompts) -> torch.Tensor:
    """`[B]` max softmax probability of the next token after each prompt (unsteered prefill).

    The reference's "uncertainty": `max(softmax(scores[0]))` of the first greedy step.
    """
    model.check_length(enc.length)
    out = model.run(**enc.model_inputs(model.device), use_cache=False, logits_to_keep=1)
    confidence: torch.Tensor = out.logits[:, -1].float().softmax(-1).max(-1).values.cpu()
    return confidence


@dataclass(frozen=True)
class AdaptVis:
    """AdaptVis: ScalingVis with alpha chosen per prompt from the model's confidence.

    Args:
        weight1: alpha when the confidence is below `threshold` (default 0.5).
        weight2: alpha otherwise (default 1.5).
        threshold: confidence threshold in [0, 1] (default 0.4).
        target, layers: as `ScalingVis`.

    After `edits`, `last["confidence"]` (`[B]`) and `last["weight"]` (`[B]`) hold the probe's
    confidences and the chosen alphas.

    Raises:
        TypeError: a weight or the threshold not a number; layers not ints.
        ValueError: a weight outside [0, 100], a threshold outside [0, 1], an unknown target;
            when applied, no span of the target, a layer outside the model.

    Source: arXiv:2503.01773 §4 (AdaptVis); reference `model_zoo/llava15.py`,
    `get_out_scores_wh_batched` (`uncertainty < threshold` -> `weight1`, else `weight2`).
    """

    weight1: float = DEFAULT_WEIGHT1
    weight2: float = DEFAULT_WEIGHT2
    threshold: float = DEFAULT_THRESHOLD
    target: Target = "auto"
    layers: tuple[int, ...] | None = None
    last: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        _weight("AdaptVis weight1", self.weight1)
        _weight("AdaptVis weight2", self.weight2)
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, numbers.Real):
            raise HeadsteerTypeError(f"AdaptVis threshold must be a number, got {short_repr(t)}")
        if not is_number(t) or not math.isfinite(t) or not 0 <= t <= 1:
            raise HeadsteerValueError(f"AdaptVis threshold must be in [0, 1], got {short_repr(t)}")
        if self.target not in ("auto", "image", "text"):
            raise HeadsteerValueError(
                f"unknown AdaptVis target {short_repr(self.target)}: use 'auto', 'image' or 'text'"
            )
        object.__setattr__(self, "layers", _layers("AdaptVis", self.layers))
        if self.weight1 == 1 and self.weight2 == 1:
            warn_noop(
                "AdaptVis weight1=weight2=1 is a no-op: output equals the unsteered model", stacklevel=4
            )

    def choose(self, confidence: torch.Tensor) -> torch.Tensor:
        """`[B]` alpha per prompt: `weight1` where `confidence < threshold`, else `weight2`."""
        low = confidence < self.threshold
        return torch.where(low, float(self.weight1), float(self.weight2)).float()

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[AdaptVisScale]:
        """Probe the unsteered prompt (one prefill), pick alpha per row, and return one
        `AdaptVisScale` per edited layer."""
        region = _region(enc, self.target, "AdaptVis")
        if self.layers is not None:
            _scale_edits(model, self.layers, region, torch.ones(enc.batch), enc.length - 1)  # layer check
        conf = first_token_confidence(model, enc)
        weight = self.choose(conf)
        self.last["confidence"], self.last["weight"] = conf, weight
        return _scale_edits(model, self.layers, region, weight, enc.length - 1)
