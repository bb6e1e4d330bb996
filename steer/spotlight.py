"""SpotLight: dynamic, target-proportion attention steering (Venkateswaran & Contractor,
arXiv:2505.12025, EACL 2026; docs/methods/spotlight.md).

In every steered layer the current share of attention on the emphasized span,
psi = sum(W * m) / sum(W), is compared with a target tau; where psi < tau the span logits
get a bias beta, i.e. W' = W * e^(beta m) / sum_k W_k e^(beta m_k) (the same as
softmax(S + M + beta m), with masked entries kept exactly 0). It only ever steers up: where
psi >= tau (or psi = 0, span invisible) the pattern is returned bitwise unchanged.

* `bias="odds"` (default): beta = log[tau (1 - psi) / (psi (1 - tau))], which lands a row
  whose share is psi exactly on tau (exact at `row` granularity).
* `bias="ratio"` (reference code): beta = log(tau / psi); a row at psi ends at
  tau / (1 + tau - psi), just below tau (under-correction).
* `bias="solve"`: bisection on beta so that the pooled share equals tau (within 1e-4).

Granularity: `"layer"` (reference; one psi per prompt and layer, pooled over all heads and
query rows in the call), `"head"` (per head) or `"row"` (per head and query row). At layer or
head granularity psi pools whatever rows are in the call: all prompt rows at prefill, only the
new row at each decode step, so individual rows stay spread around tau and an uncached re-run
differs from cached decoding by design. Span columns are prompt positions only; generated
tokens are never in the span. Decode rows are steered at every step (`steer_decode=True`).
A prompt without a span (psi = 0) is left unsteered; in a batch, `Spotlight.edits` warns about
such rows (`UnsteeredRowsWarning`, `steer.span_rows`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from heads._util.validation import check_bool, is_int, is_number, is_real, short_repr
from heads.engine import state as engine_state
from heads.engine.edits import AttentionCall, SpanShareEdit
from heads.engine.kernels import fused
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from steer.span_rows import warn_rows_without_span

__all__ = ["Spotlight", "SpotlightEdit", "spotlight_bias"]

Bias = Literal["odds", "ratio", "solve"]
Granularity = Literal["layer", "head", "row"]
_DIMS = {"layer": (1, 2), "head": (2,), "row": ()}


def spotlight_bias(psi: torch.Tensor, tau: float, bias: Bias = "odds") -> torch.Tensor:
    """Closed-form span bias beta for share `psi` and target `tau` (0 where no steering).

    `psi` in [0, 1]; rows with psi >= tau or psi = 0 get beta = 0. Only `odds` and `ratio`.
    """
    steer = (psi > 0) & (psi < tau)
    p = psi.clamp(min=1e-30)
    if bias == "odds":
        beta = torch.log(tau * (1 - p) / (p * (1 - tau)))
    else:
        beta = torch.log(tau / p)
    return torch.where(steer, beta, 0.0)


def _pool(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return x.sum(dims, keepdim=True) if dims else x


def _share(num: torch.Tensor, den: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return _pool(num, dims) / _pool(den, dims).clamp(min=1e-30)


def _solve(num: torch.Tensor, den: torch.Tensor, dims: tuple[int, ...], tau: float) -> torch.Tensor:
    """beta per pool such that the pooled share of the rescaled rows equals tau (bisection).

    A row with span mass n of total d becomes e^beta n d / (e^beta n + d - n); the pooled
    share is monotone in beta, so 60 halvings of [0, 80] pin it well below 1e-4.
    """
    lo = torch.zeros_like(_pool(num, dims))
    hi = torch.full_like(lo, 80.0)
    for _ in range(60):
        mid = (lo + hi) / 2
        e = torch.exp(mid)
        new_num = e * num * den / (e * num + den - num).clamp(min=1e-30)
        below = _share(new_num, den, dims) < tau
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    return (lo + hi) / 2


@dataclass(eq=False, repr=False)
class SpotlightEdit(SpanShareEdit):
    """The SpotLight rescale on one layer (see the module docstring).

    Attributes:
        span: `[B, P]` bool, emphasized prompt columns (padded coordinates).
        tau: target share in (0, 1).
        bias: see `Spotlight`.
        granularity: see `Spotlight`.
        steer_decode: also steer decode rows (query positions >= P).
        last_psi: the share(s) measured at the most recent call (fp32), for inspection.
    """

    span: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, dtype=torch.bool))
    tau: float = 0.1
    bias: Bias = "odds"
    granularity: Granularity = "layer"
    steer_decode: bool = True
    last_psi: torch.Tensor | None = field(default=None, init=False)

    def is_identity(self) -> bool:
        return not bool(self.span.any())

    def span_columns(self, call: AttentionCall) -> torch.Tensor:
        if self.span.shape[0] != call.batch:
            built = self.span.shape[0]
            raise HeadsteerValueError(
                f"SpotLight was built for {built} prompts, the call has {call.batch} rows"
            )
        m = torch.zeros(call.batch, call.k_len, dtype=torch.bool, device=call.device)
        width = min(self.span.shape[1], call.k_len)
        m[:, :width] = self.span[:, :width].to(call.device)
        return m

    def span_beta(self, num: torch.Tensor, den: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
        if not self.steer_decode and call.q_offset >= self.span.shape[1]:
            return None
        # pooled rows must be the whole prefill: not one block of it, not a multi-row call on a cache
        if self.granularity != "row" and (call.split or (call.q_len > 1 and call.q_offset > 0)):
            raise HeadsteerValueError(
                f"SpotLight granularity {short_repr(self.granularity)} pools the whole prefill, but the "
                "engine split "
                f"it into query blocks ({call.q_len} of {call.k_len} rows): use granularity='row', or "
                "kernel='auto' / 'fused' (no grad) for prompts longer than heads.engine.state.QUERY_BLOCK"
            )
        dims = _DIMS[self.granularity]
        psi = _share(num, den, dims)
        self.last_psi = psi.detach()
        steer = (psi > 0) & (psi < self.tau)
        if not bool(steer.any()):
            return None
        if self.bias == "solve":
            return torch.where(steer, _solve(num, den, dims, self.tau), 0.0)
        return spotlight_bias(psi, self.tau, self.bias)


def _check_tau(tau: object) -> float:
    if not is_real(tau):
        raise HeadsteerTypeError(f"tau must be a number, got {short_repr(tau)}")
    value = float(tau) if is_number(tau) else math.inf  # 10**400: no float holds it
    if not math.isfinite(value) or not 0 < value < 1:
        raise HeadsteerValueError(f"tau must be in (0, 1), got {short_repr(tau)}")
    return value


@dataclass(frozen=True)
class Spotlight:
    """SpotLight steering of every head (or of `layers`) towards the emphasized span.

    Args:
        tau: target attention share on the span, in (0, 1); default 0.1 (the paper's main
            setting; model-dependent: the reference uses 0.2, and 0.3 over-steers 8B models).
        bias: `"odds"` (default, exact per row), `"ratio"` (reference code) or `"solve"`.
        granularity: `"layer"` (default, reference), `"head"` or `"row"`.
        layers: layers to steer (default all).
        steer_decode: steer every decode step (default True) or the prefill only.

    Raises:
        ValueError / TypeError: tau outside (0, 1), unknown bias or granularity, bad layers;
            no emphasized span in any prompt (when applied).

    Source: Venkateswaran & Contractor 2025, §3 (Eq. 5 / App. C for the odds form).
    """

    tau: float = 0.1
    bias: Bias = "odds"
    granularity: Granularity = "layer"
    layers: tuple[int, ...] | None = None
    steer_decode: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check_tau(self.tau)
        if self.bias not in ("odds", "ratio", "solve"):
            raise HeadsteerValueError(f"unknown bias {short_repr(self.bias)}: use 'odds', 'ratio' or 'solve'")
        if self.granularity not in _DIMS:
            raise HeadsteerValueError(
                f"unknown granularity {short_repr(self.granularity)}: use 'layer', 'head' or 'row'"
            )
        check_bool("steer_decode", self.steer_decode, what="a bool")
        if self.layers is not None:
            ls = self.layers
            if isinstance(ls, (str, bytes)) or not isinstance(ls, (list, tuple, range)):
                raise HeadsteerTypeError(
                    f"layers must be None or a list of layer indices, got {short_repr(ls)}"
                )
            if not ls:
                raise HeadsteerValueError(
                    "layers is empty: SpotLight would steer nothing (None = every layer)"
                )
            if any(not is_int(x) for x in ls):
                raise HeadsteerTypeError(f"layers must be ints, got {short_repr(ls)}")
            if len(set(ls)) != len(ls):
                raise HeadsteerValueError(f"layers has duplicates (each would steer again): {short_repr(ls)}")

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[SpotlightEdit]:
        """One `SpotlightEdit` per steered layer for the batch `enc`.

        A prompt of the batch without an emphasized span is left unsteered, with an
        `UnsteeredRowsWarning` naming it (`steer.span_rows`).

        Raises:
            ValueError: no prompt has an emphasized span, an unknown layer, or (granularity
                `"layer"` / `"head"`) a prompt longer than the engine's query block when this
                torch has no flex_attention. With it, such a prompt runs unsplit on the fused
                kernel (`kernel="auto"` or `"fused"`); `kernel="blocked"` or gradients on CPU
                split it and raise `ValueError` at the prefill.
        """
        self.validate()
        if not any(enc.spans):
            raise HeadsteerValueError(
                "SpotLight needs an emphasized span: mark it with **...** or pass emphasize="
            )
        block = engine_state.QUERY_BLOCK
        if self.granularity != "row" and enc.length > block and not fused.available():
            raise HeadsteerValueError(
                f"SpotLight granularity {short_repr(self.granularity)} pools the whole prefill, but a prompt "
                f"of {enc.length} tokens is split into query blocks of {block} rows "
                "(heads.engine.state.QUERY_BLOCK) and this torch has no flex_attention for the fused "
                "kernel: use granularity='row' for longer prompts"
            )
        warn_rows_without_span(enc, "SpotLight")
        layers = range(model.n_layers) if self.layers is None else [int(x) for x in self.layers]
        for layer in layers:
            model.check_head(layer, 0)
        span = enc.span_mask()
        return [
            SpotlightEdit(
                layer=la,
                span=span,
                steer_decode=self.steer_decode,
                tau=self.tau,
                bias=self.bias,
                granularity=self.granularity,
            )
            for la in layers
        ]
