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
Concurrent requests are batched dynamically (`steer.serving.Batcher`), each with its own
steering on its own batch row. Other sites cannot use it (`viz.web.guard.CrossSiteGuard`): on a
loopback address a `Host` that is not the server's is HTTP 403, a `POST` body that is not JSON
HTTP 415; it listens on a non-loopback address only with an API key (`--api-key`: HTTP 401
without it). SIGTERM stops accepting requests and lets the in-flight ones finish.

The code: `viz.server.requests` (a pydantic model per request), `viz.server.routes` (the
router), `viz.server.access_log` (one line per request), `viz.server.cli` (`serve_command`),
`viz.server.factory` (`create_app`).
FastAPI and uvicorn are the optional extra `serve` (`pip install headsteer[serve]`); they are
imported only when a server is built.
"""

from viz.server.access_log import log
from viz.server.cli import check_loopback, serve_command
from viz.server.cli_limits import MAX_BODY_BYTES
from viz.server.factory import create_app
from viz.server.requests import MAX_EMPHASIZE, MAX_MESSAGES, MAX_PROMPT_CHARS

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_EMPHASIZE",
    "MAX_MESSAGES",
    "MAX_PROMPT_CHARS",
    "check_loopback",
    "create_app",
    "log",
    "serve_command",
]
