"""The head explorer: a FastAPI app serving one page and a small JSON / server-sent-event API.

Endpoints (each one's request and response fields: docs/explorer.md, "HTTP API"; every
request carries its own prompt and heads, so two browser tabs never see
each other's choices; the one per-tab thing kept is the pattern cache, keyed by the tab's
random id and the prompt):

- `GET /` the page; `GET /plotly.min.js` Plotly from the installed `plotly` package.
- `GET /api/info` model shape `n_layers, n_heads, n_kv_heads`, limits, score choices, the
  shipped PASTA heads.
- `POST /api/scores {prompt, score, job}` (event stream) the `[n_layers, n_heads]` grid:
  `"span"` (`heads.scorers.attention_mass.span_attention`, last query row), `"sinks"`
  (`heads.scorers.sinks.sink_stats(...).sink_mass`) or `"atlas"` (the head atlas,
  `heads.scorers.roles.atlas.head_atlas`: a role per head and every detector score; it does not
  depend on the prompt and is computed once per server, or loaded with `--atlas`), `"dla"`
  (each head's direct logit of the model's top next token at the last position,
  `heads.scorers.patching.logit.head_logits`), `"ships"` (`heads.scorers.safety.ships.ships`
  on the prompt, its defaults), `"maps"` (each head's best static MAPS relation score on the
  shipped relations, `heads.scorers.maps.static.maps_scores(...).best_relation()`, once per
  server) or `"probes"` (per-head probe accuracy on `PROBE_TASK`,
  `probes.head_probes.fit_head_probes`, once per server). The `"dla"` / `"ships"` grids are
  kept for the last `SCORE_CACHE_PROMPTS` prompts.
- `POST /api/prepare {prompt, tab}` records every head's pattern on the prompt in one forward
  and keeps them for that tab (`viz.explorer.patterns.PatternCache`); the page sends it when the
  prompt stops changing, so a click finds the patterns ready.
- `POST /api/pattern {prompt, layer, head, tab}` one head's `[T, T]` pattern with token labels
  (4 decimals), read from the tab's cache (filled first when missing; a prompt too large for the
  cache budget runs one forward for that head).
- `POST /api/head {prompt, layer, head}` the head's card: top logit-lens tokens of its output
  at the last position (its direct logit attribution through the final norm,
  `heads.scorers.roles.lens.AttentionLens.init` untrained), its MAPS salient operations
  (`heads.scorers.maps.static.salient_operations`), its value in each of the dla / ships / maps /
  probes scores already computed (`scores`, read from the caches) and its atlas row when the
  atlas is known. Lens tokens (per prompt and head) and MAPS operations (per head) are kept
  (`CARD_CACHE` entries), so a second card for the same head computes nothing.
- `POST /api/generate {prompt, steered, method, heads, <parameter>, max_new_tokens, job}` (event
  stream; `method` one of `viz.explorer.steering.STEER_METHODS`, built by `steer.serving.parse_steer`;
  a no-op value such as PASTA's `alpha` 1 is HTTP 400 with the warning text the CLI prints,
  `steer.noop.refusing_noop`)
  `{"text": piece}` events as tokens are generated; a steered run on a prompt with a span then sends
  `{"span_share": {"before": [L], "after": [L]}}`: per layer, the last prompt position's
  attention share on the `**…**` span averaged over heads
  (`heads.scorers.attention_mass.span_attention(...).scores.mean(1)`), unsteered and steered.
- `POST /api/patch {clean, corrupted, answer, counterfactual, job}` (event stream) the
  `[n_layers, n_heads]` `head_out` activation-patching map (`heads.scorers.patching.patch`,
  denoising, normalised logit difference; log-prob without a counterfactual), sent as a
  `{"heads_map": ...}` event as soon as it is done, then the `[n_layers, T]` `resid_pre` map
  (the residual stream entering each layer at each position) in the result, with the tokens.
- `POST /api/cancel {job}` stops that job: a generation stops at its next token, a score or
  patching sweep at its next progress step, a job still waiting for the model never starts.

Event streams (`text/event-stream`, one JSON object per `data:` line): `{"job": id}` first,
then `{"status": line}` / `{"progress": [done, total]}` / `{"text": piece}` while working, and
exactly one last event: `{"result": {...}}` (`{"done": true}` for generation), `{"error": line}`
or `{"cancelled": true}`. A job id is made by the page (8-64 characters of `[A-Za-z0-9_-]`);
without one the server draws one. At most `MAX_JOBS` jobs run or wait at once.

Errors found before the work starts are HTTP 4xx with `{"error": "<one line>"}`; the server
stays up. Requests larger than `MAX_BODY_BYTES`, prompts longer than `MAX_PROMPT_CHARS` and
`max_new_tokens` above `MAX_NEW_TOKENS` are refused before any work. The model is used by one
job at a time (a lock): the engine's active edits are process-wide.
"""

