"""A head's pattern and card: `/api/prepare`, `/api/pattern`, `/api/head`.

A prompt longer than the state's `full_pattern_tokens` gets, in place of its `[T, T]` patterns,
an overview per head (`viz.explorer.overview`, kept per tab like the patterns) and exact
windows of at most `MAX_WINDOW` x `MAX_WINDOW` cells (`/api/pattern` with `q0, q1, k0, k1`).

Each of them that runs the model is a job (`viz.explorer.jobs.run_job`): inside the job limit,
cancelled when its client leaves, and a tab's new prepare or card cancels its previous one (the
page sends a prepare whenever the prompt stops changing). What is already kept (a tab's recorded
patterns, a card's parts) is answered at once, without a job.
"""

import threading
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from viz.explorer.jobs import run_job
from viz.explorer.patterns import Patterns, Stopped
from viz.explorer.requests import HeadRequest, PatternRequest, PrepareRequest
from viz.explorer.routes.common import State, body
from viz.explorer.scores import Cancelled
from viz.explorer.state import ExplorerState

__all__ = ["job_answer", "router"]

router = APIRouter()


def job_answer(answer: dict) -> JSONResponse | None:
    """The response of a job that did not give its result: `{"cancelled": true}` (HTTP 200:
    superseded, or its client left), or its error (HTTP 400 for a bad value, 500 otherwise);
    None when the job gave its result."""
    if "cancelled" in answer:
        return JSONResponse({"cancelled": True})
    if "error" in answer:
        bad = isinstance(answer.get("exception"), (ValueError, TypeError, KeyError, IndexError))
        return JSONResponse({"error": answer["error"]}, status_code=400 if bad else 500)
    return None


def _record(st: ExplorerState, prompt: str, tab: str, chat: bool, flag: threading.Event) -> Patterns:
    try:
        return st.record_patterns(prompt, tab, chat, flag)
    except Stopped:
        raise Cancelled from None


def _record_overview(st: ExplorerState, prompt: str, tab: str, chat: bool, flag: threading.Event) -> Any:
    try:
        return st.record_overview(prompt, tab, chat, flag)
    except Stopped:
        raise Cancelled from None


@router.post("/api/prepare")
async def prepare(req: Annotated[PrepareRequest, body(PrepareRequest)], request: Request, st: State) -> Any:
    chat = st.chat(req.raw)
    ov = st.overviews.get(req.tab, req.prompt, chat=chat)
    if ov is not None:
        return {"cached": True, "tokens": len(ov.tokens), "overview": True}
    got = st.patterns.get(req.tab, req.prompt, chat=chat)
    if got is None:
        enc = st.encoded(req.prompt, chat)  # bad markup, too many tokens: 400 before any job
        if st.is_long(enc.length):  # the overview (and the residuals its windows start from)

            def record(emit: Any, flag: threading.Event) -> dict:
                return {"overview": _record_overview(st, req.prompt, req.tab, chat, flag)}

            key = ("prepare", req.tab) if req.tab else None
            answer = await run_job(st.jobs, st.lock, req.job, record, request, supersede=key)
            refused = job_answer(answer)
            if refused is not None:
                return refused
            return {"cached": True, "tokens": len(answer["overview"].tokens), "overview": True}
        if not st.patterns_fit(enc):
            return {"cached": False, "tokens": None}

        def work(emit: Any, flag: threading.Event) -> dict:
            return {"patterns": _record(st, req.prompt, req.tab, chat, flag)}

        key = ("prepare", req.tab) if req.tab else None
        answer = await run_job(st.jobs, st.lock, req.job, work, request, supersede=key)
        refused = job_answer(answer)
        if refused is not None:
            return refused
        got = answer["patterns"]
    return {"cached": True, "tokens": len(got.tokens), "overview": False}


def _pattern_json(
    layer: int, head: int, probs: Any, tokens: list[str], spans: Any, cached: bool, **extra: Any
) -> JSONResponse:
    probs = (probs.double() * 1e4).round() / 1e4  # 4 decimals, in float64 so the JSON has 4 too
    return JSONResponse(  # plain json.dumps: FastAPI's per-value encoder is slow on [T, T]
        {
            "layer": layer,
            "head": head,
            "probs": probs.tolist(),
            "tokens": tokens,
            "spans": [list(s) for s in spans],
            "cached": cached,
            **extra,
        }
    )


def _overview_json(ov: Any, layer: int, head: int, pool: str, cached: bool) -> JSONResponse:
    from viz.explorer.overview import significant

    grid = (ov.grid_max if pool == "max" else ov.grid_mean)[layer, head]
    return JSONResponse(
        {
            "layer": layer,
            "head": head,
            "tokens": ov.tokens,
            "spans": [list(s) for s in ov.spans],
            "cached": cached,
            "overview": {
                "pool": pool,
                "block": ov.block,
                "grid": significant(grid),
                "col_mass": significant(ov.col_mass[layer, head]),
                "row_entropy": significant(ov.row_entropy[layer, head]),
                "row_max": significant(ov.row_max[layer, head]),
            },
        }
    )


