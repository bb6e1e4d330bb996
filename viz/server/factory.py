"""`viz.server.app.create_app`: the FastAPI app of `headsteer serve` (see `viz.server.app`)."""

from collections.abc import Collection, Mapping
from typing import Any

from heads._util.validation import check_int, short_repr
from heads.errors import HeadsteerValueError
from viz.server.cli_limits import MAX_BODY_BYTES
from viz.server.requests import ServeContext

__all__ = ["create_app"]


def create_app(
    model: Any,
    *,
    max_batch: int = 32,
    wait_s: float = 0.02,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_prompt_tokens: int | None = None,
    caa_vectors: Mapping[str, Any] | None = None,
    hosts: Collection[str] | None = None,
    api_key: str | None = None,
) -> Any:
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
        hosts: the `Host` names a request may name (compared case-insensitively, without a
            trailing dot; a loopback IP literal is always accepted); `headsteer serve` on a
            loopback address passes `viz.web.guard.loopback_hosts(...)`; default None: any.
        api_key: the key every request must send as `Authorization: Bearer KEY` (HTTP 401
            otherwise; default None: none).

    Returns:
        a FastAPI app; `app.state.batcher` is the `steer.serving.Batcher` (started with
        the app's lifespan, closed — after finishing queued requests — on shutdown). A client
        that disconnects has its request cancelled (dropped from the queue, or its batch row
        stopped); each request is logged as one line on the `headsteer.serve` logger. Every
        `POST` must be `Content-Type: application/json` (HTTP 415).
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import Response
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import ClientDisconnect

    from steer.serving import Batcher, BatchGenerator
    from viz.server.access_log import AccessLog
    from viz.server.routes import openai_error, router
    from viz.web.body import BodyTooLarge, one_line
    from viz.web.guard import CrossSiteGuard

    check_int("max_body_bytes", max_body_bytes, lo=1)
    caa_vectors = dict(caa_vectors or {})
    for name, caa in caa_vectors.items():
        try:
            caa.check(model)
        except ValueError as exc:
            raise HeadsteerValueError(f"CAA vector {short_repr(name)}: {exc}") from None
    generator = BatchGenerator(model, max_prompt_tokens=max_prompt_tokens)

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        app.state.batcher = Batcher(generator, max_batch=max_batch, wait_s=wait_s)
        try:
            yield
        finally:
            await run_in_threadpool(app.state.batcher.close)

    app = FastAPI(title="headsteer", lifespan=lifespan)
    app.state.generator = generator
    app.state.max_body_bytes = max_body_bytes
    app.state.serve_context = ServeContext(model.name, caa_vectors)
    app.include_router(router)

    async def too_large(request: Any, exc: Exception) -> Any:
        return openai_error(413, f"{one_line(exc)} (headsteer serve --max-body-mb)", "request_too_large")

    async def gone(request: Any, exc: Exception) -> Response:  # the access log's one 499 line
        return Response(status_code=499)

    async def bad(request: Any, exc: Exception) -> Any:
        return openai_error(400, one_line(exc, 10_000))

    app.add_exception_handler(BodyTooLarge, too_large)
    app.add_exception_handler(ClientDisconnect, gone)
    for kind in (ValueError, TypeError, KeyError, OverflowError):
        app.add_exception_handler(kind, bad)

    def refused(status: int, message: str, code: str) -> Any:
        kind = "authentication_error" if status == 401 else "invalid_request_error"
        response = openai_error(status, message, kind)
        response.headers["X-Headsteer-Refused"] = code
        return response

    app.add_middleware(CrossSiteGuard, hosts=hosts, api_key=api_key, render=refused)
    app.add_middleware(AccessLog)  # outermost: refused requests are logged too
    return app