import gzip
import inspect
import json
import math
import threading
from collections.abc import Callable, Collection
from importlib import resources
from pathlib import Path
from typing import Any

from heads._util.validation import check_int, load_json_body, short_repr
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import check_encodable
from viz.explorer.jobs import JOB_ID, MAX_JOBS, Jobs, job_stream, one_line
from viz.explorer.scores import (
    PROBE_LIMIT,
    PROBE_TASK,
    Cancelled,
    atlas_result,
    dla_result,
    grid,
    maps_result,
    probes_result,
    progress_reporter,
    ships_result,
)
from viz.explorer.steering import STEER_FIELDS, STEER_METHODS, check_edits, parse_steering

__all__ = [
    "MAX_ANSWER_CHARS",
    "MAX_BODY_BYTES",
    "MAX_JOBS",
    "MAX_NEW_TOKENS",
    "MAX_PROMPT_CHARS",
    "LOOPBACK_HOSTS",
    "MAX_PATTERN_TOKENS",
    "PATTERN_CACHE_BYTES",
    "PROBE_LIMIT",
    "PROBE_TASK",
    "SCORES",
    "Jobs",
    "create_explorer",
    "plotly_js_path",
]

MAX_BODY_BYTES = 32_768
"""Largest request body accepted (bytes)."""
MAX_PROMPT_CHARS = 4_000
"""Longest prompt accepted (characters)."""
MAX_NEW_TOKENS = 256
"""Largest `max_new_tokens` accepted."""
MAX_HEADS = 512
"""Most (layer, head) pairs in one steering request."""
MAX_ANSWER_CHARS = 64
"""Longest answer / counterfactual string of a patching pair (characters)."""

