"""`CircuitRequest`: the parameters of circuit discovery (`heads.find_circuit`), as one checked
value (see `heads.scorers.request_base`). The edge counts `n` and `confirm` are bounded by the
model's graph (`check_config`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from heads._util.validation import check_bool, check_int, check_number, short_repr
from heads.errors import HeadsteerValueError
from heads.results.stability import check_stability
from heads.scorers.patching.metrics import Metric, get_metric
from heads.scorers.request_base import Geometry, Request, check_choice

__all__ = ["DEFAULT_STEPS", "MAX_STEPS", "METHODS", "SIZES", "CircuitRequest", "check_sizes"]

METHODS = ("eap", "eap-ig", "exact")
"""`method=` values: edge attribution patching, its integrated-gradients form, exact patching."""

MAX_STEPS = 100
"""The most EAP-IG interpolation steps (each is a forward and backward over every pair)."""

DEFAULT_STEPS = 5
"""EAP-IG's interpolation steps by default (Hanna et al. 2024 use 5)."""

SIZES = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
"""Default circuit sizes of the faithfulness curve, in % of the graph's edges (MIB)."""


def check_sizes(sizes: Any, name: str = "sizes") -> tuple[float, ...]:
    """`sizes` (a non-empty list of real numbers in (0, 100], never a string or bool) as a sorted
    tuple of distinct floats.

    Raises:
        HeadsteerValueError: anything else, naming `name`.
    """
    if hasattr(sizes, "tolist") and not isinstance(sizes, (list, tuple)):
        sizes = sizes.tolist()
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, (list, tuple, range)):
        raise HeadsteerValueError(
            f"{name} must be a list of numbers in (0, 100] (% of edges), got {short_repr(sizes)}"
        )
    if not len(sizes):
        raise HeadsteerValueError(
            f"{name} must be a non-empty list of numbers in (0, 100], got {short_repr(sizes)}"
        )
    vals = tuple(
        check_number(name, s, lo=0, hi=100, lo_open=True, what="numbers in (0, 100] (% of edges)")
        for s in sizes
    )
    return tuple(sorted(set(vals)))


@dataclass(frozen=True)
class CircuitRequest(Request):
    """Circuit discovery: edge scores, the circuit, its faithfulness (`heads.find_circuit`).

    Attributes:
        method: `"eap"`, `"eap-ig"` (default) or `"exact"`.
        n: the circuit is the top `n` edges. At most one of `n`, `size`, `threshold`,
            `faithfulness` (default: the smallest size of `sizes` reaching
            `heads.scorers.circuits.DEFAULT_FAITHFULNESS`, 0.3).
        size: the circuit is the top `size` % of the edges.
        threshold: the circuit is every edge with |score| >= threshold.
        faithfulness: the circuit is the smallest size of `sizes` whose faithfulness reaches it.
        steps: EAP-IG interpolation steps (default 5; 1..100; only `"eap-ig"` takes another value).
        metric: `"logit_diff"` (default), another `heads.scorers.patching.metrics` name, a `Metric`
            or a function (not JSON).
        confirm: rerun the top `confirm` edges exactly (default 0).
        curve: also compute the faithfulness curve over `sizes` (default True).
        sizes: the curve's circuit sizes, % of edges (default `SIZES`).
        stability: bootstrap resamples of the pairs for each edge's inclusion frequency (0: none).

    Raises:
        HeadsteerValueError: two of n / size / threshold / faithfulness, an unknown method or
            metric, steps out of range or given to a method without steps, a size outside (0, 100],
            a negative confirm; `check_config`: `n` or `confirm` beyond the model graph's edges.
    """

    NAME = "find_circuit"

    method: str = "eap-ig"
    n: int | None = None
    size: float | None = None
    threshold: float | None = None
    steps: int = DEFAULT_STEPS
    metric: str | Metric | Callable[..., Any] = "logit_diff"
    confirm: int = 0
    curve: bool = True
    sizes: Sequence[float] = SIZES
    stability: int = 0
    faithfulness: float | None = None

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.n, self.size, self.threshold, self.faithfulness)) > 1:
            raise HeadsteerValueError("give at most one of n=, size=, threshold= or faithfulness=")
        check_choice("method", self.method, METHODS)
        steps = check_int("steps", self.steps, lo=1, hi=MAX_STEPS)
        if self.method != "eap-ig" and steps != DEFAULT_STEPS:
            raise HeadsteerValueError(
                f"steps={steps} is only used by method='eap-ig', not method={self.method!r}"
            )
        object.__setattr__(self, "steps", steps)
        get_metric(self.metric)
        if self.n is not None:
            object.__setattr__(self, "n", check_int("n", self.n, lo=1))
        if self.size is not None:
            object.__setattr__(self, "size", check_sizes([self.size], "size")[0])
        if self.threshold is not None:
            object.__setattr__(self, "threshold", check_number("threshold", self.threshold))
        if self.faithfulness is not None:
            object.__setattr__(self, "faithfulness", check_number("faithfulness", self.faithfulness))
        object.__setattr__(self, "confirm", check_int("confirm", self.confirm, lo=0))
        check_bool("curve", self.curve)
        object.__setattr__(self, "sizes", check_sizes(self.sizes))
        object.__setattr__(self, "stability", check_stability(self.stability))

    def check_geometry(self, geometry: Geometry) -> None:
        from heads.scorers.circuits.layout import Graph

        edges = Graph(geometry.n_layers, geometry.n_heads, geometry.n_kv_heads).n_edges
        if self.n is not None:
            check_int("n", self.n, lo=1, hi=edges)
        check_int("confirm", self.confirm, lo=0, hi=edges)
