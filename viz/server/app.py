"""`headsteer serve`: an OpenAI-compatible HTTP server for steered generation (FastAPI + uvicorn).

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(streaming as server-sent events in the OpenAI chunk format with `"stream": true`).
Steering rides in extra body fields, e.g. with the `openai` client::

    client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Answer in **one word**: capital of France?"}],
        extra_body={"steer": [{"method": "pasta", "heads": "auto", "alpha": 0.01}]},
    )

`steer` is a list of `{"method": "pasta" | "spotlight" | "instaboost" | "act" | "ablate", ...}` objects
(see `steer.serving.parse_steer`); `emphasize` (a string or a list) marks spans besides
`**markup**`. A bad request gets HTTP 400 with a one-line reason. Concurrent requests are
batched dynamically (`steer.serving.Batcher`), each with its own steering on its own
batch row. The server listens on loopback addresses only; SIGTERM stops accepting
requests and lets the in-flight ones finish.

FastAPI and uvicorn are the optional extra `serve` (`pip install headsteer[serve]`);
they are imported only when a server is built.
"""

import asyncio
import ipaddress
import json
import queue
import time
import uuid
from collections.abc import Mapping
from typing import Annotated

import typer

from heads.errors import HeadsteerValueError
from viz.cli.common import Run

__all__ = ["MAX_PROMPT_CHARS", "check_loopback", "create_app", "serve_command"]

MAX_PROMPT_CHARS = 100_000
"""Longest prompt text (all messages together) a request may send."""


def check_loopback(host: str) -> str:
    """Return `host` if it is a loopback address ("localhost", 127.0.0.0/8, ::1).

    Raises:
        ValueError: any other address (the server has no authentication).
    """
    if host == "localhost":
        return host
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise HeadsteerValueError(
            f"--host {host!r} is not a loopback address: headsteer serve listens on 127.0.0.1 / ::1 only"
        )
    return host


class _BadRequest(ValueError):
    """A request the server refuses with HTTP 400."""


def _text_content(content, i: int) -> str:
    """Message content: a string, or a list of `{"type": "text", "text": ...}` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, Mapping) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise _BadRequest(f"messages[{i}].content: only text parts are supported, got {p!r}")
            parts.append(p["text"])
        return "".join(parts)
    raise _BadRequest(f"messages[{i}].content must be a string or a list of text parts")


def _emphasize(body: Mapping):
    e = body.get("emphasize")
    if e is None:
        return None
    if isinstance(e, str):
        return [e]
    if isinstance(e, list) and all(isinstance(x, str) and x for x in e):
        return e
    raise _BadRequest(f"emphasize must be a string or a list of non-empty strings, got {e!r}")


def _parse(body, chat: bool, model_id: str):
    """A `ServeRequest` from an OpenAI body; `_BadRequest` names the bad field."""
    from steer.serving import SamplingParams, ServeRequest, parse_steer

    if not isinstance(body, Mapping):
        raise _BadRequest("the request body must be a JSON object")
    if body.get("model") not in (None, model_id):
        raise _BadRequest(f"unknown model {body.get('model')!r}: this server serves {model_id!r}")
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _BadRequest("messages must be a non-empty list of {role, content} objects")
        prompt = []
        for i, m in enumerate(msgs):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
                raise _BadRequest(f"messages[{i}] must be an object with a role and a content")
            if m["role"] not in ("system", "user", "assistant", "developer"):
                raise _BadRequest(f"messages[{i}].role {m['role']!r} is not supported")
            role = "system" if m["role"] == "developer" else m["role"]
            prompt.append({"role": role, "content": _text_content(m["content"], i)})
        size = sum(len(m["content"]) for m in prompt)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise _BadRequest("prompt must be a string (one prompt per request)")
        size = len(prompt)
    if size > MAX_PROMPT_CHARS:
        raise _BadRequest(f"prompt has {size} characters, more than the limit of {MAX_PROMPT_CHARS}")
    for key, off in (
        ("logprobs", (None, False)),
        ("echo", (None, False)),
        ("best_of", (None, 1)),
        ("suffix", (None,)),
        ("tools", (None, [])),
        ("functions", (None, [])),
    ):
        if body.get(key) not in off:
            raise _BadRequest(f"{key} is not supported by headsteer serve")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _BadRequest(f"stream must be true or false, got {stream!r}")
    try:
        params = SamplingParams.from_body(body)
        steer = parse_steer(body.get("steer"))
    except (TypeError, ValueError) as exc:
        raise _BadRequest(str(exc)) from None
    return ServeRequest(prompt, chat, steer, _emphasize(body), params), stream


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def create_app(model, *, max_batch: int = 32, wait_s: float = 0.02):
    """The FastAPI app serving `model` (a `HeadModel` with a tokenizer).

    Args:
        model: the model to serve; its `name` is the model id clients pass.
        max_batch: most requests decoded together (default 32).
        wait_s: how long the batcher waits for more requests after the first (default 0.02 s).

    Returns:
        a FastAPI app; `app.state.batcher` is the `steer.serving.Batcher` (started with
        the app's lifespan, closed — after finishing queued requests — on shutdown).
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool

    from steer.serving import Batcher, BatchGenerator

    generator = BatchGenerator(model)
    model_id = model.name

    @asynccontextmanager
    async def lifespan(app):
        app.state.batcher = Batcher(generator, max_batch=max_batch, wait_s=wait_s)
        try:
            yield
        finally:
            await run_in_threadpool(app.state.batcher.close)

    app = FastAPI(title="headsteer", lifespan=lifespan)

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse(
            {"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status
        )

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "headsteer"}],
        }

    async def handle(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError, RecursionError):
            return error(400, "the request body is not valid JSON")
        try:
            req, stream = _parse(body, chat, model_id)
            prepared = await run_in_threadpool(generator.prepare, req)
        except (TypeError, ValueError, KeyError) as exc:
            return error(400, _one_line(exc))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_delta(text: str) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ("delta", text))

        def on_done(result) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ("done", result))

        try:
            request.app.state.batcher.submit(prepared, on_delta if stream else None, on_done)
        except queue.Full:
            return error(503, "too many requests waiting; retry later", "server_busy")
        except RuntimeError as exc:
            return error(503, _one_line(exc), "server_busy")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def usage(c) -> dict:
            return {
                "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens,
                "total_tokens": c.prompt_tokens + c.completion_tokens,
            }

        if not stream:
            while True:
                kind, result = await events.get()
                if kind == "done":
                    break
            if isinstance(result, ValueError):  # e.g. an edit that cannot run on this model
                return error(400, _one_line(result))
            if isinstance(result, BaseException):
                return error(500, _one_line(result), "server_error")
            if chat:
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
                "id": rid,
                "object": obj,
                "created": created,
                "model": model_id,
                "choices": [choice],
                "usage": usage(result),
            }

        opts = body.get("stream_options") or {}
        include_usage = isinstance(opts, Mapping) and bool(opts.get("include_usage"))
        chunk_obj = obj + ".chunk" if chat else obj

        def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = (
                    {"role": "assistant", "content": text or ""}
                    if first
                    else ({"content": text} if text else {})
                )
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            data = {
                "id": rid,
                "object": chunk_obj,
                "created": created,
                "model": model_id,
                "choices": [choice],
            }
            return f"data: {json.dumps(data)}\n\n"

        async def sse():
            if chat:
                yield chunk("", None, first=True)
            while True:
                kind, result = await events.get()
                if kind == "delta":
                    yield chunk(result, None)
                    continue
                if isinstance(result, BaseException):
                    err = {"error": {"message": _one_line(result), "type": "server_error"}}
                    yield f"data: {json.dumps(err)}\n\n"
                    break
                yield chunk(None, result.finish_reason)
                if include_usage:
                    data = {
                        "id": rid,
                        "object": chunk_obj,
                        "created": created,
                        "model": model_id,
                        "choices": [],
                        "usage": usage(result),
                    }
                    yield f"data: {json.dumps(data)}\n\n"
                break
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    return app


