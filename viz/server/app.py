"""`headsteer serve`: an OpenAI-compatible HTTP server for steered generation (FastAPI + uvicorn).

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(streaming as server-sent events in the OpenAI chunk format with `"stream": true`).
Steering rides in extra body fields, e.g. with the `openai` client::

    client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Answer in **one word**: capital of France?"}],
        extra_body={"steer": [{"method": "pasta", "heads": "auto", "alpha": 0.01}]},
    )

`steer` is a list of `{"method": "pasta" | "spotlight" | "instaboost" | "act" | "ablate" |
"adaptvis" | "scalingvis" | "caa", ...}` objects (see `steer.serving.parse_steer`; CAA vectors
are loaded at start with `--caa-vector FILE` and named by requests); `emphasize` (a string or
a list) marks spans besides `**markup**`. A bad request gets HTTP 400 with a one-line reason.
Concurrent requests are batched dynamically (`steer.serving.Batcher`), each with its own steering on its own
batch row. The server listens on loopback addresses only; SIGTERM stops accepting
requests and lets the in-flight ones finish.

FastAPI and uvicorn are the optional extra `serve` (`pip install headsteer[serve]`);
they are imported only when a server is built.
"""

import asyncio
import contextlib
import ipaddress
import json
import logging
import queue
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from heads._util.validation import check_int, load_json_body, short_repr
from heads.errors import HeadsteerValueError
from viz.cli.common import Run

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_EMPHASIZE",
    "MAX_MESSAGES",
    "MAX_PROMPT_CHARS",
    "check_loopback",
    "create_app",
    "serve_command",
]

MAX_PROMPT_CHARS = 100_000
"""Longest prompt text (all messages together) a request may send."""
MAX_BODY_BYTES = 4 * 1024 * 1024
"""Default largest request body (`--max-body-mb`, default 4 MiB); larger bodies get HTTP 413
before they are read (a `Content-Length` above it is refused at once, a chunked body as soon as
it passes the limit)."""
MAX_MESSAGES = 256
"""Most chat messages in one request."""
MAX_EMPHASIZE = 16
"""Most `emphasize` strings in one request."""

log = logging.getLogger("headsteer.serve")
"""One line per request: client, method, path, status, prompt and completion tokens, time."""


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
            f"--host {short_repr(host)} is not a loopback address: headsteer serve listens on 127.0.0.1 "
            "/ ::1 only"
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
                raise _BadRequest(
                    f"messages[{i}].content: only text parts are supported, got {short_repr(p)}"
                )
            parts.append(p["text"])
        return "".join(parts)
    raise _BadRequest(f"messages[{i}].content must be a string or a list of text parts")


def _emphasize(body: Mapping):
    e = body.get("emphasize")
    if e is None:
        return None
    if isinstance(e, str):
        return [e]
    if isinstance(e, list) and len(e) > MAX_EMPHASIZE:
        raise _BadRequest(f"emphasize has {len(e)} strings, more than the limit of {MAX_EMPHASIZE}")
    if isinstance(e, list) and all(isinstance(x, str) and x for x in e):
        return e
    raise _BadRequest(f"emphasize must be a string or a list of non-empty strings, got {short_repr(e)}")


_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    # OpenAI fields headsteer serve does not implement, each with the values that ask for
    # nothing (compared with their type: `true` is not 1, `0` is not false); any other value is
    # HTTP 400 naming the field, never silently ignored
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None,),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),
    "function_call": (None, "none", "auto"),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0, 0.0),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
}
_TYPED = {"user": str, "stream_options": Mapping, "parallel_tool_calls": bool, "metadata": Mapping}
"""Accepted OpenAI fields that change nothing here, type-checked so a malformed one is named."""


def _same(a: object, b: object) -> bool:
    """`a == b` with the same type (so `True` is not `1` and `0` is not `False`)."""
    return type(a) is type(b) and a == b


