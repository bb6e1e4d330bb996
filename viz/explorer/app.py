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
  prompt stops changing, so a click finds the patterns ready. A tab's new prepare cancels its
  previous one.
- `POST /api/pattern {prompt, layer, head, tab}` one head's `[T, T]` pattern with token labels
  (4 decimals), read from the tab's cache (filled first when missing; a prompt too large for the
  cache budget runs one forward for that head). A prompt longer than `full_pattern_tokens`
  (default `MAX_PATTERN_TOKENS`) gets its overview instead (`viz.explorer.overview`: the pattern
  pooled into at most `OVERVIEW_GRID` x `OVERVIEW_GRID` blocks, key column mass, query row
  entropy and max), and `{..., q0, q1, k0, k1}` the exact window `[q1 - q0, k1 - k0]` (at most
  `MAX_WINDOW` each way) of any prompt's pattern.
- `POST /api/head {prompt, layer, head, tab}` the head's card (a tab's new card cancels its
  previous one): top logit-lens tokens of its output
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

`/api/prepare`, `/api/pattern` and `/api/head` are jobs too when they run the model (inside
the limit, cancelled when their client leaves; a cancelled one answers `{"cancelled": true}`);
what is already kept is answered without one. Every endpoint that takes a `prompt` takes `raw`
(true: the text as it is, no chat template; default: the template when the tokenizer has one);
`/api/patch` runs its pair as plain text unless `raw` is false.

Errors found before the work starts are HTTP 4xx with `{"error": "<one line>"}`; the server
stays up. Requests larger than `MAX_BODY_BYTES`, prompts longer than `MAX_PROMPT_CHARS` and
`max_new_tokens` above `MAX_NEW_TOKENS` are refused before any work. The model is used by one
job at a time (a lock). The code: `viz.explorer.state` (the shared state and caches),
`viz.explorer.requests` (a pydantic model per request), `viz.explorer.routes` (the routers),
`viz.explorer.jobs` (the job machinery), `viz.web` (body reading and the cross-site guard).
"""

from collections.abc import Collection
from typing import Any

from viz.explorer.jobs import MAX_JOBS, Jobs
from viz.explorer.limits import (
    MAX_ANSWER_CHARS,
    MAX_BODY_BYTES,
    MAX_NEW_TOKENS,
    MAX_PATTERN_TOKENS,
    MAX_PROMPT_CHARS,
    MAX_WINDOW,
    OVERVIEW_CACHE_BYTES,
    PATTERN_CACHE_BYTES,
    SCORES,
)
from viz.explorer.scores import PROBE_LIMIT, PROBE_TASK
from viz.web.body import BodyTooLarge, one_line
from viz.web.guard import LOOPBACK_HOSTS, CrossSiteGuard

__all__ = [
    "LOOPBACK_HOSTS",
    "MAX_ANSWER_CHARS",
    "MAX_BODY_BYTES",
    "MAX_JOBS",
    "MAX_NEW_TOKENS",
    "MAX_PATTERN_TOKENS",
    "MAX_PROMPT_CHARS",
    "MAX_WINDOW",
    "OVERVIEW_CACHE_BYTES",
    "PATTERN_CACHE_BYTES",
    "PROBE_LIMIT",
    "PROBE_TASK",
    "SCORES",
    "Jobs",
    "create_explorer",
    "plotly_js_path",
]


def plotly_js_path() -> Any:
    """`plotly.min.js` of the installed `plotly` package (served locally, never a CDN)."""
    from viz.explorer.routes.page import plotly_js_path as path

    return path()


def create_explorer(
    model: Any,
    *,
    atlas: Any = None,
    pattern_cache_bytes: int = PATTERN_CACHE_BYTES,
    hosts: Collection[str] | None = None,
    full_pattern_tokens: int = MAX_PATTERN_TOKENS,
    overview_cache_bytes: int = OVERVIEW_CACHE_BYTES,
) -> Any:
    """Build the explorer app for a loaded `HeadModel` (with a tokenizer).

    Args:
        model: the `HeadModel`.
        atlas: a `HeadAtlas` of this model to colour the grid by (default None: computed with
            `head_atlas` the first time the page asks for it, then kept).
        pattern_cache_bytes: byte budget of the per-tab pattern cache (`PatternCache`,
            default `PATTERN_CACHE_BYTES`, 512 MiB; 0 turns it off: a forward per click).
        hosts: the host names a request's `Host` header may name, compared case-insensitively
            without a trailing dot; a loopback IP literal is always accepted (`headsteer explore`
            on a loopback address passes `viz.web.guard.loopback_hosts(...)`, so a
            DNS-rebinding page cannot read the API); default None: any.
        full_pattern_tokens: longest prompt whose whole `[T, T]` pattern `/api/pattern` sends
            (default `MAX_PATTERN_TOKENS`, 512); a longer prompt (up to the model's positions)
            gets an overview per head and exact windows (`viz.explorer.overview`).
        overview_cache_bytes: byte budget of the per-tab overview cache (default
            `OVERVIEW_CACHE_BYTES`, 1.5 GiB; 0 turns it off: each long-prompt click records again).

    Returns:
        a FastAPI app; `app.state.explorer` is its `viz.explorer.state.ExplorerState`,
        `app.state.jobs` its `Jobs` (`stop_all()` cancels every job: `headsteer explore` calls
        it when the server stops).

    Raises:
        ValueError: the model has no tokenizer; an atlas of another geometry.
    """
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.requests import ClientDisconnect

    from viz.explorer.routes import ROUTERS
    from viz.explorer.state import ExplorerState

    state = ExplorerState(
        model,
        atlas,
        pattern_cache_bytes,
        full_pattern_tokens=full_pattern_tokens,
        overview_cache_bytes=overview_cache_bytes,
    )
    app = FastAPI(title="headsteer explorer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.explorer = state
    app.state.jobs = state.jobs
    for router in ROUTERS:
        app.include_router(router)

    def error(status: int, message: str, code: str = "") -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    async def too_large(request: Any, exc: Exception) -> JSONResponse:
        return error(413, one_line(exc))

    async def gone(request: Any, exc: Exception) -> Response:  # the client left before its body arrived
        return Response(status_code=499)

    async def bad(request: Any, exc: Exception) -> JSONResponse:
        return error(400, one_line(exc))

    app.add_exception_handler(BodyTooLarge, too_large)
    app.add_exception_handler(ClientDisconnect, gone)
    for kind in (ValueError, TypeError, KeyError, IndexError):  # one line, HTTP 400; the server stays up
        app.add_exception_handler(kind, bad)
    app.add_middleware(CrossSiteGuard, hosts=hosts, render=error)
    return app
