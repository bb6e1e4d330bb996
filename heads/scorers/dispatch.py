"""`run(model, request, inputs)`: the one entry that runs any analysis request.

Every analysis has a request class (`heads.scorers.request_base.Request`) and a runner
`run_<analysis>(model, inputs, request, options=None)`; this table maps each request type to its
runner. The CLI, the explorer and the server build a request from their input (`Request.from_json`
for JSON), check it against the model's config before the weights load (`check_config`), and run
it here:

    from heads import PatchRequest, run
    result = run(model, PatchRequest(kind="head_out"), pairs)
    result = run(model, {"request": "patch", "kind": "q"}, pairs)   # JSON-shaped, e.g. from a server

`inputs` is what the analysis reads: prompt pairs (`encode_pairs`) for the causal analyses,
prompts / texts for Ships, the sink statistics and the lens, relations for MAPS, a `GateTask`,
question items for QRHead, the gathered scores for the atlas, nothing for weight-only analyses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from heads.engine.options import SweepOptions
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.scorers.circuits.request import CircuitRequest
from heads.scorers.gating.request import GatingRequest
from heads.scorers.maps.request import MapsRequest
from heads.scorers.patching.request import (
    DLARequest,
    KnockoutRequest,
    LensRequest,
    PatchRequest,
    PathPatchRequest,
)
from heads.scorers.qk.request import CompositionRequest, QKRequest
from heads.scorers.request_base import Request
from heads.scorers.retrieval.request import QRHeadRequest
from heads.scorers.roles.request import AtlasRequest, DetectRolesRequest, LensTrainRequest
from heads.scorers.safety.request import AttributionRequest, DatasetShipsRequest, SaharaRequest, ShipsRequest
from heads.scorers.sink_requests import SinkDimsRequest, SinkStatsRequest

__all__ = ["RUNNERS", "run"]

Runner = Callable[[HeadModel, Any, Any, SweepOptions | None], Any]


def _opts(options: SweepOptions | None) -> SweepOptions:
    if options is None:
        return SweepOptions()
    if not isinstance(options, SweepOptions):
        raise HeadsteerTypeError(f"options must be a heads.SweepOptions, got {type(options).__name__}")
    return options


def _only_progress(options: SweepOptions | None) -> SweepOptions:
    """The `progress` and `max_memory` of `options` alone (for the analyses that take no other
    sweep option; each honours a budget or refuses it, never drops it)."""
    o = _opts(options)
    return SweepOptions(progress=o.progress, max_memory=o.max_memory)


def _patch(model: HeadModel, pairs: Any, r: PatchRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.patching.activation import run_patch

    return run_patch(model, pairs, r, options)  # the request itself: no field copied by hand


def _path_patch(model: HeadModel, pairs: Any, r: PathPatchRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.patching.path import run_path_patch

    return run_path_patch(model, pairs, r, options)


def _dla(model: HeadModel, pairs: Any, r: DLARequest, options: SweepOptions | None) -> Any:
    from heads.scorers.patching.logit import run_dla

    return run_dla(model, pairs, r)


def _lens(model: HeadModel, pairs: Any, r: LensRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.patching.logit import run_lens

    return run_lens(model, pairs, r)


def _knockout(model: HeadModel, pairs: Any, r: KnockoutRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.patching.knockout import run_knockout

    return run_knockout(model, pairs, r, options)


def _circuit(model: HeadModel, pairs: Any, r: CircuitRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.circuits.circuit import run_find_circuit

    return run_find_circuit(model, pairs, r, options)


def _detect_roles(
    model: HeadModel, sequences: Any, r: DetectRolesRequest, options: SweepOptions | None
) -> Any:
    from heads.scorers.roles.detectors import run_detect_roles

    return run_detect_roles(model, sequences, r, options)


def _train_lens(model: HeadModel, texts: Any, r: LensTrainRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.roles.lens import run_train_lens

    return run_train_lens(model, texts, r, _only_progress(options))


def _atlas(model: HeadModel, inputs: Any, r: AtlasRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.roles.atlas import run_head_atlas

    return run_head_atlas(model, inputs, r, options)


def _ships(model: HeadModel, prompts: Any, r: ShipsRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.safety.ships import run_ships

    return run_ships(model, prompts, r, options)


def _dataset_ships(
    model: HeadModel, prompts: Any, r: DatasetShipsRequest, options: SweepOptions | None
) -> Any:
    from heads.scorers.safety.ships import run_dataset_ships

    return run_dataset_ships(model, prompts, r, options)


def _sahara(model: HeadModel, prompts: Any, r: SaharaRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.safety.ships import run_sahara

    return run_sahara(model, prompts, r, options)


def _attribution(model: HeadModel, prompts: Any, r: AttributionRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.safety.attribution import run_attribution

    return run_attribution(model, prompts, r, options)


def _maps(model: HeadModel, relations: Any, r: MapsRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.maps.static import run_maps

    return run_maps(model, relations, r, options=_only_progress(options))


def _qrhead(model: HeadModel, items: Any, r: QRHeadRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.retrieval.qrhead import run_qrhead

    return run_qrhead(model, items, r, _only_progress(options))


def _gating(model: HeadModel, task: Any, r: GatingRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.gating.chg import run_gating

    return run_gating(model, task, r, _only_progress(options))


def _sink_stats(model: HeadModel, prompts: Any, r: SinkStatsRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.sinks import run_sink_stats

    return run_sink_stats(model, prompts, r, options)  # one forward: max_memory checked, no split


def _sink_dims(model: HeadModel, prompts: Any, r: SinkDimsRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.sink_dims import run_sink_dims

    return run_sink_dims(model, prompts, r)  # one forward: no sweep option applies


def _qk(model: HeadModel, prompts: Any, r: QKRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.qk.attribution import run_qk_attribution

    return run_qk_attribution(model, prompts, r)  # one recording forward: no sweep option applies


def _composition(model: HeadModel, prompts: Any, r: CompositionRequest, options: SweepOptions | None) -> Any:
    from heads.scorers.qk.composition import run_composition

    return run_composition(model, prompts, r)  # no sweep option applies


RUNNERS: dict[type[Request], Runner] = {
    PatchRequest: _patch,
    PathPatchRequest: _path_patch,
    DLARequest: _dla,
    LensRequest: _lens,
    KnockoutRequest: _knockout,
    CircuitRequest: _circuit,
    DetectRolesRequest: _detect_roles,
    LensTrainRequest: _train_lens,
    AtlasRequest: _atlas,
    ShipsRequest: _ships,
    DatasetShipsRequest: _dataset_ships,
    SaharaRequest: _sahara,
    AttributionRequest: _attribution,
    MapsRequest: _maps,
    QRHeadRequest: _qrhead,
    GatingRequest: _gating,
    SinkStatsRequest: _sink_stats,
    SinkDimsRequest: _sink_dims,
    QKRequest: _qk,
    CompositionRequest: _composition,
}
"""Request type -> `runner(model, inputs, request, options)`."""

_NO_OPTIONS: tuple[type[Request], ...] = (
    DLARequest,
    LensRequest,
    AtlasRequest,
    SinkDimsRequest,
    QKRequest,
    CompositionRequest,
)
"""Requests whose analysis takes no `SweepOptions`: a `max_memory` given with them is refused
(never dropped)."""

_NO_INPUT = (CompositionRequest, AtlasRequest, DetectRolesRequest)
"""Requests whose input may be left out (weights only, gathered scores, default sequences)."""


def run(
    model: HeadModel,
    request: Request | Mapping[str, Any] | str,
    *inputs: Any,
    options: SweepOptions | None = None,
) -> Any:
    """Run an analysis request on `model`.

    Args:
        model: the `HeadModel`.
        request: a request (`PatchRequest(...)`, `CircuitRequest(...)`, ...), or its JSON (text or
            mapping with a `"request"` name, `Request.from_json`).
        *inputs: the analysis' input, one value: pairs, prompts, texts, relations, a task, items;
            none for a weight-only analysis (`CompositionRequest(method="weights")`), optional for
            the detectors (default sequences) and the atlas (a mapping of gathered scores).
        options: `SweepOptions` (rows per forward, progress, ...) for the analyses that sweep.

    Returns:
        the analysis' result (each follows `heads.results.protocol.Result`).

    Raises:
        HeadsteerTypeError: `request` neither a request nor its JSON, `model` not a `HeadModel`.
        HeadsteerValueError: a bad request (JSON: unknown name or key, a bad value), more than one
            input or a missing one, a geometry the model does not have (`Request.check_config`),
            and whatever the analysis refuses — all before any forward.
    """
    if isinstance(request, (Mapping, str, bytes)):
        request = Request.from_json(request)
    if not isinstance(request, Request):
        raise HeadsteerTypeError(
            f"request must be an analysis request or its JSON, got {type(request).__name__}"
        )
    if not isinstance(model, HeadModel):
        raise HeadsteerTypeError(f"model must be a HeadModel, got {type(model).__name__}")
    runner = RUNNERS.get(type(request))
    if runner is None:  # pragma: no cover - every request class has a runner (tested)
        raise HeadsteerValueError(f"no runner for {type(request).__name__}")
    if len(inputs) > 1:
        raise HeadsteerValueError(f"run() takes one input for a {request.NAME} request, got {len(inputs)}")
    if not inputs and not isinstance(request, _NO_INPUT):
        raise HeadsteerValueError(
            f"a {request.NAME} request needs its input (pairs, prompts, ...): run(model, request, inputs)"
        )
    request.check_config(model)
    if options is not None and options.max_memory is not None and isinstance(request, _NO_OPTIONS):
        raise HeadsteerValueError(
            f"a {request.NAME} request takes no SweepOptions(max_memory=): its analysis runs without "
            "sweep options, so a budget would not bound it; run it without max_memory"
        )
    return runner(model, inputs[0] if inputs else None, request, options)