def _refuse_unsupported(body: Mapping) -> None:
    for key, off in _UNSUPPORTED.items():
        if key in body and not any(_same(body[key], o) for o in off):
            raise _BadRequest(f"{key} is not supported by headsteer serve, got {short_repr(body[key])}")
    n = body.get("n")
    if n is not None and not _same(n, 1):
        raise _BadRequest(f"n must be 1 (one answer per request), got {short_repr(n)}")
    for key, kind in _TYPED.items():
        if body.get(key) is not None and not isinstance(body[key], kind):
            want = "an object" if kind is Mapping else f"a {kind.__name__}"
            raise _BadRequest(f"{key} must be {want}, got {short_repr(body[key])}")
    if isinstance(body.get("stream_options"), Mapping):
        usage = body["stream_options"].get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise _BadRequest(f"stream_options.include_usage must be true or false, got {short_repr(usage)}")


def _parse(body, chat: bool, model_id: str, caa_vectors=None):
    """A `ServeRequest` from an OpenAI body; `_BadRequest` names the bad field."""
    from steer.serving import SamplingParams, ServeRequest, parse_steer

    if not isinstance(body, Mapping):
        raise _BadRequest("the request body must be a JSON object")
    if body.get("model") not in (None, model_id):
        raise _BadRequest(
            f"unknown model {short_repr(body.get('model'))}: this server serves {short_repr(model_id)}"
        )
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _BadRequest("messages must be a non-empty list of {role, content} objects")
        if len(msgs) > MAX_MESSAGES:
            raise _BadRequest(f"messages has {len(msgs)} items, more than the limit of {MAX_MESSAGES}")
        prompt = []
        for i, m in enumerate(msgs):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
                raise _BadRequest(f"messages[{i}] must be an object with a role and a content")
            if m["role"] not in ("system", "user", "assistant", "developer"):
                raise _BadRequest(f"messages[{i}].role {short_repr(m['role'])} is not supported")
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
    from heads.inputs.prompts import check_encodable

    texts = [m["content"] for m in prompt] if chat else [prompt]
    for i, text in enumerate(texts):
        try:
            check_encodable(text, f"messages[{i}].content" if chat else "prompt")
        except ValueError as exc:
            raise _BadRequest(str(exc)) from None
    _refuse_unsupported(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _BadRequest(f"stream must be true or false, got {short_repr(stream)}")
    try:
        params = SamplingParams.from_body(body)
        steer = parse_steer(body.get("steer"), caa_vectors)
    except (TypeError, ValueError) as exc:
        raise _BadRequest(str(exc)) from None
    return ServeRequest(prompt, chat, steer, _emphasize(body), params), stream


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class _TooLarge(Exception):
    """The request body is over the limit (HTTP 413)."""


async def _read_body(request, limit: int) -> bytes:
    """The body, refused (`_TooLarge`) as soon as it is known to exceed `limit` bytes:
    from `Content-Length` before reading anything, else while it streams in."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _TooLarge(f"the request body has {int(declared)} bytes, more than the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():  # a client gone mid-body: ClientDisconnect, see the caller
        size += len(chunk)
        if size > limit:
            raise _TooLarge(f"the request body has more than the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class _AccessLog:
    """ASGI middleware: one log line per HTTP request once its response is sent (streams too).

    The line: client, method and path, status, prompt / completion tokens (when a generation
    ran; `scope["state"]["usage"]`), the finish ("cancelled" for a client that went away) and
    the wall time.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = [0]
        state = scope.setdefault("state", {})

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            usage = state.get("usage")
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            code = state.get("status", status[0]) or 499
            parts = [who, f'"{scope["method"]} {scope["path"]}"', str(code)]
            if usage is not None:
                parts.append(f"prompt_tokens={usage[0]} completion_tokens={usage[1]}")
            if state.get("finish"):
                parts.append(f"finish={state['finish']}")
            parts.append(f"{(time.perf_counter() - t0) * 1000:.0f}ms")
            log.info(" ".join(parts))


def create_app(
    model,
    *,
    max_batch: int = 32,
    wait_s: float = 0.02,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_prompt_tokens: int | None = None,
    caa_vectors=None,
):
    """The FastAPI app serving `model` (a `HeadModel` with a tokenizer).

    Args:
        model: the model to serve; its `name` is the model id clients pass.
        max_batch: most requests decoded together (default 32).
        wait_s: how long the batcher waits for more requests after the first (default 0.02 s).
        max_body_bytes: largest request body (default `MAX_BODY_BYTES`, 4 MiB); a larger one
            gets HTTP 413 before it is read whole.
        max_prompt_tokens: longest rendered prompt in tokens (default None: the model's positions).
        caa_vectors: named `steer.Caa` vectors a request may name (`{"method": "caa", "vector":
            NAME}`; `steer.caa.load_caa_vectors`); each is checked against `model` here.

    Returns:
        a FastAPI app; `app.state.batcher` is the `steer.serving.Batcher` (started with
        the app's lifespan, closed — after finishing queued requests — on shutdown). A client
        that disconnects has its request cancelled (dropped from the queue, or its batch row
        stopped); each request is logged as one line on the `headsteer.serve` logger.
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.concurrency import run_in_threadpool

    from steer.serving import Batcher, BatchGenerator, RequestCancelled

    check_int("max_body_bytes", max_body_bytes, lo=1)
    caa_vectors = dict(caa_vectors or {})
    for name, caa in caa_vectors.items():
        try:
            caa.check(model)
        except ValueError as exc:
            raise HeadsteerValueError(f"CAA vector {short_repr(name)}: {exc}") from None
    generator = BatchGenerator(model, max_prompt_tokens=max_prompt_tokens)
    model_id = model.name

    @asynccontextmanager
    async def lifespan(app):
        app.state.batcher = Batcher(generator, max_batch=max_batch, wait_s=wait_s)
        try:
            yield
        finally:
            await run_in_threadpool(app.state.batcher.close)

    app = FastAPI(title="headsteer", lifespan=lifespan)
    app.add_middleware(_AccessLog)

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
        from starlette.requests import ClientDisconnect

        try:
            raw = await _read_body(request, max_body_bytes)
        except _TooLarge as exc:
            return error(413, f"{exc} (headsteer serve --max-body-mb)", "request_too_large")
        except ClientDisconnect:  # gone before its body arrived: the access log's one 499 line
            return Response(status_code=499)
        try:
            body: Any = load_json_body(raw)  # one line: invalid JSON, a too-large number, too deep
        except ValueError as exc:
            return error(400, _one_line(exc))
        del raw
        try:
            req, stream = _parse(body, chat, model_id, caa_vectors)
            prepared = await run_in_threadpool(generator.prepare, req)
        except (TypeError, ValueError, KeyError, OverflowError) as exc:
            return error(400, _one_line(exc))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_delta(text: str) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ("delta", text))

        def on_done(result) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ("done", result))

        try:
            job = request.app.state.batcher.submit(prepared, on_delta if stream else None, on_done)
        except queue.Full:
            return error(503, "too many requests waiting; retry later", "server_busy")
        except RuntimeError as exc:
            return error(503, _one_line(exc), "server_busy")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        state = request.scope.setdefault("state", {})
        prompt_tokens = int(prepared.enc.attention_mask.sum())

        def usage(c) -> dict:
            state["usage"] = (c.prompt_tokens, c.completion_tokens)
            state["finish"] = c.finish_reason
            return {
                "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens,
                "total_tokens": c.prompt_tokens + c.completion_tokens,
            }

        if not stream:
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
                            state.update(status=499, finish="cancelled", usage=(prompt_tokens, tokens))
                            return Response(status_code=499)
                        continue
                    if kind == "done":
                        break
            except asyncio.CancelledError:  # the server is stopping, or the client went away
                job.cancel()
                raise
            if isinstance(result, RequestCancelled):
                state.update(status=499, finish="cancelled", usage=(prompt_tokens, result.completion_tokens))
                return Response(status_code=499)
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
            done = False
            try:
                if chat:
                    yield chunk("", None, first=True)
                while True:
                    kind, result = await events.get()
                    if kind == "delta":
                        yield chunk(result, None)
                        continue
                    done = True
                    if isinstance(result, BaseException):
                        state["finish"] = "error"
                        err = {"error": {"message": _one_line(result), "type": "server_error"}}
                        yield f"data: {json.dumps(err)}\n\n"
                        break
                    yield chunk(None, result.finish_reason)
                    data = {
                        "id": rid,
                        "object": chunk_obj,
                        "created": created,
                        "model": model_id,
                        "choices": [],
                        "usage": usage(result),
                    }
                    if include_usage:
                        yield f"data: {json.dumps(data)}\n\n"
                    break
                yield "data: [DONE]\n\n"
            finally:  # starlette cancels this generator when the client disconnects
                if not done:
                    job.cancel()
                    state.update(finish="cancelled", usage=(prompt_tokens, state.get("usage", (0, 0))[1]))

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
    max_body_mb: Annotated[
        float, typer.Option(help="largest request body in MiB; larger ones get HTTP 413 (default 4)")
    ] = MAX_BODY_BYTES / 2**20,
    max_prompt_tokens: Annotated[
        int, typer.Option(help="longest prompt in tokens; 0 = the model's positions (default)")
    ] = 0,
    caa_vector: Annotated[
        Path | None,
        typer.Option(
            "--caa-vector",
            help="safetensors file of named CAA vectors (steer.save_caa_vectors); requests name them: "
            '{"method": "caa", "vector": NAME}',
        ),
    ] = None,
) -> None:
    """Serve steered generation over an OpenAI-compatible HTTP API (Ctrl-C / SIGTERM to stop).

    With --json, one JSON line on stdout once the model is loaded: {"url", "model"} (for
    scripts that start the server and wait for it). Each request is logged as one line on
    stderr (client, method and path, status, tokens, time). Bodies over --max-body-mb get
    HTTP 413; a client that disconnects has its request cancelled. --caa-vector loads named
    CAA vectors at start (checked before the model loads, and against it once loaded)."""
    check_loopback(host)
    if not 0 <= port <= 65535:
        raise HeadsteerValueError(f"--port must be in 0..65535, got {port}")
    if max_batch < 1 or not 0 <= batch_wait_ms <= 10_000:
        raise HeadsteerValueError(
            f"--max-batch must be >= 1 and --batch-wait-ms in [0, 10000], got {max_batch}, {batch_wait_ms}"
        )
    if not 0 < max_body_mb <= 4096:
        raise HeadsteerValueError(f"--max-body-mb must be in (0, 4096], got {max_body_mb}")
    if max_prompt_tokens < 0:
        raise HeadsteerValueError(f"--max-prompt-tokens must be >= 0 (0 = no limit), got {max_prompt_tokens}")
    try:
        import uvicorn  # noqa: F401 - the extra, checked before anything binds or loads
    except ImportError:
        raise HeadsteerValueError("headsteer serve needs the extra: pip install 'headsteer[serve]'") from None
    if device_map not in (None, "auto"):
        raise HeadsteerValueError(f"--device-map must be 'auto', got {short_repr(device_map)}")
    if device_map is not None and run.device != "cpu":
        raise HeadsteerValueError(
            f"--device {run.device} and --device-map {device_map} conflict: the device map places the "
            "layers; drop --device"
        )
    from viz.cli.listen import listen_socket, run_uvicorn, url_of

    sock = listen_socket(host, port)  # bound and held before the slow load: a busy port fails now
    try:
        caa_vectors = None
        if caa_vector is not None:
            from steer.caa import load_caa_vectors

            caa_vectors = load_caa_vectors(caa_vector)  # a bad file fails here, before the model loads
        hm = run.load(device_map=device_map)
        app = create_app(
            hm,
            max_batch=max_batch,
            wait_s=batch_wait_ms / 1000,
            max_body_bytes=int(max_body_mb * 2**20),
            max_prompt_tokens=max_prompt_tokens or None,
            caa_vectors=caa_vectors,
        )
    except BaseException:
        sock.close()
        raise
    if not log.handlers:  # one line per request on stderr (after --json's line on stdout)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%dT%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    url = f"{url_of(sock)}/v1"  # the real port with --port 0; an IPv6 host in brackets
    if run.as_json:
        print(json.dumps({"url": url, "model": hm.name}), flush=True)
    run.say(f"serving {hm.name} on {url} (Ctrl-C or SIGTERM to stop)")
    run_uvicorn(app, sock, say=run.say, timeout_graceful_shutdown=600)
