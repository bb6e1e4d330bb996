"""Pattern injection: set or mix a head's attention toward a given pattern (Li, Xiao, Xing, Wang,
Murray and Carenini, "Human Guided Exploitation of Interpretable Attention Patterns in
Summarization and Topic Segmentation", EMNLP 2022, arXiv:2112.05364; reference code
`raymondzmc/Attention-Pattern-Exploitation`; docs/methods/pattern_injection.md).

For every edited (batch row, query head, query row) with post-softmax attention `A` and target
pattern `P` (non-negative, over key columns):

* `P^` = `P` restricted to the row's visible keys (real, causal, inside any sliding window),
  divided by its sum;
* mode `"mix"` (default): `A' = (1 - w) A + w P^`. At w = 1 the head attends exactly `P^`: for
  a 0/1 pattern, uniformly over its support, which is the reference's `synthesize` mode (logits
  set to the 0/1 pattern, -10000 outside it: `models/encoders/modeling_bert.py`,
  `BertSelfAttention.forward`);
* mode `"mask"`: `A' = (1 - w) A + w A~`, where `A~` is the head's own attention restricted to
  the pattern's support and renormalised: the reference's `mask` mode (-10000 added outside the
  support) at w = 1.

A row whose pattern has no visible support (e.g. the first token under `previous-token`) is left
unchanged, as the reference lets a token without a matching pair attend everywhere. Rows still
sum to 1 and masked / future keys stay 0; w = 0 is a bitwise no-op.

Positions: the pattern is given in each prompt's own token coordinates (0 = the row's first real
token; left padding is added per batch row), so left padding and batch order do not change it;
during decoding the new row at absolute position p is prompt coordinate p - padding, the same
with and without the KV cache. Patterns: a name of `heads.scorers.roles.named.NAMED_PATTERNS`, or
a `[T, T]` (or `[B, T, T]`) template, e.g. recorded from another head or another model with
`heads.scorers.roles.clusters.record_pattern`; rows and columns beyond T get no pattern.

The reference injects its patterns while fine-tuning (the heads learn around them); headsteer
injects them at inference only, into a trained model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from heads._util.validation import is_number, is_real, short_repr
from heads.engine.edits import AttentionCall, ProbEdit
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadSet, HeadSpec
from heads.scorers.roles.named import NAMED_PATTERNS, PatternContext, check_pattern_name, named_support
from steer.noop import empty_heads, warn_noop

__all__ = ["MAX_TEMPLATE", "PatternEdit", "PatternInjection", "check_template", "inject_pattern"]

Mode = Literal["mix", "mask"]
SpanTarget = Literal["text", "image", "both", "auto"]

MAX_TEMPLATE = 8192
"""Largest T of a `[T, T]` template."""


def check_template(pattern: object) -> torch.Tensor:
    """A template as an fp32 CPU tensor `[1 or B, T, T]` (HeadsteerValueError / TypeError naming
    the fault: not a tensor, wrong shape, T outside 1..`MAX_TEMPLATE`, negative, NaN or inf values,
    an all-zero template)."""
    if not isinstance(pattern, torch.Tensor):
        raise HeadsteerTypeError(
            f"pattern must be a name ({', '.join(NAMED_PATTERNS)}) or a [T, T] tensor, got "
            f"{short_repr(pattern)}"
        )
    if pattern.is_complex():
        raise HeadsteerTypeError(f"pattern must be a real tensor, got {pattern.dtype}")
    if pattern.ndim not in (2, 3) or pattern.shape[-1] != pattern.shape[-2]:
        raise HeadsteerValueError(
            f"a pattern template must be [T, T] or [B, T, T] (rows = queries, columns = keys), got shape "
            f"{tuple(pattern.shape)}"
        )
    t = pattern.shape[-1]
    if not 1 <= t <= MAX_TEMPLATE or (pattern.ndim == 3 and pattern.shape[0] < 1):
        raise HeadsteerValueError(f"a pattern template needs 1 <= T <= {MAX_TEMPLATE}, got T = {t}")
    p = pattern.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(p).all()):
        raise HeadsteerValueError("the pattern template holds NaN or inf")
    if bool((p < 0).any()):
        raise HeadsteerValueError("the pattern template holds negative weights (attention is non-negative)")
    if not bool((p > 0).any()):
        raise HeadsteerValueError("the pattern template is all zero: it would change no row")
    return p if p.ndim == 3 else p[None]


def _weight(w: object) -> float:
    if not is_real(w):
        raise HeadsteerTypeError(f"weight must be a number in [0, 1], got {short_repr(w)}")
    if not is_number(w) or not math.isfinite(w) or not 0 <= w <= 1:
        raise HeadsteerValueError(
            f"weight must be in [0, 1] (0 = no-op, 1 = the pattern), got {short_repr(w)}"
        )
    return float(w)


@dataclass(eq=False, repr=False)
class PatternEdit(ProbEdit):
    """The engine edit of `PatternInjection` on one layer (see the module docstring).

    Attributes:
        weight: `[B]` fp32 mixing weight w per batch row (0 = row unchanged).
        mode: `"mix"` or `"mask"`.
        name: a named pattern (with `context`), or None for `template`.
        context: the batch's `PatternContext` (padding, spans, sentences, ids, window).
        template: `[1 or B, T, T]` fp32 pattern in prompt coordinates, or None.
    """

    weight: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    mode: Mode = "mix"
    name: str | None = None
    context: PatternContext | None = None
    template: torch.Tensor | None = None

    reads_only: ClassVar[bool] = False

    def is_identity(self) -> bool:
        return not bool((self.weight > 0).any())

    def target(self, call: AttentionCall) -> torch.Tensor:
        """`[B, q_len, k_len]` fp32 pattern (before restriction and normalisation) of the call's rows."""
        ctx = self.context
        assert ctx is not None
        dev = call.device
        if self.name is not None:
            return named_support(self.name, ctx, call.q_offset, call.q_len, call.k_len, dev).float()
        tpl = self.template
        assert tpl is not None
        t = tpl.shape[-1]
        b = call.batch
        first = ctx.first.to(dev)
        qc = torch.arange(call.q_offset, call.q_offset + call.q_len, device=dev)[None, :] - first[:, None]
        kc = torch.arange(call.k_len, device=dev)[None, :] - first[:, None]  # [B, K]
        q_ok = (qc >= 0) & (qc < t)
        k_ok = (kc >= 0) & (kc < t)
        tb = tpl.to(dev).expand(b, t, t)
        rows = tb[torch.arange(b, device=dev)[:, None], qc.clamp(0, t - 1)]  # [B, Q, T]
        out = torch.gather(rows, 2, kc.clamp(0, t - 1)[:, None, :].expand(b, call.q_len, call.k_len))
        return torch.where(q_ok[:, :, None] & k_ok[:, None, :], out, 0.0)

    def visible(self, call: AttentionCall) -> torch.Tensor:
        """`[B, q_len, k_len]` bool: real, causal keys inside the window."""
        ctx = self.context
        assert ctx is not None
        dev = call.device
        first = ctx.first.to(dev)[:, None, None]
        q = torch.arange(call.q_offset, call.q_offset + call.q_len, device=dev)[None, :, None]
        k = torch.arange(call.k_len, device=dev)[None, None, :]
        vis = (k <= q) & (k >= first)
        if ctx.window is not None:
            vis &= q - k < ctx.window
        return vis

    def apply(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        p = self.target(call) * self.visible(call)  # [B, Q, K]
        w = self.weight.to(probs.device, torch.float32)[:, None, None, None]  # [B, 1, 1, 1]
        a = probs.float()
        if self.mode == "mix":
            tot = p.sum(-1, keepdim=True)  # [B, Q, 1]
            goal = (p / tot.clamp(min=1e-30))[:, None]  # [B, 1, Q, K]
            has = (tot > 0)[:, None]  # [B, 1, Q, 1]
        else:
            kept = a * (p > 0)[:, None]
            tot = kept.sum(-1, keepdim=True)  # [B, H, Q, 1]
            goal = kept / tot.clamp(min=1e-30)
            has = tot > 0
        new = (1 - w) * a + w * goal
        return torch.where(has & (w > 0), new, probs)


def inject_pattern(
    probs: torch.Tensor, pattern: torch.Tensor, visible: torch.Tensor, weight: float, mode: Mode = "mix"
) -> torch.Tensor:
    """The injection rule on one pattern, for tests and notebooks: `probs` `[..., Q, K]`, `pattern`
    and `visible` broadcastable to it; rows without visible support unchanged (module docstring)."""
    p = pattern.float() * visible
    if mode == "mix":
        tot = p.sum(-1, keepdim=True)
        goal = p / tot.clamp(min=1e-30)
    else:
        kept = probs * (p > 0)
        tot = kept.sum(-1, keepdim=True)
        goal = kept / tot.clamp(min=1e-30)
    return torch.where(tot > 0, (1 - weight) * probs + weight * goal, probs)


@dataclass(frozen=True)
class PatternInjection:
    """Set or mix the attention of chosen heads toward a pattern, at every prompt row and decode step.

    Args:
        heads: the edited heads, a `heads.HeadSpec` (`{"layer": [heads]}`, `(layer, head)` pairs, a
            list of layers, a `HeadSet` such as `PatternClusters.heads("previous-token")`, a JSON file).
        pattern: a name of `NAMED_PATTERNS` (`"previous-token"`, default; `"first-token"`,
            `"attend-to-span"`, `"same-sentence"`, `"matching-token"`) or a non-negative `[T, T]`
            / `[B, T, T]` template in prompt token coordinates (rows = queries, columns = keys),
            e.g. `record_pattern(other_model, prompt, layer, head)`.
        weight: w in [0, 1] (default 1: the head attends the pattern); 0 is a bitwise no-op (warns).
        mode: `"mix"` (default: toward the normalised pattern) or `"mask"` (toward the head's own
            attention restricted to the pattern's support), see the module docstring.
        span: for `attend-to-span`, which spans: `"text"` (default: `**markup**` / `emphasize=`),
            `"image"`, `"both"` or `"auto"`.

    Raises:
        TypeError: weight not a number; `heads` of no head-spec type; `pattern` neither a name nor a tensor.
        ValueError: weight outside [0, 1]; unknown pattern name, mode or span; a bad template (shape,
            negative / non-finite / all-zero); when applied: bad heads, a template for B rows on a
            batch of another size, `attend-to-span` with no span in the batch.

    Source: Li et al. 2022 §3 (patterns), §4 (injection); reference `models/summarization.py`
    (`get_dynamic_mask`) and `models/encoders/modeling_bert.py`.
    """

    heads: HeadSpec
    pattern: str | torch.Tensor = "previous-token"
    weight: float = 1.0
    mode: Mode = "mix"
    span: SpanTarget = "text"
    _template: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _weight(self.weight)
        if isinstance(self.pattern, str):
            check_pattern_name(self.pattern)
        else:
            object.__setattr__(self, "_template", check_template(self.pattern))
        if self.mode not in ("mix", "mask"):
            raise HeadsteerValueError(f"unknown mode {short_repr(self.mode)}: use 'mix' or 'mask'")
        if self.span not in ("text", "image", "both", "auto"):
            raise HeadsteerValueError(
                f"unknown span {short_repr(self.span)}: use 'text', 'image', 'both' or 'auto'"
            )
        if not isinstance(self.heads, HeadSet | dict | list | tuple | str) and not hasattr(
            self.heads, "__fspath__"
        ):
            raise HeadsteerTypeError(
                f"heads must be a head spec (a {{layer: [heads]}} dict, (layer, head) pairs, a list of "
                f"layers, a HeadSet or a JSON file), got {type(self.heads).__name__}"
            )
        if self.weight == 0:
            warn_noop("PatternInjection weight=0 is a no-op: output equals the unsteered model", stacklevel=4)
        elif empty_heads(self.heads):
            warn_noop("PatternInjection with no heads steers nothing", stacklevel=4)

    @property
    def label(self) -> str:
        """The pattern's name, or `"template"`."""
        return self.pattern if isinstance(self.pattern, str) else "template"

    def head_set(self, model: HeadModel) -> HeadSet:
        """The edited heads, checked against `model`."""
        return HeadSet.parse(self.heads, model.n_layers, model.n_heads)

    def context(self, model: HeadModel, enc: EncodedPrompts) -> PatternContext:
        """The batch's `PatternContext` (padding, spans, sentences, ids)."""
        return PatternContext.of(enc, model.tokenizer, span_target=self.span)

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[PatternEdit]:
        """One `PatternEdit` per edited layer for the batch `enc`.

        Raises:
            ValueError: bad heads; a `[B, T, T]` template on a batch of another size;
                `attend-to-span` with no span of `span` in the batch.
        """
        heads = self.head_set(model)
        tpl = self._template
        if tpl is not None and tpl.shape[0] not in (1, enc.batch):
            raise HeadsteerValueError(
                f"the pattern template holds {tpl.shape[0]} rows, the batch {enc.batch} prompts"
            )
        if self.pattern == "attend-to-span" and not any(enc.select_spans(self.span)):
            raise HeadsteerValueError(
                "pattern 'attend-to-span' needs a marked span (**...** / emphasize=) or an image "
                f"(span={self.span!r}); the batch has none"
            )
        if self.weight == 0:
            return []
        ctx = self.context(model, enc)
        weight = torch.full((enc.batch,), self.weight)
        name = self.pattern if isinstance(self.pattern, str) else None
        out = []
        for layer, hs in heads.by_layer().items():
            c = PatternContext(**{**ctx.__dict__, "window": model.sliding_window(layer)})
            out.append(
                PatternEdit(
                    layer=layer, heads=hs, weight=weight, mode=self.mode, name=name, context=c, template=tpl
                )
            )
        return out