PATTERN_CACHE_BYTES = 512 * 2**20
"""Default byte budget of the per-tab pattern cache (`viz.explorer.patterns.PatternCache`)."""
SCORES = ("span", "sinks", "atlas", "dla", "ships", "maps", "probes")
"""Score choices of the overview grid."""
SCORE_CACHE_PROMPTS = 16
"""Prompts whose prompt-dependent grids (`"dla"`, `"ships"`) are kept, least recent out."""
CARD_CACHE = 256
"""Head cards (per prompt and head) kept, least recent out."""
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""The `Host` names `headsteer explore` accepts when it listens on a loopback address."""
MAX_PATTERN_TOKENS = 2048
"""Longest prompt (tokens) the explorer takes: its `[T, T]` pattern is sent to the page."""
MAX_SOURCES_BYTES = 512 * 2**20
"""Largest vocabulary source matrix `[V, D]` fp32 the head card keeps for MAPS (bytes)."""

FIELDS: dict[str, frozenset[str]] = {
    "/api/scores": frozenset({"prompt", "score", "job"}),
    "/api/prepare": frozenset({"prompt", "tab"}),
    "/api/pattern": frozenset({"prompt", "layer", "head", "tab"}),
    "/api/head": frozenset({"prompt", "layer", "head"}),
    "/api/generate": frozenset({"prompt", "steered", "max_new_tokens", "job"}) | STEER_FIELDS,
    "/api/patch": frozenset({"clean", "corrupted", "answer", "counterfactual", "job"}),
    "/api/cancel": frozenset({"job"}),
}
"""The fields each `POST` endpoint takes; any other is HTTP 400 naming it."""


def plotly_js_path() -> Path:
    """`plotly.min.js` of the installed `plotly` package (served locally, never a CDN)."""
    return Path(str(resources.files("plotly").joinpath("package_data/plotly.min.js")))


def _text(body: dict, key: str = "prompt", limit: int = MAX_PROMPT_CHARS, *, space: bool = False) -> str:
    """`body[key]`, a non-empty string of at most `limit` characters (white space alone only
    with `space`: a patching answer may be the token "\\n" or " ")."""
    p = body.get(key)
    if not isinstance(p, str) or not (p if space else p.strip()):
        raise HeadsteerValueError(f"{key} must be a non-empty string")
    if len(p) > limit:
        raise HeadsteerValueError(f"{key} has {len(p)} characters, more than the limit {limit}")
    check_encodable(p, key)  # a lone surrogate, named by field (the tokenizer's own error does not)
    return p


def _int(body: dict, key: str, lo: int, hi: int) -> int:
    return check_int(key, body.get(key), lo=lo, hi=hi)


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
                f"bad head {short_repr(pair)}: need [layer, head] with layer < {n_layers}, head < {n_heads}"
            )
        out.setdefault(pair[0], [])
        if pair[1] not in out[pair[0]]:
            out[pair[0]].append(pair[1])
    return out


def _shipped_heads(model_name: str) -> list[list[int]]:
    """The shipped PASTA profile of the embedded model as [layer, head] pairs ([] for other models)."""
    try:
        from steer.profiles import shipped_profile

        data = json.loads(Path(shipped_profile("pasta", model_name)).read_text())
    except (ValueError, OSError):
        return []
    return [[int(layer), int(h)] for layer, hs in data.items() for h in hs]


class _Lru:
    """A small thread-safe least-recently-used map (at most `size` entries)."""

    def __init__(self, size: int):
        from collections import OrderedDict

        self.size = size
        self._d: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            if key not in self._d:
                return None
            self._d.move_to_end(key)
            return self._d[key]

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._d[key] = value
            self._d.move_to_end(key)
            while len(self._d) > self.size:
                self._d.popitem(last=False)


def create_explorer(
    model, *, atlas=None, pattern_cache_bytes: int = PATTERN_CACHE_BYTES, hosts: Collection[str] | None = None
):
    """Build the explorer app for a loaded `HeadModel` (with a tokenizer).

    Args:
        model: the `HeadModel`.
        atlas: a `HeadAtlas` of this model to colour the grid by (default None: computed with
            `head_atlas` the first time the page asks for it, then kept).
        pattern_cache_bytes: byte budget of the per-tab pattern cache (`PatternCache`,
            default `PATTERN_CACHE_BYTES`, 512 MiB; 0 turns it off: a forward per click).
        hosts: the host names a request's `Host` header may name (`headsteer explore` on a
            loopback address passes `LOOPBACK_HOSTS`, so a DNS-rebinding page cannot read the
            API); default None: any.

    Raises:
        ValueError: the model has no tokenizer; an atlas of another geometry.
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import ClientDisconnect

    if model.tokenizer is None:
        raise HeadsteerValueError("the explorer needs a HeadModel with a tokenizer")
    from heads.inputs.prompts import encode_prompts
    from heads.scorers.attention_mass import head_pattern, span_attention
    from heads.scorers.sinks import sink_stats
    from steer.steered_model import SteeredModel
    from viz.explorer.patterns import PatternCache, Patterns, all_patterns, pattern_bytes

    if atlas is not None and len(atlas.frame) != model.n_layers * model.n_heads:
        raise HeadsteerValueError(
            f"the atlas has {len(atlas.frame)} heads, the model {model.n_layers * model.n_heads}"
        )
    lock = threading.Lock()
    jobs = Jobs()
    steered_model = SteeredModel(model)
    page = resources.files("viz.explorer").joinpath("page.html").read_text(encoding="utf-8")
    shipped = _shipped_heads(model.name)
    cache: dict[str, Any] = {"atlas": atlas, "maps": None, "probes": None, "sources": None}
    prompt_scores = _Lru(SCORE_CACHE_PROMPTS * 2)  # (kind, prompt) -> result of "dla" / "ships"
    cards = _Lru(CARD_CACHE)  # ("lens", prompt, layer, head) / ("maps", layer, head) -> card parts
    patterns = PatternCache(pattern_cache_bytes)
    app = FastAPI(title="headsteer explorer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.jobs = jobs
    allowed = None if hosts is None else {h.lower() for h in hosts}

    @app.middleware("http")
    async def check_host(request: Request, call_next):
        name = request.headers.get("host", "").lower()
        name = name[1 : name.index("]")] if name.startswith("[") and "]" in name else name.rsplit(":", 1)[0]
        if allowed is not None and name not in allowed:
            return error(403, f"Host {short_repr(name)} is not this server's: open it at its own address")
        return await call_next(request)

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
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":  # a cross-origin page can only send text/plain without asking
            raise _Forbidden(f"a request body must be application/json, got {short_repr(kind or None)}")
        body = load_json_body(raw)  # one line: invalid JSON, a too-large number, too deep
        if not isinstance(body, dict):
            raise HeadsteerValueError("request body must be a JSON object")
        return body

    def guarded(fn, fields: frozenset[str]):
        async def endpoint(request: Request):
            try:
                body = await read_body(request)
                unknown = sorted(str(k) for k in body if k not in fields)
                if unknown:  # a typo ("scores" for "score") must not silently run the default
                    raise HeadsteerValueError(
                        f"unknown field(s) {short_repr(unknown)}: this endpoint takes {sorted(fields)}"
                    )
                if inspect.iscoroutinefunction(fn):
                    return await fn(body)
                return await run_in_threadpool(fn, body)  # waits for the model lock off the event loop
            except _TooLarge as exc:
                return error(413, one_line(exc))
            except _Forbidden as exc:
                return error(415, one_line(exc))
            except ClientDisconnect:  # the client left before its body arrived: nothing to answer
                return Response(status_code=499)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                return error(400, one_line(exc))

        endpoint.__name__ = fn.__name__
        return endpoint

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return HTMLResponse(
            page, headers={"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff"}
        )

    @app.get("/plotly.min.js")
    async def plotly_js(request: Request):
        if "gzip" not in request.headers.get("accept-encoding", ""):
            return FileResponse(plotly_js_path(), media_type="application/javascript")
        if "plotly_gz" not in cache:  # compressed once per server: about a third of the bytes
            cache["plotly_gz"] = await run_in_threadpool(gzip.compress, plotly_js_path().read_bytes(), 6)
        return Response(
            cache["plotly_gz"],
            media_type="application/javascript",
            headers={"Content-Encoding": "gzip", "Vary": "Accept-Encoding", "Cache-Control": "max-age=3600"},
        )

    @app.get("/api/info")
    async def info():
        return {
            "model": model.name,
            "n_layers": model.n_layers,
            "n_heads": model.n_heads,
            "n_kv_heads": model.n_kv_heads,
            "scores": list(SCORES),
            "atlas_ready": cache["atlas"] is not None,
            "shipped_heads": shipped,
            "steer_methods": {
                name: {"parameter": m.parameter, "default": m.default, "heads": m.heads, "span": m.span}
                for name, m in STEER_METHODS.items()
            },
            "limits": {
                "max_body_bytes": MAX_BODY_BYTES,
                "max_prompt_chars": MAX_PROMPT_CHARS,
                "max_new_tokens": MAX_NEW_TOKENS,
                "max_answer_chars": MAX_ANSWER_CHARS,
                "max_jobs": MAX_JOBS,
            },
        }

    async def scores(body: dict):
        prompt = _text(body)
        kind = body.get("score", "span")
        if kind not in SCORES:
            raise HeadsteerValueError(f"score must be one of {SCORES}, got {short_repr(kind)}")
        job = Jobs.check_id(body.get("job"))
        relations = None
        enc = encoded(prompt)  # bad markup, too many tokens: 400 for every kind
        if kind == "span":
            if not enc.spans[0]:
                raise HeadsteerValueError("span attention needs a span: mark it in the prompt with **...**")
        elif kind == "dla":
            from heads.scorers.patching.logit import check_dla_model

            check_dla_model(model)  # a post-norm family or a final norm without eps: HTTP 400
        elif kind == "maps" and cache["maps"] is None:
            from probes.datasets.relations import load_relations

            relations = load_relations(model.tokenizer, d_vocab=model.d_vocab).relations
        elif kind == "probes" and cache["probes"] is None:
            if not getattr(model.tokenizer, "chat_template", None):
                raise HeadsteerValueError(
                    f"the probes score needs a chat template (the {PROBE_TASK} requests are chats); "
                    "this tokenizer has none"
                )

        def work(emit, flag) -> dict:
            if kind == "atlas":
                return atlas_result(model, cache, emit, flag)
            if kind in ("dla", "ships"):
                got = prompt_scores.get((kind, prompt))
                if got is None:
                    got = (dla_result if kind == "dla" else ships_result)(model, prompt, emit, flag)
                    prompt_scores.put((kind, prompt), got)
                return {"result": got}
            if kind == "maps":
                return {"result": maps_result(model, cache, relations, emit, flag)}
            if kind == "probes":
                return {"result": probes_result(model, cache, emit, flag)}
            if kind == "span":
                s = span_attention(model, prompt).scores
            else:
                s = sink_stats(model, [prompt]).sink_mass.scores
            return {"result": {"score": kind, "scores": grid(s)}}

        return job_stream(jobs, lock, job, work)

    def encoded(prompt: str, new_tokens: int = 0):
        """The prompt encoded as every endpoint runs it, refused (400) before any job when it
        does not fit the model's positions with `new_tokens` more, or when a `[T, T]` pattern
        of it would pass `MAX_PATTERN_TOKENS`."""
        from steer.steered_model import check_new_tokens

        enc = encode_prompts(model.tokenizer, prompt)
        check_new_tokens(model, enc.length, new_tokens, "max_new_tokens")
        if enc.length > MAX_PATTERN_TOKENS:
            raise HeadsteerValueError(
                f"the prompt has {enc.length} tokens, more than the explorer's limit of "
                f"{MAX_PATTERN_TOKENS} (a [T, T] pattern of it would be {enc.length**2:,} numbers)"
            )
        return enc

    def check_head(body: dict) -> tuple[str, int, int]:
        return (
            _text(body),
            _int(body, "layer", 0, model.n_layers - 1),
            _int(body, "head", 0, model.n_heads - 1),
        )

    def tab_of(body: dict) -> str:
        tab = body.get("tab", "")
        if not isinstance(tab, str) or (tab != "" and not JOB_ID.fullmatch(tab)):
            raise HeadsteerValueError("tab must be 8-64 characters of letters, digits, '_' or '-'")
        return tab

    def patterns_of(prompt: str, tab: str) -> Patterns | None:
        """The prompt's cached patterns, computed now (one forward) when missing; None when they
        would not fit the cache (the caller then computes one head). A cached prompt passed
        `encoded` when it was put, so a click on it encodes nothing."""
        got = patterns.get(tab, prompt)
        if got is not None:
            return got
        n_tokens = int(encoded(prompt).attention_mask.sum())  # 400 before any forward
        if not patterns.fits(pattern_bytes(model.n_layers, model.n_heads, n_tokens)):
            return None
        with lock:
            got = patterns.get(tab, prompt)  # another request may have computed it meanwhile
            if got is None:
                got = all_patterns(model, prompt)
                patterns.put(tab, prompt, got)
        return got

    def prepare(body: dict):
        prompt, tab = _text(body), tab_of(body)
        got = patterns_of(prompt, tab)
        return {"cached": got is not None, "tokens": None if got is None else len(got.tokens)}

    def pattern(body: dict):
        prompt, layer, head = check_head(body)
        got = patterns_of(prompt, tab_of(body))
        if got is None:
            with lock:
                probs, tokens, spans = head_pattern(model, prompt, layer, head)
        else:
            probs, tokens, spans = got.probs[layer, head], got.tokens, got.spans
        probs = (probs.double() * 1e4).round() / 1e4  # 4 decimals, in float64 so the JSON has 4 too
        body = {
            "layer": layer,
            "head": head,
            "probs": probs.tolist(),
            "tokens": tokens,
            "spans": [list(s) for s in spans],
            "cached": got is not None,
        }
        return JSONResponse(body)  # plain json.dumps: FastAPI's per-value encoder is slow on [T, T]

    def head_scores(prompt: str, layer: int, head: int) -> dict[str, float | None]:
        """The head's value in every new score already computed (for this prompt where it
        depends on the prompt), read from the caches: nothing is computed here."""
        got: dict[str, float | None] = {}
        for kind in ("dla", "ships"):
            res = prompt_scores.get((kind, prompt))
            if res is not None:
                got[kind] = res["scores"][layer][head]
        if cache["maps"] is not None:
            got["maps"] = grid(cache["maps"].best_relation()[0].scores)[layer][head]
        if cache["probes"] is not None:
            got["probes"] = grid(cache["probes"].accuracy.scores)[layer][head]
        return got

    def sources_of(layer: int):
        """Ẽ of the whole vocabulary for MAPS' salient operations, kept once for every layer
        above 0 when it fits `MAX_SOURCES_BYTES` (it is most of a card's first cost); call
        under the lock."""
        from heads.scorers.maps.static import vocabulary_sources

        if layer == 0 or model.d_vocab * model.d_model * 4 > MAX_SOURCES_BYTES:
            return None
        if cache.get("sources") is None:
            cache["sources"] = vocabulary_sources(model, layer)
        return cache["sources"]

    def head_card(body: dict):
        prompt, layer, head = check_head(body)
        from heads.scorers.maps.static import salient_operations
        from heads.scorers.roles.lens import AttentionLens

        text = encode_prompts(model.tokenizer, prompt).texts[0]
        lens_key, maps_key = ("lens", text, layer, head), ("maps", layer, head)
        lens_part, maps_part = cards.get(lens_key), cards.get(maps_key)
        if lens_part is None or maps_part is None:
            with lock:
                if lens_part is None:
                    lens = AttentionLens.init(model, [(layer, head)])
                    top = lens.top_tokens(model, text, layer, head, k=5)
                    lens_part = {
                        "lens_tokens": list(top["untrained_tokens"].iloc[-1]),
                        "model_tokens": list(top["model_tokens"].iloc[-1]),
                    }
                    cards.put(lens_key, lens_part)
                if maps_part is None:
                    ops = salient_operations(model, layer, head, k_s=5, k_m=3, sources=sources_of(layer))
                    maps_part = [
                        {"source": str(s), "targets": [str(t) for t in ts]}
                        for s, ts in zip(ops["source"], ops["targets"], strict=True)
                    ]
                    cards.put(maps_key, maps_part)
        out: dict[str, Any] = {
            "layer": layer,
            "head": head,
            "lens_tokens": list(lens_part["lens_tokens"]),
            "model_tokens": list(lens_part["model_tokens"]),
            "maps": [dict(m) for m in maps_part],
            "scores": head_scores(prompt, layer, head),
        }
        if cache["maps"] is not None:
            out["maps_describe"] = cache["maps"].describe(layer, head)
        if cache["atlas"] is not None:
            f = cache["atlas"].frame
            row = f[(f["layer"] == layer) & (f["head"] == head)].iloc[0]
            out["atlas"] = {
                k: (
                    str(v)
                    if isinstance(v, str)
                    else (round(float(v), 5) if math.isfinite(float(v)) else None)
                )
                for k, v in row.items()
                if k not in ("layer", "head", "kv_head")
            }
        return out

    async def generate(body: dict):
        prompt = _text(body)
        steered = body.get("steered", False)
        if not isinstance(steered, bool):
            raise HeadsteerValueError(f"steered must be true or false, got {short_repr(steered)}")
        n_new = _int(body, "max_new_tokens", 1, MAX_NEW_TOKENS) if "max_new_tokens" in body else 32
        job = Jobs.check_id(body.get("job"))
        steer = []
        enc = encoded(prompt, n_new)  # bad markup, too many tokens: 400 before the job
        span = bool(enc.spans[0])
        if steered:
            steer = parse_steering(body, lambda b: _heads(b, model.n_layers, model.n_heads), lambda: span)
            check_edits(model, enc, steer)  # e.g. an ablation factor the dtype cannot hold
        elif set(body) & STEER_FIELDS:
            raise HeadsteerValueError(
                f"{', '.join(sorted(set(body) & STEER_FIELDS))} only apply to a steered run: add "
                '"steered": true'
            )

        def work(emit, flag) -> dict:
            streamer = _Streamer(model.tokenizer, emit, flag)
            steered_model.generate(prompt, steer, max_new_tokens=n_new, progress=False, streamer=streamer)
            if steer and span:
                emit({"status": "span share per layer, before and after steering"})
                emit({"span_share": span_share_by_layer(prompt, steer)})
            return {"done": True}

        return job_stream(jobs, lock, job, work)

    def span_share_by_layer(prompt: str, steer: list) -> dict[str, list[float | None]]:
        """The last position's attention share on the span per layer (mean over heads), without
        and with `steer`: `span_attention(...).scores.mean(1)`, `[L]` each."""
        before = span_attention(model, prompt).scores.mean(1)
        after = span_attention(model, prompt, steer=steer).scores.mean(1)
        return {"before": grid(before[None])[0], "after": grid(after[None])[0]}

    async def patching(body: dict):
        clean = _text(body, "clean")
        corrupted = _text(body, "corrupted")
        answer = _text(body, "answer", MAX_ANSWER_CHARS, space=True)
        cf = body.get("counterfactual")
        cf = None if cf in (None, "") else _text(body, "counterfactual", MAX_ANSWER_CHARS, space=True)
        job = Jobs.check_id(body.get("job"))
        from heads.engine.options import SweepOptions
        from heads.scorers.patching.activation import patch
        from heads.scorers.patching.pairs import PromptPair, check_pairs_differ, encode_pairs

        pair = PromptPair(clean, corrupted, answer, cf)
        check_pairs_differ([pair])  # the API's and the CLI's check: same text, answer as counterfactual
        pairs = encode_pairs(model, [pair])  # checks before work
        check_pairs_differ(pairs, counterfactual=cf is not None)  # the same on tokens
        metric = "logit_diff" if cf is not None else "log_prob"

        def work(emit, flag) -> dict:
            options = SweepOptions(progress=progress_reporter(emit, flag))
            emit({"status": "patching head outputs (layer x head)"})
            res = patch(model, pairs, "head_out", metric=metric, options=options)
            heads = {
                "scores": grid(res.mean),
                "metric": metric,
                "clean_metric": round(float(res.clean[0]), 5),
                "corrupt_metric": round(float(res.corrupt[0]), 5),
            }
            emit({"heads_map": heads})  # drawn while the position sweep runs
            emit({"status": "patching the residual stream (layer x position)"})
            pos = patch(model, pairs, "resid_pre", metric=metric, options=options)
            return {"result": {**heads, "positions": grid(pos.mean), "tokens": pos.labels}}

        return job_stream(jobs, lock, job, work)

    async def cancel(body: dict):
        job = body.get("job")
        if not isinstance(job, str) or not JOB_ID.fullmatch(job):
            raise HeadsteerValueError("job must be 8-64 characters of letters, digits, '_' or '-'")
        return {"job": job, "cancelled": jobs.cancel(job)}

    for path, fn in (
        ("/api/scores", scores),
        ("/api/prepare", prepare),
        ("/api/pattern", pattern),
        ("/api/head", head_card),
        ("/api/generate", generate),
        ("/api/patch", patching),
        ("/api/cancel", cancel),
    ):
        app.add_api_route(path, guarded(fn, FIELDS[path]), methods=["POST"])
    return app


def _streamer_class():
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        """Sends each decoded piece as a `{"text": ...}` event; raises `Cancelled` at the next token
        once the job's flag is set (that ends `generate`)."""

        def __init__(self, tokenizer, emit: Callable[[dict], None], flag: threading.Event):
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.emit, self.flag = emit, flag

        def put(self, value) -> None:
            if self.flag.is_set():
                raise Cancelled
            super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if text:
                self.emit({"text": text})

    return Streamer


def _Streamer(tokenizer, emit, flag):
    return _streamer_class()(tokenizer, emit, flag)


class _TooLarge(ValueError):
    """A request refused with HTTP 413."""


class _Forbidden(ValueError):
    """A request refused with HTTP 415 (a body that is not JSON)."""


_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline' 'unsafe-eval'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:"
)
