"""What `plan_memory` plans: an analysis of `ANALYSES` and its parameters (`MemoryRequest`), or an
analysis request of `heads` (`PatchRequest`, `CircuitRequest`, ...) read as the plan its analysis
runs under (`REQUEST_PLANS`), or refused by name where it has none (`NO_PLAN`: the analyses that
take no memory budget)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from heads._util.validation import check_int, short_repr
from heads.engine import state
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.planning.patching import PATCH_KINDS

__all__ = ["ANALYSES", "NO_PLAN", "REQUEST_PLANS", "MemoryRequest", "as_memory_request"]

ANALYSES: dict[str, str] = {
    "forward": "a plain forward, the last position's logits only (the baseline)",
    "generate": "a steered generation: prefill and KV cache for tokens + new_tokens",
    "sinks": "sink statistics (column sums of every pattern, read in query blocks)",
    "detectors": "the pattern detectors (per-row sums of every pattern, read in query blocks)",
    "retrieval": "the retrieval detector (the answer rows' patterns)",
    "qrhead": "QRHead scores (the query rows' patterns)",
    "knockout": "attention knockout (a row-by-column logit bias; fused kernel on long prompts)",
    "gradient": (
        "one forward and backward through the whole model, every layer's saved activations alive "
        "at once (an upper bound for AtP / EAP, which run their gradients layer by layer)"
    ),
    "logits": (
        "a forward keeping every position's logits, a copy of the real positions' and an fp16 copy "
        "(the lens data)"
    ),
    "eap": (
        "EAP / EAP-IG, layer by layer (`edge_scores`): every layer's activation differences, the "
        "recorded residuals and one layer's downstream gradients kept beside a forward"
    ),
    "eap_lean": (
        "EAP / EAP-IG on the memory-lean path (`edge_scores` under a budget the default path "
        "exceeds): differences recomputed, only the recorded residuals and a block's gradients kept"
    ),
    "patch": (
        "activation patching (`patch`, batch = pairs): its forwards (the lean path's at most "
        "LEAN_ROW_TOKENS // tokens rows, the fast path's recorded run of every pair) beside what "
        "the default path keeps (the lean path's sites or both runs' full caches)"
    ),
    "path_patch": (
        "path patching (`path_patch`, batch = pairs): the recorded run of every pair beside both "
        "runs' full caches"
    ),
}
"""The analyses `plan_memory` knows, with what is planned for each."""

_PARAMS: dict[str, tuple[str, ...]] = {
    "generate": ("new_tokens", "kernel"),
    "eap": ("circuit",),
    "eap_lean": ("block", "circuit"),
    "qrhead": ("query_rows",),
    "retrieval": ("query_rows",),
    "knockout": ("kernel",),
    "patch": ("kind", "layers", "positions"),
}


def _check_ints(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
        raise HeadsteerValueError(f"{name} must be None or a non-empty list of ints, got {short_repr(value)}")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int):
            raise HeadsteerValueError(f"{name} must hold ints, got {short_repr(v)}")


@dataclass(frozen=True)
class MemoryRequest:
    """What to plan: an analysis of `ANALYSES` and its parameters.

    Attributes:
        analysis: a name of `ANALYSES`.
        params: `new_tokens` (generate; default 0), `kernel` (`"auto"`, `"fused"`, `"blocked"`;
            default auto: fused from `FUSED_MIN_ROWS_CPU` tokens on), `query_rows` (qrhead,
            retrieval: the rows whose pattern is read; default 64), `kind` / `layers` /
            `positions` (patch: the site kind, default `"head_out"`; the patched layers and the
            by-position kinds' columns, default None: all, negative from the end), `block`
            (eap_lean: the downstream layers held per sweep; default `EAP_LEAN_BLOCK`, 2),
            `circuit` (eap, eap_lean: True for `find_circuit`, whose exact evaluations of the
            circuit keep `circuit_eval_bytes` beside a forward; default False: edge scores only).

    An analysis request of `heads` plans as its analysis where the plan has one
    (`REQUEST_PLANS`); the others are refused by name (`NO_PLAN`). Any object with a
    `memory_request()` method returning one of these plans the same way.

    Raises:
        HeadsteerValueError: an unknown analysis or parameter, a bad value.
    """

    analysis: str = "forward"
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.analysis, str) or self.analysis not in ANALYSES:
            raise HeadsteerValueError(
                f"unknown analysis {short_repr(self.analysis)} for a memory plan: use one of "
                f"{sorted(ANALYSES)}"
            )
        if not isinstance(self.params, Mapping):
            raise HeadsteerTypeError(f"params must be a mapping, got {short_repr(self.params)}")
        allowed = _PARAMS.get(self.analysis, ())
        for k, v in self.params.items():
            if k not in allowed:
                raise HeadsteerValueError(
                    f"{self.analysis} takes no parameter {short_repr(k)} in a memory plan "
                    f"(takes {list(allowed)})"
                )
            if k == "kernel" and v not in state.KERNELS:
                raise HeadsteerValueError(f"kernel must be one of {state.KERNELS}, got {short_repr(v)}")
            if k in ("new_tokens", "query_rows", "block"):
                check_int(k, v, lo=0 if k == "new_tokens" else 1)
            if k == "kind" and v not in PATCH_KINDS:
                raise HeadsteerValueError(f"kind must be one of {PATCH_KINDS}, got {short_repr(v)}")
            if k in ("layers", "positions"):
                _check_ints(k, v)
            if k == "circuit" and not isinstance(v, bool):
                raise HeadsteerValueError(f"circuit must be a bool, got {short_repr(v)}")
        object.__setattr__(self, "params", dict(self.params))

    def get(self, name: str, default: Any) -> Any:
        return self.params.get(name, default)


def _patch(r: Any) -> MemoryRequest:
    if getattr(r, "method", "activation") != "activation":
        raise HeadsteerValueError(
            f"patch(method={r.method!r}) has no memory plan; planned: activation patching "
            "(method='activation')"
        )
    layers = None if r.layers is None else list(r.layers)
    positions = r.positions if isinstance(r.positions, (list, tuple)) else None
    return MemoryRequest("patch", {"kind": r.kind, "layers": layers, "positions": positions})


def _circuit(r: Any) -> MemoryRequest:
    if r.method not in ("eap", "eap-ig"):
        raise HeadsteerValueError(
            f"find_circuit(method={r.method!r}) has no memory plan; planned: the gradient methods eap "
            "and eap-ig"
        )
    return MemoryRequest("eap", {"circuit": True})


REQUEST_PLANS: dict[str, Callable[[Any], MemoryRequest]] = {
    "patch": _patch,
    "path_patch": lambda r: MemoryRequest("path_patch"),
    "knockout": lambda r: MemoryRequest("knockout"),
    "find_circuit": _circuit,
    "sink_stats": lambda r: MemoryRequest("sinks"),
    "detect_roles": lambda r: MemoryRequest("detectors"),
    "qrhead_scores": lambda r: MemoryRequest("qrhead"),
    "attribution_patching": lambda r: MemoryRequest("gradient"),
    "gate_heads": lambda r: MemoryRequest("gradient"),  # batch: batch_size x n_masks rows
    "ships": lambda r: MemoryRequest("gradient" if r.method == "attribution" else "forward"),
    "dataset_ships": lambda r: MemoryRequest("forward"),
    "sahara": lambda r: MemoryRequest("forward"),
    "train_lens": lambda r: MemoryRequest("logits"),
}
"""Request name -> the plan its analysis runs under (`SweepOptions.within` / `check_run` with
that plan; batch = the request's rows: pairs for patching, prompts for the others)."""

NO_PLAN: dict[str, str] = {
    "direct_logit_attribution": "it runs without sweep options (no budget)",
    "logit_lens": "it runs without sweep options (no budget)",
    "head_atlas": "it runs without sweep options (no budget)",
    "find_sink_dims": "it runs without sweep options (no budget)",
    "qk_attribution": "it runs without sweep options (no budget)",
    "composition_scores": "it runs without sweep options (no budget)",
    "maps_scores": "it takes no max_memory",
}
"""Requests refused by name, with the reason."""


def as_memory_request(request: object) -> MemoryRequest:
    """`request` as a `MemoryRequest`: an analysis name, a `MemoryRequest`, an analysis request
    of `heads` (`REQUEST_PLANS`) or an object with `memory_request()`.

    Raises:
        HeadsteerValueError: an unknown analysis name, a request without a plan (named, with why).
        HeadsteerTypeError: another object.
    """
    if isinstance(request, MemoryRequest):
        return request
    if isinstance(request, str):
        return MemoryRequest(request)
    name = getattr(type(request), "NAME", None)
    if isinstance(name, str) and hasattr(request, "to_json") and hasattr(request, "check_config"):
        if name in REQUEST_PLANS:
            return REQUEST_PLANS[name](request)
        why = NO_PLAN.get(name, "none is written for it")
        raise HeadsteerValueError(
            f"a {name} request has no memory plan ({why}); planned requests: {sorted(REQUEST_PLANS)} "
            f"(or an analysis name: {sorted(ANALYSES)})"
        )
    make = getattr(request, "memory_request", None)
    if callable(make):
        got = make()
        if isinstance(got, MemoryRequest):
            return got
    raise HeadsteerTypeError(
        f"request must be an analysis name, a MemoryRequest or a request with memory_request(), "
        f"got {short_repr(request)}"
    )
