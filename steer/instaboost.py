"""InstABoost: boost the attention on the instruction in every layer and head (Guardieiro, Stein,
Khare and Wong, "Instruction Following by Boosting Attention of Large Language Models",
arXiv:2506.13734, 2025; reference code `BrachioLab/InstABoost`).

Rule. In every layer and every query head, the post-softmax attention on the instruction's key
columns G is multiplied by a constant M and each row is renormalised:

    A'_ij = M^[j in G] A_ij / sum_k M^[k in G] A_ik,

which is exactly `softmax(S + M + log(M) 1[j in G])`: a constant logit bias `log M` on the
instruction columns. Generated columns are never in G. Because the bias is the same for every
query row it is a per-column `LogitBias` (`InstaBoostBias`) and runs in the fused kernel.

Relation to PASTA (`steer.pasta`). PASTA `exclude(alpha)` on heads H adds `log alpha` to the
prompt columns outside G and 0 to G and to generated columns. With H = all heads and
alpha = 1/M the two agree exactly wherever no generated column is visible (the whole prefill),
by softmax shift invariance (PASTA's bias is InstABoost's minus `log M` on every prompt column).
During decoding they differ: PASTA treats generated columns like G (boosted by M against the
rest of the prompt), InstABoost like the rest of the prompt (not boosted). Exactly:

    InstaBoost(M) == [Pasta(all, alpha=1/M, "exclude"), Pasta(all, alpha=M, "generation")]

at every step (the second term adds `log M` on every prompt column, cancelling PASTA's shift).

G. `region="span"` (default): the emphasised span(s) (`**markup**` / `emphasize=`). The
reference boosts the token prefix `[0, prompt_len)` of a prompt that starts with the instruction,
i.e. BOS, the chat template's header and the instruction; `region="prefix"` reproduces that: every
real prompt token from the first up to the end of the row's last span.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from heads._util.validation import is_int, is_number, is_real, short_repr
from heads.engine.edits import MAX_FACTOR
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from steer.noop import warn_noop
from steer.pasta.method import PastaBias
from steer.span_rows import warn_rows_without_span

__all__ = ["InstaBoost", "InstaBoostBias", "instaboost_column_bias"]

Region = Literal["span", "prefix"]

DEFAULT_MULTIPLIER = 5.0
"""`InstaBoost.multiplier` default. The reference picks M per task from 1, 3, ..., 19 on a
validation split (the best steering score whose fluency stays >= 1); 5 is our choice for
SmolLM2-135M-Instruct (docs/methods/instaboost.md: measured effect)."""


class InstaBoostBias(PastaBias):
    """Logit bias `log M` on the instruction's prompt columns of every head of one layer
    (`column_bias` `[B, P]`; 0 on the other columns and on generated columns)."""


def instaboost_column_bias(enc: EncodedPrompts, multiplier: float, region: Region = "span") -> torch.Tensor:
    """`[B, P]` fp32 log-factors: `log(multiplier)` on each row's instruction columns G, else 0.

    G is the union of the row's emphasised spans (`region="span"`), or every real prompt token
    from the row's first up to the end of its last span (`region="prefix"`, the reference's
    `[0, prompt_len)`). Padding columns and rows without a span get 0.
    """
    log_m = math.log(multiplier)
    real = enc.attention_mask.bool()
    out = torch.zeros(enc.batch, enc.length)
    for b, row in enumerate(enc.spans):
        if not row:
            continue
        if region == "span":
            g = enc.span_mask(b)
        else:
            end = max(e for _, e in row)
            g = torch.zeros(enc.length, dtype=torch.bool)
            g[:end] = True
        out[b] = torch.where(g & real[b], log_m, 0.0)
    return out


@dataclass(frozen=True)
class InstaBoost:
    """InstABoost: multiply the attention on the instruction by `multiplier` in all heads.

    Args:
        multiplier: M > 0, default `DEFAULT_MULTIPLIER` = 5 (the reference searches 1, 3, ..., 19
            per task); M = 1 is a bitwise no-op (warns), M < 1 suppresses the instruction (warns).
            At most 1e4.
        region: `"span"` (default: the emphasised spans) or `"prefix"` (everything from the first
            prompt token to the end of the last span, as the reference's prepended instruction).
        layers: the boosted layers, None (default) = all (the paper: all layers and heads).

    Raises:
        TypeError: multiplier not a number; layers not ints.
        ValueError: multiplier not finite, <= 0 or > 1e4; unknown region; when applied, no prompt
            with a span, or a layer outside the model.

    Source: arXiv:2506.13734 §3 (constant additive bias on the instruction keys' logits in all
    layers and heads); reference `src/steering.py`, `prompt_attention_ablation_hook` (multiply
    the pattern's first `prompt_len` columns by M, then L1-normalise each row).
    """

    multiplier: float = DEFAULT_MULTIPLIER
    region: Region = "span"
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        m = self.multiplier
        if not is_real(m):
            raise HeadsteerTypeError(f"InstaBoost multiplier must be a number, got {short_repr(m)}")
        if not is_number(m) or not math.isfinite(m) or m <= 0 or m > MAX_FACTOR:
            raise HeadsteerValueError(
                f"InstaBoost multiplier must be in (0, {MAX_FACTOR:g}], got {short_repr(m)}"
            )
        if self.region not in ("span", "prefix"):
            raise HeadsteerValueError(
                f"unknown InstaBoost region {short_repr(self.region)}: use 'span' or 'prefix'"
            )
        if self.layers is not None:
            layers = tuple(self.layers)
            if any(not is_int(la) for la in layers):
                raise HeadsteerTypeError(f"InstaBoost layers must be ints, got {short_repr(self.layers)}")
            object.__setattr__(self, "layers", tuple(int(la) for la in layers))
            if not layers:
                warn_noop("InstaBoost with no layers steers nothing: output equals the unsteered model")
        if m == 1:
            warn_noop("InstaBoost multiplier=1 is a no-op: output equals the unsteered model", stacklevel=4)
        elif m < 1:
            warn_noop(
                f"InstaBoost multiplier={m} < 1 suppresses the instruction instead of boosting it",
                stacklevel=4,
            )

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[InstaBoostBias]:
        """One `InstaBoostBias` (all heads) per boosted layer for the batch `enc`.

        A prompt without a span is left unsteered (`UnsteeredRowsWarning`).

        Raises:
            ValueError: no prompt of the batch has a span; a layer outside the model.
        """
        layers = tuple(range(model.n_layers)) if self.layers is None else self.layers
        bad = [la for la in layers if not 0 <= la < model.n_layers]
        if bad:
            raise HeadsteerValueError(
                f"InstaBoost layer(s) {short_repr(bad[:5])}{' ...' if len(bad) > 5 else ''} outside the "
                "model's "
                f"0..{model.n_layers - 1}"
            )
        if not any(enc.spans):
            raise HeadsteerValueError(
                "InstaBoost needs the instruction as an emphasized span: mark it with **...** "
                "or pass emphasize="
            )
        if self.multiplier == 1 or not layers:
            return []
        warn_rows_without_span(enc, "InstaBoost")
        cb = instaboost_column_bias(enc, float(self.multiplier), self.region)
        return [InstaBoostBias(layer=la, heads=None, column_bias=cb) for la in sorted(set(layers))]
