"""The requests of the sink analyses: attention-sink statistics (`SinkStatsRequest`,
`heads.sink_stats`) and massive-activation sink dimensions (`SinkDimsRequest`,
`heads.find_sink_dims`), as checked values (see `heads.scorers.request_base`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from heads._util.validation import check_bool, check_int, check_number, is_number, short_repr
from heads.errors import HeadsteerValueError
from heads.scorers.request_base import Geometry, Request, check_choice

__all__ = ["EXEMPTIONS", "SINK_RULES", "SinkDimsRequest", "SinkStatsRequest", "check_sink_rule"]

SINK_RULES = ("relative", "absolute")
"""How a column is flagged as a sink: against the row's mean share (`"relative"`) or a fixed share."""

EXEMPTIONS = ("position", "first_flagged")
"""Which sink is exempt from ACT's redistribution: the first position, or the first flagged column."""


def check_sink_rule(
    rule: object, alpha_s: object, theta: object, exempt: object, min_support: object
) -> tuple[float, float, int]:
    """The checks of a sink rule's fields, shared by `SinkStatsRequest` and
    `heads.scorers.sinks.SinkRule`: `(alpha_s, theta, min_support)` as numbers.

    Raises:
        HeadsteerValueError: an unknown rule or exemption, alpha_s / theta not > 0, min_support < 1.
    """
    if not isinstance(rule, str) or rule not in SINK_RULES:
        raise HeadsteerValueError(
            f"rule must be one of {', '.join(SINK_RULES)} (the sink rule), got {short_repr(rule)}"
        )
    check_choice("exempt", exempt, EXEMPTIONS)
    a = check_number("alpha_s", alpha_s, lo=0, lo_open=True)
    t = check_number("theta", theta, lo=0, lo_open=True)
    return a, t, check_int("min_support", min_support, lo=1)


@dataclass(frozen=True)
class SinkStatsRequest(Request):
    """Per-head attention-sink statistics of the prompts' prefill patterns (`heads.sink_stats`);
    the rule fields are those of `heads.scorers.sinks.SinkRule`.

    Attributes:
        rule: `"relative"` (default) or `"absolute"`.
        alpha_s: the relative rule's factor over the mean share (default 5).
        theta: the absolute rule's share (default 0.1).
        exempt: `"position"` (default) or `"first_flagged"`.
        min_support: rows a column needs to be judged (default 1).
        chat: apply the chat template (default None: when the tokenizer has one).
        markup: read `**span**` markup as `SteeredModel.generate` does (default True).

    Raises:
        HeadsteerValueError: an unknown rule / exemption, a non-positive alpha_s / theta / support.
    """

    NAME = "sink_stats"

    rule: Literal["relative", "absolute"] = "relative"
    alpha_s: float = 5.0
    theta: float = 0.1
    exempt: Literal["position", "first_flagged"] = "position"
    min_support: int = 1
    chat: bool | None = None
    markup: bool = True

    def __post_init__(self) -> None:
        alpha_s, theta, support = check_sink_rule(
            self.rule, self.alpha_s, self.theta, self.exempt, self.min_support
        )
        object.__setattr__(self, "alpha_s", alpha_s)
        object.__setattr__(self, "theta", theta)
        object.__setattr__(self, "min_support", support)
        if self.chat is not None:
            check_bool("chat", self.chat, what="None, True or False")
        check_bool("markup", self.markup)


@dataclass(frozen=True)
class SinkDimsRequest(Request):
    """The residual dimensions carrying the massive activations behind attention sinks
    (`heads.find_sink_dims`).

    Attributes:
        from_layer: first layer whose residual is read (default 2).
        max_dims: the most dimensions returned (default 3).
        min_ratio: a dimension's median |x| / rms at the first token must exceed this (default 100).

    Raises:
        HeadsteerValueError: a bad value, named; `check_config`: `from_layer` beyond the model.
    """

    NAME = "find_sink_dims"

    from_layer: int = 2
    max_dims: int = 3
    min_ratio: float = 100.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "from_layer", check_int("from_layer", self.from_layer, lo=0))
        object.__setattr__(self, "max_dims", check_int("max_dims", self.max_dims, lo=1))
        r = self.min_ratio
        if not is_number(r) or not r > 1 or not math.isfinite(r):
            raise HeadsteerValueError(f"min_ratio must be a number > 1, got {short_repr(r)}")
        object.__setattr__(self, "min_ratio", float(r))

    def check_geometry(self, geometry: Geometry) -> None:
        if self.from_layer >= geometry.n_layers:
            raise HeadsteerValueError(
                f"from_layer must be an int in 0..{geometry.n_layers - 1}, got {self.from_layer}"
            )