def serve_command(
    run: Run,
    host: Annotated[str, typer.Option(help="loopback address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    max_batch: Annotated[int, typer.Option(help="most requests decoded together")] = 32,
    batch_wait_ms: Annotated[float, typer.Option(help="wait for more requests after the first (ms)")] = 20.0,
    device_map: Annotated[
        str | None, typer.Option(help='"auto": spread the layers over the GPUs (then CPU) with accelerate')
    ] = None,
) -> None:
    """Serve steered generation over an OpenAI-compatible HTTP API (Ctrl-C / SIGTERM to stop).

    With --json, one JSON line on stdout once the model is loaded: {"url", "model"} (for
    scripts that start the server and wait for it)."""
    check_loopback(host)
    if not 0 <= port <= 65535:
        raise HeadsteerValueError(f"--port must be in 0..65535, got {port}")
    if max_batch < 1 or not 0 <= batch_wait_ms <= 10_000:
        raise HeadsteerValueError(
            f"--max-batch must be >= 1 and --batch-wait-ms in [0, 10000], got {max_batch}, {batch_wait_ms}"
        )
    try:
        import uvicorn
    except ImportError:
        raise HeadsteerValueError("headsteer serve needs the extra: pip install 'headsteer[serve]'") from None
    if device_map not in (None, "auto"):
        raise HeadsteerValueError(f"--device-map must be 'auto', got {device_map!r}")
    if device_map is not None and run.device != "cpu":
        raise HeadsteerValueError(
            f"--device {run.device} and --device-map {device_map} conflict: the device map places the "
            "layers; drop --device"
        )
    hm = run.load(device_map=device_map)
    app = create_app(hm, max_batch=max_batch, wait_s=batch_wait_ms / 1000)
    url = f"http://{host}:{port}/v1"
    if run.as_json:
        print(json.dumps({"url": url, "model": hm.name}), flush=True)
    run.say(f"serving {hm.name} on {url} (Ctrl-C or SIGTERM to stop)")
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=600)
    run.say("server stopped")
