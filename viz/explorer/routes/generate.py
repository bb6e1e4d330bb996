"""`POST /api/generate` (a streamed continuation, unsteered or steered) and `POST /api/cancel`."""

import threading
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter

from heads.errors import HeadsteerValueError
from steer.kv_window import check_window_room
from viz.explorer.jobs import job_stream
from viz.explorer.requests import CancelRequest, GenerateRequest
from viz.explorer.routes.common import State, body
from viz.explorer.scores import Cancelled, grid
from viz.explorer.state import ExplorerState
from viz.explorer.steering import STEER_FIELDS, check_edits, parse_heads, parse_steering

__all__ = ["router", "span_share_by_layer"]

router = APIRouter()


def _streamer_class() -> Any:
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        """Sends each decoded piece as a `{"text": ...}` event; raises `Cancelled` at the next token
        once the job's flag is set (that ends `generate`)."""

        def __init__(self, tokenizer: Any, emit: Callable[[dict], None], flag: threading.Event):
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.emit, self.flag = emit, flag

        def put(self, value: Any) -> None:
            if self.flag.is_set():
                raise Cancelled
            super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if text:
                self.emit({"text": text})

    return Streamer


def _Streamer(tokenizer: Any, emit: Callable[[dict], None], flag: threading.Event) -> Any:  # noqa: N802
    return _streamer_class()(tokenizer, emit, flag)


def span_share_by_layer(
    st: ExplorerState, prompt: str, chat: bool, steer: list
) -> dict[str, list[float | None]]:
    """The last position's attention share on the span per layer (mean over heads), without
    and with `steer`: `span_attention(...).scores.mean(1)`, `[L]` each."""
    from heads.scorers.attention_mass import span_attention

    before = span_attention(st.model, prompt, chat=chat).scores.mean(1)
    after = span_attention(st.model, prompt, steer=steer, chat=chat).scores.mean(1)
    return {"before": grid(before[None])[0], "after": grid(after[None])[0]}


@router.post("/api/generate")
async def generate(req: Annotated[GenerateRequest, body(GenerateRequest)], st: State) -> Any:
    model, prompt, n_new = st.model, req.prompt, req.max_new_tokens
    chat = st.chat(req.raw)
    enc = st.encoded(prompt, chat, n_new)  # bad markup, too many tokens: 400 before the job
    span = bool(enc.spans[0])
    sent = req.steering()
    steer: list = []
    if req.steered:
        steer = parse_steering(
            sent, lambda b: parse_heads(b.get("heads"), model.n_layers, model.n_heads), lambda: span
        )
        check_edits(model, enc, steer)  # e.g. an ablation factor the dtype cannot hold
        check_window_room(model, enc, steer, n_new)  # edits a sliding window would stop part-way
    elif sent:
        raise HeadsteerValueError(
            f'{", ".join(sorted(set(sent) & STEER_FIELDS))} only apply to a steered run: add "steered": true'
        )

    def work(emit: Callable[[dict], None], flag: threading.Event) -> dict:
        streamer = _Streamer(model.tokenizer, emit, flag)
        st.steered_model.generate(
            prompt, steer, max_new_tokens=n_new, chat=chat, progress=False, streamer=streamer
        )
        if steer and span:
            emit({"status": "span share per layer, before and after steering"})
            emit({"span_share": span_share_by_layer(st, prompt, chat, steer)})
        return {"done": True}

    return job_stream(st.jobs, st.lock, req.job, work)


@router.post("/api/cancel")
async def cancel(req: Annotated[CancelRequest, body(CancelRequest)], st: State) -> dict:
    return {"job": req.job, "cancelled": st.jobs.cancel(req.job)}
