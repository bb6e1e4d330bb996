"""Metrics of a patched run and their normalisation (denoising / noising).

A metric maps the last-position logits of some batch rows to one number per row. Built-ins
(Wang et al. 2022, Sec. 3; Zhang & Nanda 2024, Sec. 3 on metric choice):

* `"logit_diff"` (default): mean answer logit - mean counterfactual logit (LD = logit[c] -
  logit[w] for single tokens). Needs counterfactual tokens.
* `"log_prob"`: log p(answer) (log of the summed probability of the answer tokens).
* `"prob"`: p(answer) (summed over the answer tokens).
* `"kl"`: KL(p_clean || p_patched) over the vocabulary, with p_clean the clean run's
  next-token distribution of the same pair (0 on the clean run).
* a user function `fn(logits [R, V] fp32, pairs: PairBatch, index [R] long) -> [R]`; it may
  be differentiable (EAP takes its gradient).

Normalised scores (`normalise`): denoising (patch clean values into the corrupted run)
`(M(patched) - M(corrupt)) / (M(clean) - M(corrupt))`: 0 = no recovery, 1 = the clean
behaviour restored. Noising (patch corrupted values into the clean run)
`(M(patched) - M(clean)) / (M(corrupt) - M(clean))`: 1 = the whole effect destroyed. A pair
whose clean and corrupted metrics are equal (|gap| <= `tol`) has no scale: its normalised
scores are NaN and a warning names it; nothing is divided by zero. `normalise`, `zero_gap`,
`DIRECTIONS` and `ZeroGapWarning` live with the result (`heads.results.patching`) and are imported
here under the same names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from heads._util.validation import short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.patching import DIRECTIONS, ZeroGapWarning, normalise, zero_gap
from heads.scorers.patching.pairs import PairBatch

__all__ = [
    "DIRECTIONS",
    "METRICS",
    "Metric",
    "ZeroGapWarning",
    "get_metric",
    "log_prob",
    "logit_diff",
    "normalise",
    "prob",
    "token_columns",
    "zero_gap",
]


UserMetric = Callable[[torch.Tensor, PairBatch, torch.Tensor], torch.Tensor]


def _gather_mean(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[R]` mean of each row's logits at its real token slots (`mask`); padded slots are never
    read: their id is a placeholder whose logit may be anything, NaN included (the sweeps
    compute only the answer columns, `unembed_only`), and NaN * 0 is NaN."""
    vals = logits.gather(-1, ids.to(logits.device))
    m = mask.to(logits.device).bool()
    return torch.where(m, vals, 0.0).sum(-1) / m.sum(-1).clamp(min=1)


def logit_diff(logits: torch.Tensor, pairs: PairBatch, index: torch.Tensor) -> torch.Tensor:
    """`[R]` mean answer logit minus mean counterfactual logit of pairs `index` (`logits [R, V]`).

    Raises:
        ValueError: a pair without counterfactual tokens.
    """
    cm = pairs.counterfactual_mask[index]
    if not bool(cm.any(-1).all()):
        bad = index[~cm.any(-1)].tolist()
        raise HeadsteerValueError(f"logit_diff needs counterfactual tokens; pairs {bad} have none")
    a = _gather_mean(logits, pairs.answers[index], pairs.answer_mask[index])
    return a - _gather_mean(logits, pairs.counterfactuals[index], cm)