async def _window(req: PatternRequest, chat: bool, request: Request, st: ExplorerState) -> Any:
    """The exact window of one head's pattern (`pattern_window`), from the layer whose residual
    the tab's overview of this prompt kept (or from layer 0 without one)."""
    from viz.explorer.overview import pattern_window

    window = req.window
    assert window is not None
    ov = st.overviews.get(req.tab, req.prompt, chat=chat)
    enc = ov.enc if ov is not None and ov.enc is not None else st.encoded(req.prompt, chat)  # 400 first
    st.check_window(window, enc.length)

    def work(emit: Any, flag: threading.Event) -> dict:
        return {"probs": pattern_window(st.model, enc, req.layer, req.head, window, ov)}

    key = ("window", req.tab) if req.tab else None
    answer = await run_job(st.jobs, st.lock, req.job, work, request, supersede=key)
    refused = job_answer(answer)
    if refused is not None:
        return refused
    tokens = ov.tokens if ov is not None else None
    if tokens is None:
        from heads.inputs.tokens import readable_tokens

        tokens = readable_tokens(st.model.tokenizer, enc.input_ids[0])
    spans = ov.spans if ov is not None else enc.spans[0]
    return await run_in_threadpool(
        _pattern_json,
        req.layer,
        req.head,
        answer["probs"],
        tokens,
        spans,
        ov is not None,
        window=list(window),
    )


@router.post("/api/pattern")
async def pattern(req: Annotated[PatternRequest, body(PatternRequest)], request: Request, st: State) -> Any:
    chat = st.chat(req.raw)
    if req.window is not None:
        return await _window(req, chat, request, st)
    ov = st.overviews.get(req.tab, req.prompt, chat=chat)
    if ov is not None:
        return await run_in_threadpool(_overview_json, ov, req.layer, req.head, req.pool, True)
    got = st.patterns.get(req.tab, req.prompt, chat=chat)
    if got is None:
        enc = st.encoded(req.prompt, chat)  # 400 before any job
        if st.is_long(enc.length):

            def record(emit: Any, flag: threading.Event) -> dict:
                return {"overview": _record_overview(st, req.prompt, req.tab, chat, flag)}

            answer = await run_job(st.jobs, st.lock, req.job, record, request)
            refused = job_answer(answer)
            if refused is not None:
                return refused
            return await run_in_threadpool(
                _overview_json, answer["overview"], req.layer, req.head, req.pool, False
            )
        fits = st.patterns_fit(enc)

        def work(emit: Any, flag: threading.Event) -> dict:
            if fits:
                return {"patterns": _record(st, req.prompt, req.tab, chat, flag)}
            from heads.scorers.attention_mass import head_pattern

            return {"one": head_pattern(st.model, req.prompt, req.layer, req.head, chat=chat)}

        answer = await run_job(st.jobs, st.lock, req.job, work, request)
        refused = job_answer(answer)
        if refused is not None:
            return refused
        if "one" in answer:  # too large for the cache: one head's forward
            probs, tokens, spans = answer["one"]
            return await run_in_threadpool(_pattern_json, req.layer, req.head, probs, tokens, spans, False)
        got = answer["patterns"]
    probs = got.probs[req.layer, req.head]
    return await run_in_threadpool(_pattern_json, req.layer, req.head, probs, got.tokens, got.spans, True)


@router.post("/api/head")
async def head_card(req: Annotated[HeadRequest, body(HeadRequest)], request: Request, st: State) -> Any:
    from heads.inputs.prompts import encode_prompts

    layer, head = req.layer, req.head
    text = encode_prompts(st.model.tokenizer, req.prompt, chat=st.chat(req.raw)).texts[0]
    lens_part, maps_part = st.cards.get(("lens", text, layer, head)), st.cards.get(("maps", layer, head))
    no_maps = st.maps_refusal()
    if lens_part is None or (maps_part is None and no_maps is None):

        def work(emit: Any, flag: threading.Event) -> dict:
            return {"parts": st.card_parts(text, layer, head, flag)}

        key = ("head", req.tab) if req.tab else None
        answer = await run_job(st.jobs, st.lock, req.job, work, request, supersede=key)
        refused = job_answer(answer)
        if refused is not None:
            return refused
        lens_part, maps_part = answer["parts"]
    out: dict[str, Any] = {
        "layer": layer,
        "head": head,
        "lens_tokens": list(lens_part["lens_tokens"]),
        "model_tokens": list(lens_part["model_tokens"]),
        "maps": [dict(m) for m in maps_part or []],
        "scores": st.head_scores(req.prompt, st.chat(req.raw), layer, head),
    }
    if no_maps is not None:
        out["maps_note"] = f"MAPS is left out on this model: {no_maps}"
    if st.cache["maps"] is not None:
        out["maps_describe"] = st.cache["maps"].describe(layer, head)
    atlas = st.atlas_row(layer, head)
    if atlas is not None:
        out["atlas"] = atlas
    return out
