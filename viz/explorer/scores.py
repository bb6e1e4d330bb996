"""The explorer's score jobs: the grids of `/api/scores` that need more than one forward.

Each function runs inside a job (`viz.explorer.jobs.job_stream`): it reports progress with
`progress_reporter(emit, flag)`, which raises `Cancelled` once the job's flag is set, and
returns the result object of the job's last event. The prompt-independent results (the atlas,
MAPS, the probes) are kept in the server's `cache` dict, so a second request costs nothing.
"""

import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from heads.inputs.prompts import encode_prompts

if TYPE_CHECKING:
    from heads.model.adapter import HeadModel
    from heads.scorers.request_base import Request

__all__ = [
    "PROBE_LIMIT",
    "PROBE_TASK",
    "Cancelled",
    "FIRST_MLP_DETECTORS",
    "atlas_result",
    "dla_result",
    "grid",
    "maps_result",
    "probes_result",
    "progress_reporter",
    "score_request",
    "ships_result",
]

Emit = Callable[[dict], None]
"""Sends one event of the job's stream."""

PROBE_TASK = "harmful"
"""The shipped probe task (`probes.head_probes.probe_data`) of the `"probes"` score."""
PROBE_LIMIT = 32
"""Examples per class of `PROBE_TASK` the `"probes"` score fits on (its train split)."""
FIRST_MLP_DETECTORS = ("copying", "successor")
"""The atlas detectors that read MAPS' first-MLP source representation (`apply_first_mlp`)."""


class Cancelled(Exception):
    """Raised inside a job's work when its job was cancelled."""


def grid(t: Any) -> list[list[float | None]]:
    """A `[L, H]` tensor as nested lists, NaN / inf as None (JSON has no NaN)."""
    return [[None if not math.isfinite(v) else round(v, 5) for v in row] for row in t.float().tolist()]


def progress_reporter(emit: Emit, flag: threading.Event) -> Callable[[int, int], None]:
    """A library `progress=` callback that sends `{"progress": [done, total]}` events and raises
    `Cancelled` once the job's `flag` is set (so a scorer stops at its next step)."""

    def report(done: int, total: int) -> None:
        if flag.is_set():
            raise Cancelled
        emit({"progress": [int(done), int(total)]})

    return report


def atlas_result(
    model: "HeadModel", cache: dict, emit: Emit, flag: threading.Event, no_first_mlp: str | None = None
) -> dict:
    """The head atlas's roles and score columns (`heads.AtlasRequest(thumbnails=False)` run by
    `heads.run` on the detectors' scores), the detectors run once per server (kept in
    `cache["atlas"]`), with progress per detector.

    `no_first_mlp`: why MAPS' first-MLP source representation is not defined for this model
    (`ExplorerState.maps_refusal`); the copying and successor detectors, which read it, are
    then left out, named in the result's `skipped` (`{detector: reason}`)."""
    if cache["atlas"] is None:
        from heads import run
        from heads.scorers.roles.detectors import (
            copying_scores,
            pattern_scores,
            retrieval_scores,
            successor_scores,
        )
        from heads.scorers.roles.request import AtlasRequest

        report = progress_reporter(emit, flag)
        steps = [
            ("attention patterns", lambda: pattern_scores(model)),
            ("copying", lambda: {"copying": copying_scores(model)}),
            ("successor", lambda: {"successor": successor_scores(model)}),
            ("retrieval", lambda: {"retrieval": retrieval_scores(model)}),
        ]
        if no_first_mlp is not None:
            steps = [s for s in steps if s[0] not in FIRST_MLP_DETECTORS]
            cache["atlas_skipped"] = {d: no_first_mlp for d in FIRST_MLP_DETECTORS}
        det: dict = {}
        report(0, len(steps))
        for i, (what, step) in enumerate(steps):
            emit({"status": f"head atlas: {what}"})
            det.update(step())
            report(i + 1, len(steps))
        cache["atlas"] = run(model, AtlasRequest(thumbnails=False), {"detectors": det})
    frame = cache["atlas"].frame
    L, H = model.n_layers, model.n_heads
    roles = [[""] * H for _ in range(L)]
    for la, h, r in zip(frame["layer"], frame["head"], frame["role"], strict=True):
        roles[int(la)][int(h)] = str(r)
    columns = {}
    for col in cache["atlas"].score_columns:
        grid: list[list[float | None]] = [[None] * H for _ in range(L)]
        for la, h, v in zip(frame["layer"], frame["head"], frame[col], strict=True):
            fv = float(v)
            grid[int(la)][int(h)] = round(fv, 5) if math.isfinite(fv) else None
        columns[col] = grid
    order = [*cache["atlas"].thresholds, "none"]
    out = {"score": "atlas", "roles": roles, "role_order": order, "columns": columns}
    if cache.get("atlas_skipped"):
        out["skipped"] = dict(cache["atlas_skipped"])
    return {"result": out}


