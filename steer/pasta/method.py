"""PASTA: post-hoc attention steering (Zhang et al., ICLR 2024, arXiv:2311.02262).

Spec: docs/methods/pasta.md. On the steered heads, the attention logits of prompt key
columns outside the emphasized set G get `+log(alpha)` (mode `exclude`), which
equals the paper's Eq. 2 post-softmax rescaling with generated columns treated
like G (never scaled). The bias is `[B, 1, 1, K]` per head, built per call, so
it holds at every decode step with a KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import torch

from heads._util.files import is_file, short_path
from heads._util.validation import is_number, is_real, short_repr
from heads.engine.edits import AttentionCall, LogitBias
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadSet, HeadSpec
from steer.noop import empty_heads, warn_noop
from steer.span_rows import warn_rows_without_span

__all__ = ["Pasta", "PastaBias", "pasta_column_bias"]

Mode = Literal["exclude", "include", "generation"]
MultiSpan = Literal["union", "compound"]
SpanTarget = Literal["text", "image", "both"]


@dataclass(eq=False, repr=False)
class PastaBias(LogitBias):
    """Logit bias `column_bias[b, j]` on prompt key columns `j < P`; 0 on generated columns.

    Attributes:
        column_bias: `[B, P]` fp32 natural-log factors (e.g. `log(0.01)`).
    """

    column_bias: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0))
    per_column: ClassVar[bool] = True  # `[B, 1, 1, K]`: runs in the fused kernel

    def is_identity(self) -> bool:
        return not bool(self.column_bias.any())

    def bias(self, call: AttentionCall) -> torch.Tensor:
        cb = self._padded(call.k_len, call.device)
        if cb.shape[0] != call.batch:
            raise HeadsteerValueError(
                f"PASTA was built for a batch of {cb.shape[0]} prompts, the model ran {call.batch} rows "
                "(num_return_sequences / beams are not supported with steering)"
            )
        return cb[:, None, None, : call.k_len]

    def _padded(self, k_len: int, device: torch.device) -> torch.Tensor:
        """`column_bias` extended with zeros (generated columns are never scaled), grown by doubling."""
        cached = getattr(self, "_cache", None)
        if cached is None or cached.shape[1] < k_len or cached.device != device:
            width = max(k_len, 2 * self.column_bias.shape[1], 64)
            cached = self.column_bias.new_zeros(self.column_bias.shape[0], width)
            cached[:, : self.column_bias.shape[1]] = self.column_bias
            self._cache = cached.to(device)
        return self._cache


def pasta_column_bias(
    enc: EncodedPrompts,
    alpha: float,
    scale_position: Mode = "exclude",
    multi_span: MultiSpan = "union",
    spans: SpanTarget = "text",
) -> torch.Tensor:
    """`[B, P]` log-factors that PASTA adds to prompt key columns (docs/methods/pasta.md).

    G is the set of `spans` of each row: `"text"` (emphasized text, `enc.spans`),
    `"image"` (image-feature tokens, `enc.image_spans`) or `"both"`.

    * `exclude`: `log(alpha)` on real prompt columns outside G (union of spans), or with
      `compound` one `log(alpha)` per span on columns outside that span (reference code).
    * `include`: the same with `-log(alpha)` (so `include(1/alpha) == exclude(alpha)`).
    * `generation`: `log(alpha)` on every real prompt column.

    Padding columns get 0 (they are masked anyway). Rows without a span get 0 in
    `exclude`/`include` (unsteered; `Pasta.edits` warns about them).
    """
    log_a = math.log(alpha)
    real = enc.attention_mask.bool()
    if scale_position == "generation":
        return torch.where(real, log_a, 0.0)
    sign = 1.0 if scale_position == "exclude" else -1.0
    out = torch.zeros(enc.batch, enc.length)
    for b, row in enumerate(enc.select_spans(spans)):
        if not row:
            continue
        if multi_span == "union":
            outside = ~enc.span_mask(b, target=spans)
            out[b] = torch.where(outside & real[b], sign * log_a, 0.0)
        else:
            for k in range(len(row)):
                out[b] += torch.where(~enc.span_mask(b, which=k, target=spans) & real[b], sign * log_a, 0.0)
    return out


def check_alpha(alpha: float, scale_position: str = "exclude", *, stacklevel: int = 3) -> float:
    """Check PASTA's `alpha` (docs/methods/pasta.md: alpha in (0, 1) for emphasis, > 1 in include mode).

    Warns (`steer.noop.NoOpWarning`, a `UserWarning`) where alpha is legal but does not
    emphasize the span: alpha = 1 (a bitwise no-op, §8); `exclude` / `generation` with
    alpha > 1 (down-weights the context instead); `include` with alpha < 1 (suppresses the
    span, §7).

    Returns:
        alpha as a float.

    Raises:
        TypeError: alpha not a real number.
        ValueError: alpha not finite or <= 0 (alpha = 0 deletes the context).
    """
    if not is_real(alpha):
        raise HeadsteerTypeError(f"alpha must be a number, got {short_repr(alpha)}")
    if not is_number(alpha) or not math.isfinite(alpha) or alpha <= 0:
        raise HeadsteerValueError(
            f"alpha must be finite and > 0, got {short_repr(alpha)} (alpha = 0 deletes the context)"
        )
    if alpha == 1:
        warn_noop(f"PASTA alpha={alpha} is a no-op: output equals the unsteered model", stacklevel=stacklevel)
    elif scale_position == "include" and alpha < 1:
        warn_noop(
            f"PASTA include mode with alpha={alpha} < 1 suppresses the span; "
            "use exclude mode or alpha > 1 to emphasize it",
            stacklevel=stacklevel,
        )
    elif scale_position != "include" and alpha > 1:
        warn_noop(
            f"PASTA alpha={alpha} > 1 in {scale_position} mode down-weights the span instead of "
            "emphasizing it (alpha is in (0, 1); default 0.01)",
            stacklevel=stacklevel,
        )
    return float(alpha)


@dataclass(frozen=True)
class Pasta:
    """PASTA steering on a fixed set of heads.

    Args:
        heads: the steered heads, a `heads.HeadSpec`: a `{"layer": [heads]}` dict (PASTA's
            JSON shape, keys may be strings), a list of layers (all their heads), a list of
            `(layer, head)` pairs, a `HeadSet` (e.g. `scores.top(30)`), a path to a
            JSON file of the dict shape, or `"auto"`: the shipped multi-task profile of the
            embedded model (`steer.profiles`; ValueError at `edits` for another model).
        alpha: scaling coefficient in (0, inf), default 0.01; `alpha = 1` is a no-op.
            In `exclude` mode alpha < 1 emphasizes the span.
        scale_position: `"exclude"` (default), `"include"` (needs alpha > 1; warns
            otherwise because it suppresses the span) or `"generation"`.
        multi_span: `"union"` (paper, default) or `"compound"` (reference-code parity:
            factors alpha^m / alpha^(m-1) / 1).
        spans: which spans are emphasized: `"text"` (default: `**markup**` and
            `emphasize=`), `"image"` (the image-feature tokens of a vision-language
            prompt, `EncodedPrompts.image_spans`; each image is one span) or `"both"`.

    Frozen: make variants with `dataclasses.replace(pasta, alpha=...)`. An empty head
    selection or alpha = 1 is a bitwise no-op (docs/methods/pasta.md).

    Raises:
        ValueError: alpha not finite or <= 0; unknown mode; bad heads (when applied).
        TypeError: alpha not a number; `heads` of no head-spec type.
        FileNotFoundError: `heads` names a JSON file that does not exist.

    Source: Zhang et al. 2024, Eq. 2; reference code QingruZhang/PASTA.
    """

    heads: HeadSpec
    alpha: float = 0.01
    scale_position: Mode = "exclude"
    multi_span: MultiSpan = "union"
    spans: SpanTarget = "text"

    def __post_init__(self) -> None:
        self.validate()
        if not isinstance(self.heads, HeadSet | Mapping | list | tuple | str | Path):
            raise HeadsteerTypeError(
                f"heads must be a head spec (a {{layer: [heads]}} dict, a list of layers or (layer, head) "
                f"pairs, a HeadSet, a JSON file path or 'auto'), got {type(self.heads).__name__}"
            )
        if isinstance(self.heads, str | Path) and self.heads != "auto" and not is_file(self.heads):
            raise FileNotFoundError(f"head file not found: {short_path(self.heads)} (or use heads='auto')")
        check_alpha(self.alpha, self.scale_position, stacklevel=5)
        if empty_heads(self.heads):
            warn_noop("PASTA with no heads steers nothing: output equals the unsteered model", stacklevel=4)

    def validate(self) -> None:
        """Check alpha and the modes (also run by `edits`).

        Raises:
            TypeError: alpha not a real number.
            ValueError: alpha not finite or <= 0; unknown mode.
        """
        if not is_real(self.alpha):
            raise HeadsteerTypeError(f"alpha must be a number, got {short_repr(self.alpha)}")
        if not is_number(self.alpha) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise HeadsteerValueError(
                f"alpha must be finite and > 0, got {short_repr(self.alpha)} (alpha = 0 deletes the context)"
            )
        if self.scale_position not in ("exclude", "include", "generation"):
            raise HeadsteerValueError(
                f"unknown scale_position {short_repr(self.scale_position)}: use 'exclude', 'include' or "
                "'generation'"
            )
        if self.multi_span not in ("union", "compound"):
            raise HeadsteerValueError(
                f"unknown multi_span {short_repr(self.multi_span)}: use 'union' or 'compound'"
            )
        if self.spans not in ("text", "image", "both"):
            raise HeadsteerValueError(
                f"unknown spans {short_repr(self.spans)}: use 'text', 'image' or 'both'"
            )

    def head_set(self, model: HeadModel) -> HeadSet:
        """The steered heads, checked against `model` (`"auto"`: its shipped profile)."""
        spec = self.heads
        if isinstance(spec, str) and spec == "auto":
            from steer.profiles import shipped_profile

            spec = shipped_profile("pasta", model.name)
        return HeadSet.parse(spec, model.n_layers, model.n_heads)

    @property
    def needs_span(self) -> bool:
        return self.scale_position != "generation"

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[PastaBias]:
        """One `PastaBias` per steered layer for the batch `enc`.

        In `exclude` / `include` mode a prompt of the batch without an emphasized span is
        left unsteered, with an `UnsteeredRowsWarning` naming it (`steer.span_rows`).

        Raises:
            ValueError: no prompt has an emphasized span (exclude/include), bad heads.
        """
        self.validate()
        heads = self.head_set(model)
        if self.alpha == 1:
            return []
        if self.needs_span and not any(enc.select_spans(self.spans)):
            if self.spans == "image":
                raise HeadsteerValueError(
                    "PASTA spans='image' needs prompts with images (no image tokens in the batch)"
                )
            raise HeadsteerValueError(
                "PASTA needs an emphasized span: mark it with **...** in the prompt or pass emphasize="
            )
        if self.needs_span:
            warn_rows_without_span(enc, "PASTA", spans=enc.select_spans(self.spans))
        cb = pasta_column_bias(enc, self.alpha, self.scale_position, self.multi_span, self.spans)
        return [PastaBias(layer=layer, heads=hs, column_bias=cb) for layer, hs in heads.by_layer().items()]
