"""`PairEvaluation`: how well a model (steered or not) does on clean / corrupted prompt pairs.

The result of `heads.evaluate_pairs`: per pair, the logit difference LD = answer logit -
counterfactual logit at the last position and whether it is positive; the accuracy (share of
pairs with LD > 0) with its Wilson score interval and the mean LD with its Student-t interval.
Per-pair values are kept, so a further bootstrap (or a paired comparison of two evaluations on
the same pairs) is arithmetic, not another forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from heads._util.validation import check_number
from heads.errors import HeadsteerValueError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["PairEvaluation", "mean_interval", "wilson_interval"]


def wilson_interval(wins: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """`(low, high)` Wilson score interval of the share `wins / n` at confidence `level`.

    Unlike the normal approximation (and a bootstrap of 0 / 1 values) it stays inside [0, 1]
    and does not collapse to a point at 0 or n wins. Source: Wilson (1927), JASA 22(158).

    Raises:
        ValueError: `n` < 1, `wins` outside 0..n, `level` outside (0, 1).
    """
    from scipy.stats import norm

    if n < 1 or not 0 <= wins <= n:
        raise HeadsteerValueError(f"wilson_interval needs 0 <= wins <= n and n >= 1, got {wins} / {n}")
    level = check_number("level", level, lo=0, hi=1, lo_open=True, hi_open=True)
    z = float(norm.ppf(0.5 + level / 2))
    p = wins / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


def t_quantile(n: int, level: float = 0.95) -> float:
    """Student's t quantile of a two-sided `level` interval of a mean of `n` >= 2 values
    (`n - 1` degrees of freedom): 12.71 for 2 values, 2.26 for 10, 1.98 for 100 at 95 %."""
    from scipy.stats import t as student_t

    return float(student_t.ppf(0.5 + level / 2, n - 1))


def mean_interval(values: torch.Tensor, level: float = 0.95) -> tuple[float, float]:
    """`(low, high)` Student-t interval of the mean of `values` `[N]` at confidence `level`
    (mean -+ t_{N-1} * sd / sqrt(N)); `(nan, nan)` for fewer than 2 values.

    Raises:
        ValueError: `level` outside (0, 1).
    """
    level = check_number("level", level, lo=0, hi=1, lo_open=True, hi_open=True)
    x = values.double().flatten()
    n = x.numel()
    if n < 2:
        return float("nan"), float("nan")
    half = t_quantile(n, level) * float(x.std(unbiased=True)) / math.sqrt(n)
    m = float(x.mean())
    return m - half, m + half


@dataclass
class PairEvaluation:
    """Accuracy and logit difference of a model on N prompt pairs (`heads.evaluate_pairs`).

    Attributes:
        logit_diff: `[N]` float, per pair: mean answer logit - mean counterfactual logit at the
            last position (logits, i.e. nats of unnormalised log-odds).
        top1: `[N]` bool, per pair: the arg-max token is one of the answer tokens.
        which: the prompts run: `"clean"` or `"corrupted"`.
        steer: a description of each intervention applied (`repr`), empty when none.
        level: the confidence level of the intervals (default 0.95).
        params: free fields (model, batch_size, ...).
    """

    logit_diff: torch.Tensor
    top1: torch.Tensor
    which: str = "clean"
    steer: list[str] = field(default_factory=list)
    level: float = 0.95
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        """N, the number of pairs."""
        return int(self.logit_diff.numel())

    @property
    def correct(self) -> torch.Tensor:
        """`[N]` bool: LD > 0 (the answer beats the counterfactual)."""
        return self.logit_diff > 0

    @property
    def accuracy(self) -> float:
        """Share of pairs with LD > 0, in [0, 1]."""
        return float(self.correct.float().mean())

    @property
    def accuracy_ci(self) -> tuple[float, float]:
        """Wilson score interval of `accuracy` at `level` (`wilson_interval`)."""
        return wilson_interval(int(self.correct.sum()), self.n, self.level)

    @property
    def mean_logit_diff(self) -> float:
        """Mean LD over the pairs (logits)."""
        return float(self.logit_diff.double().mean())

    @property
    def logit_diff_ci(self) -> tuple[float, float]:
        """Student-t interval of `mean_logit_diff` at `level` (`mean_interval`)."""
        return mean_interval(self.logit_diff, self.level)

    @property
    def top1_accuracy(self) -> float:
        """Share of pairs whose arg-max token is an answer token."""
        return float(self.top1.float().mean())

    def summary(self) -> dict[str, Any]:
        """`{"n", "which", "steer", "accuracy", "accuracy_ci", "logit_diff", "logit_diff_ci",
        "top1", "level"}` as plain floats (JSON-ready)."""
        lo, hi = self.logit_diff_ci
        return {
            "n": self.n,
            "which": self.which,
            "steer": list(self.steer),
            "accuracy": self.accuracy,
            "accuracy_ci": list(self.accuracy_ci),
            "logit_diff": self.mean_logit_diff,
            "logit_diff_ci": [lo, hi],
            "top1": self.top1_accuracy,
            "level": self.level,
        }

    def to_frame(self) -> pd.DataFrame:
        """One row per pair: `pair, logit_diff, correct, top1`."""
        import pandas as pd

        return pd.DataFrame(
            {
                "pair": range(self.n),
                "logit_diff": self.logit_diff.double().numpy(),
                "correct": self.correct.numpy(),
                "top1": self.top1.numpy(),
            }
        )

    def __repr__(self) -> str:
        a_lo, a_hi = self.accuracy_ci
        d_lo, d_hi = self.logit_diff_ci
        pct = round(self.level * 100)
        steer = f", steer={self.steer}" if self.steer else ""
        return (
            f"PairEvaluation({self.which}, n={self.n}{steer}: accuracy {self.accuracy:.3f} "
            f"[{a_lo:.3f}, {a_hi:.3f}], logit diff {self.mean_logit_diff:.3f} "
            f"[{d_lo:.3f}, {d_hi:.3f}], {pct}% intervals)"
        )
