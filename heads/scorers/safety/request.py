"""The requests of the safety-head scorers: Ships (`ShipsRequest`), dataset-level Ships
(`DatasetShipsRequest`), Sahara (`SaharaRequest`) and attribution patching, AtP
(`AttributionRequest`), as checked values (see `heads.scorers.request_base`). The prompts are the
input, checked when the scorer runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from heads._util.validation import check_bool, check_int, check_number, short_repr
from heads.errors import HeadsteerValueError
from heads.results.stability import check_stability
from heads.scorers.request_base import Geometry, Request, check_choice, check_head_pairs

__all__ = [
    "ABLATIONS",
    "ATTRIBUTION_ABLATIONS",
    "DEFAULT_TEMPLATE",
    "SHIPS_METHODS",
    "AttributionRequest",
    "DatasetShipsRequest",
    "SaharaRequest",
    "ShipsRequest",
    "check_template",
]

ABLATIONS = ("ua", "sc")
"""Ships' head ablations: the query scaled by eps (`"ua"`) or the output scaled by eps (`"sc"`)."""

ATTRIBUTION_ABLATIONS = ("ua", "sc", "zero", "mean")
"""The ablations attribution patching estimates (a callable `layer -> Edit` also, not JSON)."""

SHIPS_METHODS = ("exact", "attribution")
"""`ships(method=)`: every head ablated exactly, or estimated in one pass and the top confirmed."""

DEFAULT_TEMPLATE = "Query: {query}\nAnswer:"
"""The prompt template of the safety scorers (Zhou et al. 2024's)."""


Ablation = Literal["ua", "sc"]
ShipsMethod = Literal["exact", "attribution"]


def check_template(template: object) -> str | None:
    """None, or a string containing `{query}` (the one placeholder the scorers fill).

    Raises:
        HeadsteerValueError: anything else.
    """
    if template is None:
        return None
    if not isinstance(template, str) or "{query}" not in template:
        raise HeadsteerValueError(
            f"template must be None or a string containing '{{query}}', got {short_repr(template)}"
        )
    return template


CONTROLS = 10  # the default number of random control heads (`controls=None`)


def control_count(controls: int | None, left: int) -> int:
    """How many random control heads to rerun beside the confirmed ones.

    Args:
        controls: the number asked for (None: `CONTROLS`, or every head left when fewer).
        left: the heads scored and not confirmed (those the controls are drawn from).

    Raises:
        HeadsteerValueError: `controls` not an int in `0..left`, the value named (a larger
            count used to be cut to `left` silently).
    """
    if controls is None:
        return min(CONTROLS, left)
    what = f"an int in 0..{left} (the heads scored and not confirmed)"
    return check_int("controls", controls, lo=0, hi=left, what=what)


def _heads(geometry: Geometry, heads: Sequence[tuple[int, int]] | None) -> None:
    for la, h in heads or ():
        geometry.check_head("heads", la, h)


def _common(req: Any) -> None:
    """The checks every Ships-family request shares: heads, ablation, eps, exact, template."""
    object.__setattr__(req, "heads", check_head_pairs("heads", req.heads))
    check_choice("ablation", req.ablation, ABLATIONS)
    object.__setattr__(req, "eps", check_number("eps", req.eps, lo=0, hi=1, what="a number in [0, 1]"))
    check_bool("exact", req.exact, what="a bool")
    check_template(req.template)


