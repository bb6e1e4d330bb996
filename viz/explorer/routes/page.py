"""The page, Plotly and `/api/info`."""

import gzip
from importlib import resources
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, Response
from starlette.concurrency import run_in_threadpool

from viz.explorer.jobs import MAX_JOBS
from viz.explorer.limits import MAX_ANSWER_CHARS, MAX_BODY_BYTES, MAX_NEW_TOKENS, MAX_PROMPT_CHARS, SCORES
from viz.explorer.routes.common import State
from viz.explorer.steering import STEER_METHODS

__all__ = ["CSP", "plotly_js_path", "router"]

router = APIRouter()

CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline' 'unsafe-eval'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:"
)
"""The page's Content-Security-Policy: its own origin only."""


def plotly_js_path() -> Path:
    """`plotly.min.js` of the installed `plotly` package (served locally, never a CDN)."""
    return Path(str(resources.files("plotly").joinpath("package_data/plotly.min.js")))


@router.get("/", response_class=HTMLResponse)
async def index(st: State) -> HTMLResponse:
    return HTMLResponse(
        st.page, headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff"}
    )


@router.get("/plotly.min.js")
async def plotly_js(request: Request, st: State) -> Response:
    if "gzip" not in request.headers.get("accept-encoding", ""):
        return FileResponse(plotly_js_path(), media_type="application/javascript")
    if st.plotly_gz is None:  # compressed once per server: about a third of the bytes
        st.plotly_gz = await run_in_threadpool(gzip.compress, plotly_js_path().read_bytes(), 6)
    return Response(
        st.plotly_gz,
        media_type="application/javascript",
        headers={"Content-Encoding": "gzip", "Vary": "Accept-Encoding", "Cache-Control": "max-age=3600"},
    )


@router.get("/api/info")
async def info(st: State) -> dict:
    model = st.model
    return {
        "model": model.name,
        "n_layers": model.n_layers,
        "n_heads": model.n_heads,
        "n_kv_heads": model.n_kv_heads,
        "scores": list(SCORES),
        "atlas_ready": st.cache["atlas"] is not None,
        "shipped_heads": st.shipped,
        "chat_template": st.has_chat_template,
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
