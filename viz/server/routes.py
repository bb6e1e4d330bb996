"""`headsteer serve`'s routes: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`.

A request's body is read within the server's limit (HTTP 413), checked by its pydantic model
(`viz.server.requests`; HTTP 400 naming the field), prepared (`BatchGenerator.prepare`: the
prompt rendered and tokenized, the steering's edits built and checked; HTTP 400), then queued
on the batcher. The answer is one JSON object, or (`"stream": true`) server-sent events in the
OpenAI chunk format. A client that leaves has its request cancelled (dropped from the queue, or
its batch row stopped) and is logged with status 499.
"""

import asyncio
import contextlib
import json
import queue
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from viz.server.requests import ChatRequest, CompletionRequest
from viz.web.body import json_object, one_line, read_body, validated

__all__ = ["openai_error", "router"]

router = APIRouter()


def openai_error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An error response in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status
    )


def _body(cls: type) -> Any:
    async def read(request: Request) -> Any:
        st = request.app.state
        raw = await read_body(request, st.max_body_bytes, what="the request body")
        obj = json_object(raw, not_object="the request body must be a JSON object")
        return validated(cls, obj, {"serve": st.serve_context}, known=False)

    return Depends(read)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    model_id = request.app.state.serve_context.model_id
    return {
        "object": "list",
        "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "headsteer"}],
    }


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, req: Annotated[ChatRequest, _body(ChatRequest)]) -> Any:
    return await _handle(request, req, chat=True)


@router.post("/v1/completions")
async def completions(request: Request, req: Annotated[CompletionRequest, _body(CompletionRequest)]) -> Any:
    return await _handle(request, req, chat=False)


async def _handle(request: Request, req: Any, chat: bool) -> Any:
    from steer.serving import RequestCancelled

    st = request.app.state
    try:
        prepared = await run_in_threadpool(st.generator.prepare, req.serve_request())
    except (TypeError, ValueError, KeyError, OverflowError) as exc:
        return openai_error(400, one_line(exc, 10_000))
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def on_delta(text: str) -> None:
        loop.call_soon_threadsafe(events.put_nowait, ("delta", text))

    def on_done(result: Any) -> None:
        loop.call_soon_threadsafe(events.put_nowait, ("done", result))

    try:
        job = st.batcher.submit(prepared, on_delta if req.stream else None, on_done)
    except queue.Full:
        return openai_error(503, "too many requests waiting; retry later", "server_busy")
    except RuntimeError as exc:
        return openai_error(503, one_line(exc, 10_000), "server_busy")
    reply = _Reply(req, chat, st.serve_context.model_id, request.scope.setdefault("state", {}))
    prompt_tokens = int(prepared.enc.attention_mask.sum())
    if req.stream:
        return StreamingResponse(reply.events(events, job, prompt_tokens), media_type="text/event-stream")
    try:
        while True:
            try:
                kind, result = await asyncio.wait_for(events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()  # its row stops before the next step; wait for it, to log it
                    done = None
                    with contextlib.suppress(asyncio.TimeoutError):
                        while done is None:
                            k, r = await asyncio.wait_for(events.get(), timeout=10)
                            done = r if k == "done" else None
                    tokens = getattr(done, "completion_tokens", 0)
                    reply.state.update(status=499, finish="cancelled", usage=(prompt_tokens, tokens))
                    return Response(status_code=499)
                continue
            if kind == "done":
                break
    except asyncio.CancelledError:  # the server is stopping, or the client went away
        job.cancel()
        raise
    if isinstance(result, RequestCancelled):
        reply.state.update(status=499, finish="cancelled", usage=(prompt_tokens, result.completion_tokens))
        return Response(status_code=499)
    if isinstance(result, ValueError):  # e.g. an edit that cannot run on this model
        return openai_error(400, one_line(result, 10_000))
    if isinstance(result, BaseException):
        return openai_error(500, one_line(result, 10_000), "server_error")
    return reply.whole(result)


class _Reply:
    """The answer to one request in OpenAI's shapes: whole, or as a stream of chunks."""

    def __init__(self, req: Any, chat: bool, model_id: str, state: dict):
        self.req, self.chat, self.model_id, self.state = req, chat, model_id, state
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = self.object + ".chunk" if chat else self.object

    def usage(self, c: Any) -> dict:
        self.state["usage"] = (c.prompt_tokens, c.completion_tokens)
        self.state["finish"] = c.finish_reason
        return {
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
        }

    def whole(self, result: Any) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": result.finish_reason,
                "logprobs": None,
            }
        else:
            choice = {
                "index": 0,
                "text": result.text,
                "finish_reason": result.finish_reason,
                "logprobs": None,
            }
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model_id,
            "choices": [choice],
            "usage": self.usage(result),
        }

    def chunk(self, text: str | None, finish: str | None, first: bool = False) -> str:
        if self.chat:
            delta = (
                {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            )
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        data = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model_id,
            "choices": [choice],
        }
        return f"data: {json.dumps(data)}\n\n"

    async def events(self, events: asyncio.Queue, job: Any, prompt_tokens: int) -> Any:
        done = False
        try:
            if self.chat:
                yield self.chunk("", None, first=True)
            while True:
                kind, result = await events.get()
                if kind == "delta":
                    yield self.chunk(result, None)
                    continue
                done = True
                if isinstance(result, BaseException):
                    self.state["finish"] = "error"
                    err = {"error": {"message": one_line(result, 10_000), "type": "server_error"}}
                    yield f"data: {json.dumps(err)}\n\n"
                    break
                yield self.chunk(None, result.finish_reason)
                data = {
                    "id": self.id,
                    "object": self.chunk_object,
                    "created": self.created,
                    "model": self.model_id,
                    "choices": [],
                    "usage": self.usage(result),
                }
                if self.req.include_usage:
                    yield f"data: {json.dumps(data)}\n\n"
                break
            yield "data: [DONE]\n\n"
        finally:  # starlette cancels this generator when the client disconnects
            if not done:
                job.cancel()
                usage = self.state.get("usage", (0, 0))
                self.state.update(finish="cancelled", usage=(prompt_tokens, usage[1]))
