"""The explorer's steering request: one method, its one parameter and the clicked heads.

`POST /api/generate` with `steered: true` names a `method` (default `"pasta"`) and that
method's parameter; the intervention is built by `steer.serving.parse_steer`, the parser of
`headsteer serve`'s `"steer"` field, so the explorer, the server and the Python API check the
same values with the same messages (a no-op setting is refused with the warning text the CLI
prints, `steer.noop.refusing_noop`).

| method | parameter (default) | heads | span |
|---|---|---|---|
| `pasta` | `alpha` (0.01) | required | required |
| `spotlight` | `tau` (0.1) | refused (every layer) | required |
| `instaboost` | `multiplier` (5) | refused (every layer and head) | required |
| `act` | `beta` (0.4) | optional (default: every head of layers 2..L-2) | not used |
| `ablate` | `eps` (0), `mode` `"ua"` / `"sc"` | required | not used |
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError

if TYPE_CHECKING:
    from heads.inputs.prompts import EncodedPrompts
    from heads.model.adapter import HeadModel

__all__ = [
    "STEER_FIELDS",
    "STEER_METHODS",
    "SteerMethod",
    "check_edits",
    "parse_heads",
    "parse_steering",
]


@dataclass(frozen=True)
class SteerMethod:
    """What the explorer sends for one steering method.

    Attributes:
        parameter: the request field of its main parameter (`alpha`, `tau`, ...).
        default: that parameter's default (the method's own).
        heads: `"required"`, `"optional"` or `"refused"`: whether the clicked heads are sent.
        span: the method needs a `**...**` span in the prompt.
        extra: other fields the request may carry (ablation's `mode`).
    """

    parameter: str
    default: float
    heads: str
    span: bool
    extra: tuple[str, ...] = ()


STEER_METHODS: dict[str, SteerMethod] = {
    "pasta": SteerMethod("alpha", 0.01, "required", True),
    "spotlight": SteerMethod("tau", 0.1, "refused", True),
    "instaboost": SteerMethod("multiplier", 5.0, "refused", True),
    "act": SteerMethod("beta", 0.4, "optional", False),
    "ablate": SteerMethod("eps", 0.0, "required", False, ("mode",)),
}
"""The steering methods of the explorer's panel, by request name."""

STEER_FIELDS = frozenset(
    {"method", "heads"} | {f for m in STEER_METHODS.values() for f in (m.parameter, *m.extra)}
)
"""The request fields of a steered `/api/generate` beside the prompt, `max_new_tokens` and `job`."""

_COMMON = {"prompt", "steered", "max_new_tokens", "job", "raw", "method", "heads"}

MAX_HEADS = 512
"""Most (layer, head) pairs in one steering request."""


def parse_heads(raw: object, n_layers: int, n_heads: int) -> dict[int, list[int]]:
    """The request's `heads` (`[[layer, head], ...]`, at most `MAX_HEADS`) as `{layer: [heads]}`
    in the order given, repeats dropped.

    Raises:
        HeadsteerValueError: not a non-empty list of `[layer, head]` int pairs inside the model.
    """
    if not isinstance(raw, list) or not raw:
        raise HeadsteerValueError(
            "heads must be a non-empty list of [layer, head] pairs: click heads in the grid"
        )
    if len(raw) > MAX_HEADS:
        raise HeadsteerValueError(f"heads has {len(raw)} pairs, more than the limit {MAX_HEADS}")
    out: dict[int, list[int]] = {}
    for pair in raw:
        ok = (
            isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
        )
        if not ok or not (0 <= pair[0] < n_layers and 0 <= pair[1] < n_heads):
            raise HeadsteerValueError(
                f"bad head {short_repr(pair)}: need [layer, head] with layer < {n_layers}, head < {n_heads}"
            )
        out.setdefault(pair[0], [])
        if pair[1] not in out[pair[0]]:
            out[pair[0]].append(pair[1])
    return out


def parse_steering(
    body: dict,
    heads_of: Callable[[dict], dict[int, list[int]]],
    has_span: Callable[[], bool],
) -> list:
    """The interventions of a steered `/api/generate` request, checked before any work.

    Args:
        body: the request (`method`, the method's parameter, `heads`, ...).
        heads_of: reads and checks `body["heads"]` (`[[layer, head], ...]`) against the model.
        has_span: whether the prompt has a `**...**` span (called only for span methods).

    Returns:
        a one-item list: the intervention, as `steer.serving.parse_steer` builds it.

    Raises:
        HeadsteerValueError: an unknown method, a field the method does not use, heads given
            to a method that steers every head or missing where required, no span for a span
            method, a bad or no-op parameter value (one line, naming it).
    """
    from steer.serving import parse_steer

    method = body.get("method", "pasta")
    if not isinstance(method, str) or method not in STEER_METHODS:
        raise HeadsteerValueError(f"unknown method {short_repr(method)}: use one of {sorted(STEER_METHODS)}")
    spec = STEER_METHODS[method]
    allowed = _COMMON | {spec.parameter, *spec.extra}
    other = sorted(str(k) for k in body if k not in allowed)
    if other:
        raise HeadsteerValueError(
            f"{method} does not use {', '.join(other)}: its parameter is {spec.parameter}"
        )
    item: dict = {"method": method}
    for name in (spec.parameter, *spec.extra):
        if name in body:
            item[name] = body[name]
    given = body.get("heads") not in (None, [])
    if spec.heads == "refused" and given:
        raise HeadsteerValueError(
            f"{method} steers every head: clear the steered heads (heads must be empty)"
        )
    if spec.heads == "required" or given:
        item["heads"] = {str(layer): hs for layer, hs in heads_of(body).items()}
    if spec.span and not has_span():
        raise HeadsteerValueError(f"{method} needs a span: mark it in the prompt with **...**")
    try:
        return parse_steer([item])
    except HeadsteerValueError as exc:  # the server's message, without its "steer[0] (pasta): "
        raise HeadsteerValueError(str(exc).removeprefix(f"steer[0] ({method}): ")) from None


def check_edits(model: "HeadModel", enc: "EncodedPrompts", steer: list) -> None:
    """Build the interventions' edits on the encoded prompt once, before the job starts, so that
    what they refuse only when applied (an ablation `eps` beyond the model's dtype, scaling
    factors that multiply past it on one head, a layer outside the model) is HTTP 400, not an
    error event in the stream (`heads.engine.context.validate_edits`, what `editing` checks).

    Raises:
        HeadsteerValueError / HeadsteerTypeError: as the edits raise (one line).
    """
    from heads.engine.context import validate_edits

    validate_edits(model, [e for s in steer for e in s.edits(model, enc)])
