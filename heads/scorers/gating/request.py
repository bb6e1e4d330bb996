"""`GatingRequest`: the parameters of contrastive head gating (`heads.gate_heads`), as a checked
value (see `heads.scorers.request_base`). The `GateTask` is the input."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from heads._util.validation import check_int, check_number, check_seed, short_repr
from heads.errors import HeadsteerValueError
from heads.results.stability import check_stability
from heads.scorers.request_base import Geometry, Request, check_head_pairs
from heads.scorers.stability import check_samples

__all__ = ["MAX_MASKS", "MAX_STEPS", "GatingRequest", "check_init"]

MAX_STEPS = 100_000
"""Upper bound on `steps` / `reg_steps` (the paper trains 500 per stage)."""

MAX_MASKS = 64
"""Upper bound on `n_masks` (each gate set copies every batch row once)."""


def check_init(init: object) -> tuple[float, float]:
    """`(low, high)` in [0, 1] with low <= high: the uniform range the gate logits start in.

    Raises:
        HeadsteerValueError: anything else, named.
    """
    if isinstance(init, (str, bytes)) or not isinstance(init, Sequence) or len(init) != 2:
        raise HeadsteerValueError(f"init must be a pair (low, high) in [0, 1], got {short_repr(init)}")
    lo = check_number("init low", init[0], lo=0.0, hi=1.0)
    hi = check_number("init high", init[1], lo=0.0, hi=1.0)
    if lo > hi:
        raise HeadsteerValueError(f"init must have low <= high, got {short_repr(init)}")
    return lo, hi


@dataclass(frozen=True)
class GatingRequest(Request):
    """Contrastive head gating (CHG, Wang et al. 2025): fit a gate per head on a task.

    Attributes:
        steps: optimisation steps of the unregularised fit (default 500; at most `MAX_STEPS`).
        reg_steps: steps of the regularised fits (default None: `steps`).
        lr: Adam learning rate (default 1.0).
        reg_weight: weight of the gate regulariser (default 0.1; >= 0).
        clamp: gate logits are clamped to +-clamp (default 4).
        batch_size: task examples per step (default 32).
        grad_norm: gradient-norm clip (default 1.0; None: no clip).
        init: the uniform range the gates start in (default (0, 1)).
        n_masks: fits from different random starts (default 1; at most `MAX_MASKS`).
        heads: the heads gated (default None: all).
        threshold: the gate value separating facilitating / interfering heads (default 0.5).
        seed: seeds the fits (default 0).
        stability: bootstrap resamples over the fits (0: none; needs n_masks >= 2).

    Raises:
        HeadsteerValueError: a value out of range, named; `check_config`: heads out of range.
    """

    NAME = "gate_heads"

    steps: int = 500
    reg_steps: int | None = None
    lr: float = 1.0
    reg_weight: float = 0.1
    clamp: float = 4.0
    batch_size: int = 32
    grad_norm: float | None = 1.0
    init: tuple[float, float] = (0.0, 1.0)
    n_masks: int = 1
    heads: Sequence[tuple[int, int]] | None = None
    threshold: float = 0.5
    seed: int = 0
    stability: int = 0

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "steps", check_int("steps", self.steps, lo=1))
        if self.reg_steps is not None:
            set_(self, "reg_steps", check_int("reg_steps", self.reg_steps, lo=1))
        most = max(self.steps, self.reg_steps or 0)
        if most > MAX_STEPS:
            raise HeadsteerValueError(f"steps and reg_steps must be at most {MAX_STEPS}, got {most}")
        set_(self, "lr", check_number("lr", self.lr, lo=0.0, lo_open=True, hi=1e6))
        set_(self, "reg_weight", check_number("reg_weight", self.reg_weight, lo=0.0))
        set_(self, "clamp", check_number("clamp", self.clamp, lo=0.0, lo_open=True))
        set_(self, "batch_size", check_int("batch_size", self.batch_size, lo=1))
        if self.grad_norm is not None:
            set_(self, "grad_norm", check_number("grad_norm", self.grad_norm, lo=0.0, lo_open=True))
        set_(self, "init", check_init(self.init))
        set_(self, "n_masks", check_int("n_masks", self.n_masks, lo=1))
        if self.n_masks > MAX_MASKS:
            raise HeadsteerValueError(f"n_masks must be at most {MAX_MASKS}, got {self.n_masks}")
        heads = check_head_pairs("heads", self.heads)
        if heads is not None and not heads:
            raise HeadsteerValueError("heads selects no head: nothing to gate")
        set_(self, "heads", heads)
        set_(
            self,
            "threshold",
            check_number("threshold", self.threshold, lo=0.0, hi=1.0, lo_open=True, hi_open=True),
        )
        set_(self, "seed", check_seed("seed", self.seed))
        stability = check_stability(self.stability)
        check_samples(self.n_masks, stability, "gate fits (n_masks)")
        set_(self, "stability", stability)

    def check_geometry(self, geometry: Geometry) -> None:
        for la, h in self.heads or ():
            geometry.check_head("heads", la, h)