def log_prob(logits: torch.Tensor, pairs: PairBatch, index: torch.Tensor) -> torch.Tensor:
    """`[R]` log of the total probability of the answer tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals = logp.gather(-1, pairs.answers[index].to(logits.device))
    vals = vals.masked_fill(~pairs.answer_mask[index].to(logits.device), float("-inf"))
    return torch.logsumexp(vals, dim=-1)


def prob(logits: torch.Tensor, pairs: PairBatch, index: torch.Tensor) -> torch.Tensor:
    """`[R]` total probability of the answer tokens."""
    return log_prob(logits, pairs, index).exp()


def _kl(logits: torch.Tensor, clean_logits: torch.Tensor) -> torch.Tensor:
    p = torch.log_softmax(clean_logits.float(), dim=-1)
    q = torch.log_softmax(logits.float(), dim=-1)
    return (p.exp() * (p - q)).sum(-1)


@dataclass(frozen=True)
class Metric:
    """A metric of last-position logits.

    Attributes:
        name: `"logit_diff"`, `"log_prob"`, `"prob"`, `"kl"` or the user function's name.
        fn: `(logits [R, V], pairs, index [R]) -> [R]`, or for `needs_clean` metrics
            `(logits, clean_logits [R, V]) -> [R]`.
        needs_clean: the metric compares with the clean run's logits (KL).
        needs_counterfactual: the metric reads the counterfactual tokens.
        columns: optional `columns(pairs) -> [K]` long: the only vocabulary columns `fn`
            reads (of every row); the sweeps then unembed only those columns and fill the
            others with NaN (`logit_diff`: the answer and counterfactual tokens). None
            (default, and for user functions): `fn` may read every column.
    """

    name: str
    fn: Callable
    needs_clean: bool = False
    needs_counterfactual: bool = False
    columns: Callable[[PairBatch], torch.Tensor] | None = None

    def __call__(
        self,
        logits: torch.Tensor,
        pairs: PairBatch,
        index: torch.Tensor | None = None,
        clean_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`[R]` fp32 metric of rows `logits [R, V]` belonging to pairs `index` (default all).

        `clean_logits [R, V]`: the clean run's last-position logits of the same pairs (needed
        by KL only).
        """
        if index is None:
            index = torch.arange(pairs.n)
        index = torch.as_tensor(index, dtype=torch.long)
        if self.needs_clean:
            if clean_logits is None:
                raise HeadsteerValueError(f"metric {short_repr(self.name)} needs the clean logits")
            return self.fn(logits.float(), clean_logits.float())
        out = self.fn(logits.float(), pairs, index)
        if not isinstance(out, torch.Tensor) or out.shape != (logits.shape[0],):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise HeadsteerValueError(
                f"metric {short_repr(self.name)} must return one value per row, shape "
                f"({logits.shape[0]},), got {got}"
            )
        return out.float()

    def check(self, pairs: PairBatch) -> None:
        """ValueError before any forward when the pairs lack what the metric reads."""
        if self.needs_counterfactual and not pairs.has_counterfactual:
            bad = torch.nonzero(~pairs.counterfactual_mask.any(-1)).flatten().tolist()
            raise HeadsteerValueError(
                f"metric {short_repr(self.name)} needs a counterfactual token in every pair; pairs "
                f"{bad[:10]} have none"
            )


def token_columns(pairs: PairBatch) -> torch.Tensor:
    """`[K]` long: the distinct answer and counterfactual token ids of `pairs` (what
    `logit_diff` reads)."""
    ids = (pairs.answers[pairs.answer_mask], pairs.counterfactuals[pairs.counterfactual_mask])
    return torch.unique(torch.cat(ids).long())


METRICS: dict[str, Metric] = {
    "logit_diff": Metric("logit_diff", logit_diff, needs_counterfactual=True, columns=token_columns),
    "log_prob": Metric("log_prob", log_prob),
    "prob": Metric("prob", prob),
    "kl": Metric("kl", _kl, needs_clean=True),
}
"""The built-in metrics by name."""


def get_metric(metric: str | Metric | UserMetric = "logit_diff") -> Metric:
    """A `Metric` from a name in `METRICS`, a `Metric`, or a user function
    `fn(logits [R, V], pairs, index [R]) -> [R]`.

    Raises:
        ValueError: an unknown name (lists the known ones).
        TypeError: anything else.
    """
    if isinstance(metric, Metric):
        return metric
    if isinstance(metric, str):
        if metric not in METRICS:
            raise HeadsteerValueError(
                f"unknown metric {short_repr(metric)}; use one of {sorted(METRICS)} or a function"
            )
        return METRICS[metric]
    if callable(metric):
        return Metric(getattr(metric, "__name__", "user"), metric)
    raise HeadsteerTypeError(f"metric must be a name, a Metric or a function, got {type(metric).__name__}")


Run = TypeVar("Run")
"""A recorded run with `logits` (a full `RunCache`, the lean path's `LeanRun`)."""


def base_and_source(
    clean: Run, corrupt: Run, pairs: PairBatch, met: Any, direction: str
) -> tuple[Run, Run, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A patching sweep's two recorded runs in the roles `direction` gives them: `(base run (the
    one patched: corrupted when denoising, clean when noising), source run, the base run's ids
    [N, T], clean metric [N], corrupted metric [N], the base run's metric [N])`, the metrics
    `met(logits, pairs, index, clean logits)` of each run's `logits`."""
    idx = torch.arange(pairs.n)
    clean_logits = clean.logits  # type: ignore[attr-defined]
    m_clean = met(clean_logits, pairs, idx, clean_logits)
    m_corrupt = met(corrupt.logits, pairs, idx, clean_logits)  # type: ignore[attr-defined]
    if direction == "denoising":
        return corrupt, clean, pairs.ids("corrupted"), m_clean, m_corrupt, m_corrupt
    return clean, corrupt, pairs.ids("clean"), m_clean, m_corrupt, m_clean