@dataclass(frozen=True)
class ShipsRequest(Request):
    """Ships: each head ablated alone, the KL of the next-token distribution (`heads.ships`).

    Attributes:
        heads: heads to score (`(layer, head)` pairs or `{layer: [heads]}`; default None: all).
        ablation: `"ua"` (query x eps, default) or `"sc"` (output x eps).
        eps: the ablation scale (default 1e-5; in [0, 1]); `exact=True` uses 0.
        exact: ablate with eps = 0 (default False).
        template: the prompt template, containing `{query}` (default `DEFAULT_TEMPLATE`; None:
            the prompts as given).
        method: `"exact"` (default) or `"attribution"` (estimate, then confirm the top heads).
        confirm: heads rerun exactly after the estimate (method `"attribution"`; default 0).
        controls: random heads rerun exactly beside them (default None: 10, or every head not
            confirmed when fewer are left; a number asked for is at most the heads left).
        stability: bootstrap resamples of the prompts (0: none).

    Raises:
        HeadsteerValueError: a bad value, named; `confirm` without `method="attribution"`;
            `check_config`: heads out of range, more `confirm` heads than heads scored, or
            more `controls` than the heads left after them (method `"attribution"`).
    """

    NAME = "ships"

    heads: Sequence[tuple[int, int]] | None = None
    ablation: Ablation = "ua"
    eps: float = 1e-5
    exact: bool = False
    template: str | None = DEFAULT_TEMPLATE
    method: ShipsMethod = "exact"
    confirm: int = 0
    controls: int | None = None
    stability: int = 0

    def __post_init__(self) -> None:
        _common(self)
        check_choice("method", self.method, SHIPS_METHODS)
        object.__setattr__(self, "confirm", check_int("confirm", self.confirm, lo=0))
        if self.controls is not None:
            object.__setattr__(self, "controls", check_int("controls", self.controls, lo=0))
        if self.method == "exact" and self.confirm:
            raise HeadsteerValueError(f"confirm={self.confirm} needs method='attribution'")
        object.__setattr__(self, "stability", check_stability(self.stability))

    def check_geometry(self, geometry: Geometry) -> None:
        _heads(geometry, self.heads)
        if self.method == "attribution":  # the confirmed heads come from the heads scored
            n = len(self.heads) if self.heads is not None else geometry.n_layers * geometry.n_heads
            check_int("confirm", self.confirm, lo=0, hi=n)
            control_count(self.controls, n - self.confirm)


@dataclass(frozen=True)
class DatasetShipsRequest(Request):
    """Dataset-level Ships: the principal angle between the prompts' final states with and
    without each head (`heads.dataset_ships`).

    Attributes:
        heads: as `ShipsRequest`.
        ablation: as `ShipsRequest`.
        eps: as `ShipsRequest`.
        exact: as `ShipsRequest`.
        template: as `ShipsRequest`.
        r_main: dimensions of the main subspace (default 1; at most the number of prompts).
        degrees: report angles in degrees (default False: radians).
    """

    NAME = "dataset_ships"

    heads: Sequence[tuple[int, int]] | None = None
    ablation: Ablation = "ua"
    eps: float = 1e-5
    exact: bool = False
    r_main: int = 1
    degrees: bool = False
    template: str | None = DEFAULT_TEMPLATE

    def __post_init__(self) -> None:
        _common(self)
        object.__setattr__(self, "r_main", check_int("r_main", self.r_main, lo=1))
        check_bool("degrees", self.degrees, what="a bool")

    def check_geometry(self, geometry: Geometry) -> None:
        _heads(geometry, self.heads)


@dataclass(frozen=True)
class SaharaRequest(Request):
    """Sahara: greedy growth of a head group by dataset-level Ships (`heads.sahara`).

    Attributes:
        steps: greedy steps, the group's final size (default 3; at most the number of heads).
        heads: as `DatasetShipsRequest`.
        ablation: as `DatasetShipsRequest`.
        eps: as `DatasetShipsRequest`.
        exact: as `DatasetShipsRequest`.
        r_main: as `DatasetShipsRequest`.
        template: as `DatasetShipsRequest`.
    """

    NAME = "sahara"

    steps: int = 3
    heads: Sequence[tuple[int, int]] | None = None
    ablation: Ablation = "ua"
    eps: float = 1e-5
    exact: bool = False
    r_main: int = 1
    template: str | None = DEFAULT_TEMPLATE

    def __post_init__(self) -> None:
        _common(self)
        object.__setattr__(self, "steps", check_int("steps", self.steps, lo=1))
        if self.heads is not None and self.steps > len(self.heads):
            raise HeadsteerValueError(f"steps must be an int in 1..{len(self.heads)}, got {self.steps}")
        object.__setattr__(self, "r_main", check_int("r_main", self.r_main, lo=1))

    def check_geometry(self, geometry: Geometry) -> None:
        _heads(geometry, self.heads)
        n = len(self.heads) if self.heads is not None else geometry.n_layers * geometry.n_heads
        if self.steps > n:
            raise HeadsteerValueError(f"steps must be an int in 1..{n}, got {self.steps}")


