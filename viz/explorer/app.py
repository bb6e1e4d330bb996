"""The head explorer: a FastAPI app serving one page and a small JSON/SSE API.

Endpoints (every request carries its own prompt and heads; the server keeps no
per-user state, so two browser tabs never see each other's choices):

- `GET /` the page; `GET /plotly.min.js` Plotly from the installed `plotly` package.
- `GET /api/info` model shape `n_layers, n_heads, n_kv_heads`, limits, shipped PASTA heads.
- `POST /api/scores {prompt, score}` the `[n_layers, n_heads]` grid: `score` is
  `"span"` (`heads.scorers.attention_mass.span_attention`, last query row) or `"sinks"`
  (`heads.scorers.sinks.sink_stats(...).sink_mass`).
- `POST /api/pattern {prompt, layer, head}` one head's `[T, T]` pattern with token labels.
- `POST /api/generate {prompt, steered, heads, alpha, max_new_tokens}` a server-sent-event
  stream of `{"text": piece}` events, then `{"done": true}` (or `{"error": line}`).

Errors are HTTP 4xx with `{"error": "<one line>"}`; the server stays up. Requests larger
than `MAX_BODY_BYTES`, prompts longer than `MAX_PROMPT_CHARS` and `max_new_tokens` above
`MAX_NEW_TOKENS` are refused before any work. The model is used by one request at a time
(a lock): the engine's active edits are process-wide.
"""

import json
import math
import threading
from importlib import resources
from pathlib import Path

from heads.errors import HeadsteerValueError

__all__ = ["MAX_BODY_BYTES", "MAX_NEW_TOKENS", "MAX_PROMPT_CHARS", "create_explorer", "plotly_js_path"]

MAX_BODY_BYTES = 32_768
"""Largest request body accepted (bytes)."""
MAX_PROMPT_CHARS = 4_000
"""Longest prompt accepted (characters)."""
MAX_NEW_TOKENS = 256
"""Largest `max_new_tokens` accepted."""
MAX_HEADS = 512
"""Most (layer, head) pairs in one steering request."""
SCORES = ("span", "sinks")


def plotly_js_path() -> Path:
    """`plotly.min.js` of the installed `plotly` package (served locally, never a CDN)."""
    return Path(str(resources.files("plotly").joinpath("package_data/plotly.min.js")))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:500]


def _prompt(body: dict) -> str:
    p = body.get("prompt")
    if not isinstance(p, str) or not p.strip():
        raise HeadsteerValueError("prompt must be a non-empty string")
    if len(p) > MAX_PROMPT_CHARS:
        raise HeadsteerValueError(f"prompt has {len(p)} characters, more than the limit {MAX_PROMPT_CHARS}")
    return p


def _int(body: dict, key: str, lo: int, hi: int) -> int:
    v = body.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise HeadsteerValueError(f"{key} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _heads(body: dict, n_layers: int, n_heads: int) -> dict[int, list[int]]:
    raw = body.get("heads")
    if not isinstance(raw, list) or not raw:
        raise HeadsteerValueError(
            "heads must be a non-empty list of [layer, head] pairs: click heads in the grid"
        )
    if len(raw) > MAX_HEADS:
        raise HeadsteerValueError(f"heads has {len(raw)} pairs, more than the limit {MAX_HEADS}")
    out: dict[int, list[int]] = {}
    for pair in raw:
        ok = (
            isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
        )
        if not ok or not (0 <= pair[0] < n_layers and 0 <= pair[1] < n_heads):
            raise HeadsteerValueError(
                f"bad head {pair!r}: need [layer, head] with layer < {n_layers}, head < {n_heads}"
            )
        out.setdefault(pair[0], [])
        if pair[1] not in out[pair[0]]:
            out[pair[0]].append(pair[1])
    return out


def _alpha(body: dict) -> float:
    a = body.get("alpha", 0.01)
    if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a) or a <= 0:
        raise HeadsteerValueError(f"alpha must be a positive number, got {a!r}")
    return float(a)


def _shipped_heads(model_name: str) -> list[list[int]]:
    """The shipped PASTA profile of the embedded model as [layer, head] pairs ([] for other models)."""
    try:
        from steer.profiles import shipped_profile

        data = json.loads(Path(shipped_profile("pasta", model_name)).read_text())
    except (ValueError, OSError):
        return []
    return [[int(layer), int(h)] for layer, hs in data.items() for h in hs]