def dla_result(model: "HeadModel", prompt: str, chat: bool, emit: Emit, flag: threading.Event) -> dict:
    """Each head's direct logit of the model's top next token at the last position:
    `heads.scorers.patching.logit.head_logits` (frozen final-norm scale), answer part, on the
    prompt rendered with the chat template or not (`chat`)."""
    from heads.engine.forward import forward
    from heads.inputs.tokens import readable_token
    from heads.scorers.patching.logit import head_logits
    from heads.scorers.patching.pairs import PromptPair, encode_pairs

    report = progress_reporter(emit, flag)
    text = encode_prompts(model.tokenizer, prompt, chat=chat).texts[0]  # rendered as the card's lens reads it
    report(0, 2)
    emit({"status": "DLA: the model's top next token"})
    enc = encode_prompts(model.tokenizer, text, chat=False, markup=False)
    top, second = forward(model, enc, logits_to_keep=1).logits[0, -1].float().topk(2).indices.tolist()
    report(1, 2)
    emit({"status": "DLA: each head's direct logit of that token"})
    pairs = encode_pairs(model, [PromptPair(text, text, int(top), int(second))])
    answer, _ = head_logits(model, pairs)
    report(2, 2)
    return {
        "score": "dla",
        "scores": grid(answer[0]),
        "token": readable_token(model.tokenizer, int(top)),
    }


def score_request(kind: str, chat: bool) -> "Request | None":
    """The analysis request of score `kind` where it is one analysis run by `heads.run`:
    `SinkStatsRequest(chat=chat)` for `"sinks"`, `ShipsRequest()` (its defaults) for `"ships"`,
    `MapsRequest()` for `"maps"`; None for the others (span attention, the DLA of the top token,
    the atlas' detectors step by step, the probes)."""
    if kind == "sinks":
        from heads.scorers.sink_requests import SinkStatsRequest

        return SinkStatsRequest(chat=chat)
    if kind == "ships":
        from heads.scorers.safety.request import ShipsRequest

        return ShipsRequest()
    if kind == "maps":
        from heads.scorers.maps.request import MapsRequest

        return MapsRequest()
    return None


def ships_result(
    model: "HeadModel", prompt: str, emit: Emit, flag: threading.Event, request: "Request | None" = None
) -> dict:
    """Ships (`request`, default `heads.ShipsRequest()`: its defaults, run by `heads.run`) on the
    prompt's plain text."""
    from heads import run
    from heads.engine.options import SweepOptions
    from heads.scorers.safety.request import ShipsRequest

    text = encode_prompts(model.tokenizer, prompt, chat=False).texts[0]  # markup removed
    emit({"status": "Ships: ablating each head alone"})
    options = SweepOptions(progress=progress_reporter(emit, flag))
    res = run(model, request or ShipsRequest(), text, options=options)
    return {"score": "ships", "scores": grid(res.scores.scores)}


def maps_result(
    model: "HeadModel",
    cache: dict,
    relations: Any,
    emit: Emit,
    flag: threading.Event,
    request: "Request | None" = None,
) -> dict:
    """The static MAPS scores on the shipped relations (`request`, default `heads.MapsRequest()`,
    run by `heads.run`), computed once per server; the grid is each head's best relation score
    (`MapsScores.best_relation`)."""
    if cache["maps"] is None:
        from heads import run
        from heads.engine.options import SweepOptions
        from heads.scorers.maps.request import MapsRequest

        emit({"status": "MAPS: relation scores of every head (per layer)"})
        options = SweepOptions(progress=progress_reporter(emit, flag))
        cache["maps"] = run(model, request or MapsRequest(), relations, options=options)
    ms = cache["maps"]
    best, which = ms.best_relation()
    columns = {n: grid(ms.relation[n].scores) for n in ms.names()}
    return {"score": "maps", "scores": grid(best.scores), "best_relation": which, "columns": columns}


def probes_result(model: "HeadModel", cache: dict, emit: Emit, flag: threading.Event) -> dict:
    """Per-head probe accuracy on the shipped `PROBE_TASK` set (`probes.head_probes`),
    computed once per server: head outputs at the last token, then one probe per head."""
    from heads._util.progress import offset_progress
    from probes.head_probes import collect_head_outputs, fit_head_probes, probe_data

    data = probe_data(PROBE_TASK, "train", limit=PROBE_LIMIT)
    if cache["probes"] is None:
        n, total = len(data.prompts), len(data.prompts) + model.n_layers * model.n_heads
        report = progress_reporter(emit, flag)
        emit({"status": f"probes: head outputs on {n} {PROBE_TASK} / harmless prompts"})
        acts = collect_head_outputs(
            model, data.prompts, "last", chat=data.chat, progress=offset_progress(report, 0, total)
        )
        emit({"status": "probes: one probe per head (5-fold held-out accuracy)"})
        cache["probes"] = fit_head_probes(
            acts,
            data.labels,
            groups=data.groups,
            model=model,
            progress=offset_progress(report, n, total),
        )
    res = cache["probes"]
    return {
        "score": "probes",
        "scores": grid(res.accuracy.scores),
        "columns": {"auc": grid(res.auc.scores)},
        "task": PROBE_TASK,
        "description": data.description,
        "n": res.n,
    }