@dataclass(frozen=True)
class AttributionRequest(Request):
    """Attribution patching (AtP, Nanda 2023; AtP*, Kramar et al. 2024) of every head's ablation
    effect on the next-token distribution, in one forward and backward pass
    (`heads.attribution_patching`).

    Attributes:
        heads: heads estimated (pairs; default None: all).
        ablation: `"ua"` (default), `"sc"`, `"zero"`, `"mean"` or a callable `layer -> Edit` (not JSON).
        eps: as `ShipsRequest`.
        exact: as `ShipsRequest`.
        template: as `ShipsRequest`.
        metric: `"kl"` (default) or a callable `(logp, prompt_index) -> [R]` (not JSON).
        kl_tokens: tokens of the truncated KL (default 4; at most the vocabulary - 1, checked by
            `check_config`).
        saturation_fix: AtP*'s query-key fix for saturated softmax (default True).
        graddrop: AtP*'s GradDrop, one backward per layer dropped (default False).
        stability: bootstrap resamples of the prompts (0: none).

    Raises:
        HeadsteerValueError: a bad value, named; `check_config`: heads out of range, graddrop on a
            one-layer model, `kl_tokens` not below the vocabulary.
    """

    NAME = "attribution_patching"

    heads: Sequence[tuple[int, int]] | None = None
    ablation: str | Callable[[int], Any] = "ua"
    eps: float = 1e-5
    exact: bool = False
    metric: str | Callable[..., Any] = "kl"
    kl_tokens: int = 4
    saturation_fix: bool = True
    graddrop: bool = False
    template: str | None = DEFAULT_TEMPLATE
    stability: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "heads", check_head_pairs("heads", self.heads))
        if not callable(self.ablation):
            if self.ablation not in ATTRIBUTION_ABLATIONS:
                raise HeadsteerValueError(
                    f"unknown ablation {short_repr(self.ablation)}: use one of {ATTRIBUTION_ABLATIONS} or a "
                    "callable layer -> Edit"
                )
        object.__setattr__(self, "eps", check_number("eps", self.eps, lo=0, hi=1))
        for name in ("exact", "saturation_fix", "graddrop"):
            check_bool(name, getattr(self, name), what="a bool")
        if not (self.metric == "kl" or callable(self.metric)):
            raise HeadsteerValueError(
                "metric must be 'kl' or a callable (logp, prompt_index) -> [R], got "
                f"{short_repr(self.metric)}"
            )
        object.__setattr__(self, "kl_tokens", check_int("kl_tokens", self.kl_tokens, lo=1))
        check_template(self.template)
        object.__setattr__(self, "stability", check_stability(self.stability))

    def check_geometry(self, geometry: Geometry) -> None:
        _heads(geometry, self.heads)
        if self.graddrop and geometry.n_layers < 2:
            raise HeadsteerValueError("graddrop needs at least 2 layers")
        if geometry.d_vocab is not None and self.kl_tokens > geometry.d_vocab - 1:
            raise HeadsteerValueError(
                f"kl_tokens must be an int in 1..{geometry.d_vocab - 1}, got {short_repr(self.kl_tokens)}"
            )