def create_explorer(model):
    """Build the explorer app for a loaded `HeadModel` (with a tokenizer).

    Raises:
        ValueError: the model has no tokenizer.
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, StreamingResponse

    if model.tokenizer is None:
        raise HeadsteerValueError("the explorer needs a HeadModel with a tokenizer")
    from heads.inputs.prompts import encode_prompts
    from heads.scorers.attention_mass import head_pattern, span_attention
    from heads.scorers.sinks import sink_stats
    from steer.pasta.method import Pasta
    from steer.steered_model import SteeredModel

    lock = threading.Lock()
    steered_model = SteeredModel(model)
    page = resources.files("viz.explorer").joinpath("page.html").read_text(encoding="utf-8")
    shipped = _shipped_heads(model.name)
    app = FastAPI(title="headsteer explorer", docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    async def read_body(request: Request) -> dict:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise _TooLarge(f"request body of {size} bytes is larger than the limit {MAX_BODY_BYTES}")
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise _TooLarge(f"request body is larger than the limit {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            raise HeadsteerValueError("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise HeadsteerValueError("request body must be a JSON object")
        return body

    def guarded(fn):
        async def endpoint(request: Request):
            try:
                body = await read_body(request)
                return await fn(body)
            except _TooLarge as exc:
                return error(413, _one_line(exc))
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                return error(400, _one_line(exc))

        endpoint.__name__ = fn.__name__
        return endpoint

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return HTMLResponse(
            page, headers={"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff"}
        )

    @app.get("/plotly.min.js")
    async def plotly_js():
        return FileResponse(plotly_js_path(), media_type="application/javascript")

    @app.get("/api/info")
    async def info():
        return {
            "model": model.name,
            "n_layers": model.n_layers,
            "n_heads": model.n_heads,
            "n_kv_heads": model.n_kv_heads,
            "scores": list(SCORES),
            "shipped_heads": shipped,
            "limits": {
                "max_body_bytes": MAX_BODY_BYTES,
                "max_prompt_chars": MAX_PROMPT_CHARS,
                "max_new_tokens": MAX_NEW_TOKENS,
            },
        }

    async def scores(body: dict):
        prompt = _prompt(body)
        kind = body.get("score", "span")
        if kind not in SCORES:
            raise HeadsteerValueError(f"score must be one of {SCORES}, got {kind!r}")
        with lock:
            if kind == "span":
                s = span_attention(model, prompt).scores
            else:
                s = sink_stats(model, [prompt]).sink_mass.scores
        grid = [[None if not math.isfinite(v) else round(v, 5) for v in row] for row in s.tolist()]
        return {"score": kind, "scores": grid, "n_layers": model.n_layers, "n_heads": model.n_heads}

    async def pattern(body: dict):
        prompt = _prompt(body)
        layer = _int(body, "layer", 0, model.n_layers - 1)
        head = _int(body, "head", 0, model.n_heads - 1)
        with lock:
            probs, tokens, spans = head_pattern(model, prompt, layer, head)
        return {
            "layer": layer,
            "head": head,
            "probs": [[round(v, 5) for v in row] for row in probs.float().tolist()],
            "tokens": tokens,
            "spans": [list(s) for s in spans],
        }

    async def generate(body: dict):
        prompt = _prompt(body)
        steered = bool(body.get("steered", False))
        n_new = _int(body, "max_new_tokens", 1, MAX_NEW_TOKENS) if "max_new_tokens" in body else 32
        steer = []
        if steered:
            heads = _heads(body, model.n_layers, model.n_heads)
            enc = encode_prompts(model.tokenizer, prompt)
            if not enc.spans[0]:
                raise HeadsteerValueError("steering needs a span: mark it in the prompt with **...**")
            steer = [Pasta(heads=heads, alpha=_alpha(body))]
        return StreamingResponse(_stream(prompt, steer, n_new), media_type="text/event-stream")

    def _stream(prompt: str, steer: list, n_new: int):
        from transformers import TextIteratorStreamer

        streamer = TextIteratorStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True)
        failure: list[str] = []

        def work() -> None:
            try:
                with lock:
                    steered_model.generate(
                        prompt, steer, max_new_tokens=n_new, progress=False, streamer=streamer
                    )
            except Exception as exc:  # reported to the page as one line
                failure.append(_one_line(exc))
                streamer.end()

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        for piece in streamer:
            if piece:
                yield f"data: {json.dumps({'text': piece})}\n\n"
        thread.join()
        end = {"error": failure[0]} if failure else {"done": True}
        yield f"data: {json.dumps(end)}\n\n"

    for path, fn in (("/api/scores", scores), ("/api/pattern", pattern), ("/api/generate", generate)):
        app.add_api_route(path, guarded(fn), methods=["POST"])
    return app


class _TooLarge(ValueError):
    """A request refused with HTTP 413."""


_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline' 'unsafe-eval'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:"
)
