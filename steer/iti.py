"""Inference-Time Intervention (ITI): shift chosen heads' outputs along a direction.

Li et al. 2023, "Inference-Time Intervention: Eliciting Truthful Answers from a Language
Model" (arXiv:2306.03341), §3.2: for each of the top-k heads, add `alpha * sigma * theta` to the
head's output (its slice of the `o_proj` input), `theta` a unit direction in the head's
`d_head` space (probe weights or mass-mean difference) and `sigma` the standard deviation of
the activations along it, at every steered position.

Steered positions (absolute, padded coordinates): prompt rows `>= from_position` at prefill
and every decode step. The default `from_position=-1` is the last prompt row, as in the
reference implementation (the last token, then each new one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from heads._util.validation import check_int, check_number, is_int, short_repr
from heads.engine.edits import MAX_FACTOR, AttentionCall, HeadOutputEdit
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadSet
from steer.noop import warn_noop

__all__ = ["Iti", "ItiShift"]


@dataclass(eq=False, repr=False)
class ItiShift(HeadOutputEdit):
    """Add `shift[h]` to head h's output at absolute positions `>= from_position`.

    Attributes:
        shift: `[n_heads, d_head]` fp32 shift per head (only `heads` are applied).
        from_position: first steered absolute position (padded coordinates, >= 0).

    The engine gives every head-output call its absolute positions (`call.q_offset`: the
    KV-cache length before the call), at prefill and at every decode step.
    """

    shift: torch.Tensor | None = None
    from_position: int = 0

    def is_identity(self) -> bool:
        return self.shift is None or not bool(self.shift.any())

    def acts_on(self, call: AttentionCall) -> bool:
        """The call reaches `from_position` (else it is skipped and not counted as fired)."""
        return call.q_offset + call.q_len > self.from_position

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        assert self.shift is not None  # an identity edit is never applied
        t = z.shape[1]
        first = max(0, self.from_position - call.q_offset)
        if first >= t:
            return z
        out = z.clone()
        out[:, first:] = z[:, first:] + self.shift.to(device=z.device, dtype=z.dtype)
        return out


def _finite(value: object, what: str) -> float:
    return check_number(what, value)


@dataclass(frozen=True)
class Iti:
    """Shift the outputs of chosen heads by `alpha * sigma * direction` while generating.

    Args:
        heads: K `(layer, head)` pairs, in the order of `directions` and `sigmas` (a
            `HeadSet` is taken in its (layer, head) order).
        directions: `[K, d_head]` directions (unit vectors in ITI; not renormalised).
        sigmas: `[K]` standard deviation of the activations along each direction (>= 0).
        alpha: strength (default 15, the paper's); 0 is a bitwise no-op (no edit is made).
        from_position: first steered absolute position of the padded prompt; negative counts
            from the prompt's end (default -1: the last prompt row, then every decode step).

    Raises:
        ValueError: a duplicate head, shapes that do not match K, non-finite directions,
            sigmas or alpha, a negative sigma, a non-int position; when applied, an unknown
            head or a direction length other than the model's d_head.

    Source: Li et al. 2023, §3.2 (eq. 2: x_{l+1} = x_l + sum_h Q_l^h (Att_l^h(P_l^h x_l) +
    alpha sigma_l^h theta_l^h)).
    """

    heads: HeadSet | Sequence[tuple[int, int]]  # stored as a tuple of (layer, head) pairs
    directions: torch.Tensor
    sigmas: torch.Tensor
    alpha: float = 15.0
    from_position: int = -1

    def __post_init__(self) -> None:
        heads = self.heads
        if isinstance(heads, HeadSet):
            pairs = list(heads.heads)
        elif isinstance(heads, (str, bytes)) or not isinstance(heads, Sequence):
            raise HeadsteerValueError(
                f"heads must be a list of (layer, head) pairs or a HeadSet, got {short_repr(heads)}"
            )
        else:
            pairs = []
            for x in heads:
                if not isinstance(x, (tuple, list)) or len(x) != 2:
                    raise HeadsteerValueError(f"expected a (layer, head) pair, got {short_repr(x)}")
                if any(not is_int(v) for v in x):
                    raise HeadsteerValueError(f"layer and head must be ints, got {short_repr(x)}")
                pairs.append((int(x[0]), int(x[1])))
        if len(set(pairs)) != len(pairs):
            raise HeadsteerValueError(f"duplicate heads in {pairs}")
        d = torch.as_tensor(self.directions, dtype=torch.float32).detach().cpu()
        s = torch.as_tensor(self.sigmas, dtype=torch.float32).detach().cpu()
        if d.ndim != 2 or d.shape[0] != len(pairs):
            raise HeadsteerValueError(
                f"directions must be [K={len(pairs)}, d_head], got shape {tuple(d.shape)}"
            )
        if s.shape != (len(pairs),):
            raise HeadsteerValueError(f"sigmas must be [K={len(pairs)}], got shape {tuple(s.shape)}")
        if not torch.isfinite(d).all():
            raise HeadsteerValueError("directions hold NaN or inf")
        if not torch.isfinite(s).all() or (s < 0).any():
            raise HeadsteerValueError(f"sigmas must be finite and >= 0, got {s.tolist()}")
        if abs(_finite(self.alpha, "alpha")) > MAX_FACTOR:
            raise HeadsteerValueError(
                f"alpha must have |alpha| <= {MAX_FACTOR:g}, got {short_repr(self.alpha)}"
            )
        if not pairs:
            warn_noop("ITI with no heads steers nothing: output equals the unsteered model")
        elif float(self.alpha) != 0 and not bool((d.abs().sum(1) * s).any()):
            warn_noop("ITI shifts are all zero (zero sigmas or directions): output equals the unsteered")
        if not is_int(self.from_position):
            raise HeadsteerValueError(f"from_position must be an int, got {short_repr(self.from_position)}")
        object.__setattr__(self, "heads", tuple(pairs))
        object.__setattr__(self, "directions", d)
        object.__setattr__(self, "sigmas", s)

    @classmethod
    def from_probes(
        cls,
        result: Any,
        k: int = 16,
        *,
        alpha: float = 15.0,
        direction: str = "mass_mean",
        by: str = "accuracy",
        from_position: int = -1,
    ) -> Iti:
        """ITI on the `k` best heads of a `probes.head_probes.ProbeResult`.

        Args:
            result: a fitted `ProbeResult` (anything with `ranked(k, by)`, `*_directions` and
                `*_sigma` `[L, H, ...]` tensors).
            k: heads to steer (default 16), by descending held-out `by` ("accuracy" / "auc").
            direction: "mass_mean" (default; the paper's best) or "probe" (the probe weights).

        Raises:
            ValueError: bad k or direction, or a chosen head without a direction (NaN).
        """
        check_int("k", k, lo=1)
        if direction not in ("mass_mean", "probe"):
            raise HeadsteerValueError(
                f"direction must be 'mass_mean' or 'probe', got {short_repr(direction)}"
            )
        heads = result.ranked(int(k), by=by)
        dirs = getattr(result, f"{direction}_directions")
        sig = getattr(result, f"{direction}_sigma")
        d = torch.stack([dirs[la, h] for la, h in heads])
        s = torch.stack([sig[la, h] for la, h in heads])
        if not torch.isfinite(d).all() or not torch.isfinite(s).all():
            raise HeadsteerValueError(
                f"a chosen head has no {direction} direction (NaN); use direction='mass_mean'"
            )
        return cls(heads=heads, directions=d, sigmas=s, alpha=alpha, from_position=from_position)

    def shifts(self, model: HeadModel) -> dict[int, torch.Tensor]:
        """`{layer: [n_heads, d_head]}` shifts `alpha * sigma * direction` (zero off the chosen heads).

        Raises:
            ValueError: unknown head, or directions not of length `model.d_head`.
        """
        pairs = cast(tuple[tuple[int, int], ...], self.heads)  # normalised in __post_init__
        HeadSet(pairs).check(model.n_layers, model.n_heads)
        if self.directions.shape[1] != model.d_head:
            raise HeadsteerValueError(
                f"directions have length {self.directions.shape[1]}, the model's d_head is {model.d_head}"
            )
        out: dict[int, torch.Tensor] = {}
        for (layer, head), theta, sigma in zip(pairs, self.directions, self.sigmas, strict=True):
            shift = out.setdefault(layer, torch.zeros(model.n_heads, model.d_head))
            shift[head] = float(self.alpha) * float(sigma) * theta
        if any(not bool(torch.isfinite(v).all()) for v in out.values()):
            raise HeadsteerValueError("ITI shift alpha * sigma * direction overflows float32 to inf")
        return out

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[ItiShift]:
        """One `ItiShift` per steered layer (none when alpha is 0: a bitwise no-op)."""
        shifts = self.shifts(model)
        if self.alpha == 0:
            return []
        start = self.from_position if self.from_position >= 0 else enc.length + self.from_position
        if start < 0:
            raise HeadsteerValueError(
                f"from_position {self.from_position} is before the prompt start (length {enc.length})"
            )
        by_layer: dict[int, list[int]] = {}
        for layer, head in self.heads:
            by_layer.setdefault(layer, []).append(head)
        return [
            ItiShift(layer=la, heads=sorted(hs), shift=shifts[la], from_position=start)
            for la, hs in sorted(by_layer.items())
        ]

    def __repr__(self) -> str:
        return f"Iti({len(self.heads)} heads, alpha={self.alpha}, from_position={self.from_position})"
