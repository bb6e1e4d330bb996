"""`headsteer serve`'s access log: one line per HTTP request once its response is sent."""

import logging
import time
from typing import Any

__all__ = ["AccessLog", "log"]

log = logging.getLogger("headsteer.serve")
"""One line per request: client, method, path, status, prompt and completion tokens, time."""


class AccessLog:
    """ASGI middleware: one log line per HTTP request once its response is sent (streams too).

    The line: client, method and path, status, prompt / completion tokens (when a generation
    ran; `scope["state"]["usage"]`), the finish ("cancelled" for a client that went away) and
    the wall time.
    """

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [0]
        state = scope.setdefault("state", {})

        async def send_status(message: Any) -> None:
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
