"""One cell's QK attribution: `POST /api/qk`.

Clicking cell (query, key) of a head's pattern asks why the head attends there: the cell's logit
as query-component x key-component terms (`heads.scorers.qk.qk_attribution`, one forward, the
prompt encoded as the pattern's; the body builds the `heads.QKRequest` the Python API builds, run
by `heads.run`), answered as the top terms (a ranked list), a component x
component table of the largest components of each side, and the upstream heads and source
tokens behind the key and the query (`by="source_token"`). It runs as a job (the model lock,
cancelled when the client leaves, a tab's new click superseding its previous one).
"""

import threading
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import field_validator

from heads._util.validation import check_int
from viz.explorer.jobs import run_job
from viz.explorer.requests import _Request
from viz.explorer.routes.common import State, body
from viz.explorer.routes.views import job_answer

__all__ = ["QKRequest", "router"]

router = APIRouter()

TOP = 12
"""Terms, components per side and source tokens sent back."""


class QKRequest(_Request):
    """`POST /api/qk`: the QK attribution of head (layer, head) at cell (query, key) of the prompt
    (positions as in the head's pattern: token indices of the encoded prompt; key <= query)."""

    prompt: str = None  # type: ignore[assignment]
    layer: int = None  # type: ignore[assignment]
    head: int = None  # type: ignore[assignment]
    query: int = None  # type: ignore[assignment]
    key: int = None  # type: ignore[assignment]
    tab: str = ""
    raw: bool | None = None
    job: str = None  # type: ignore[assignment]

    @field_validator("query", "key", mode="before")
    @classmethod
    def _position(cls, v: object, info: Any) -> int:
        return check_int(str(info.field_name), v, lo=0)

    @field_validator("layer", "head", mode="before")
    @classmethod
    def _index(cls, v: object, info: Any) -> int:
        """An int >= 0; its range is the analysis request's check (`check_config`, in the route)."""
        return check_int(str(info.field_name), v, lo=0)

    def analysis(self) -> Any:
        """The analysis request `heads.qk_attribution` builds for this cell (`heads.QKRequest`,
        through the upstream heads' source tokens)."""
        from heads.scorers.qk.request import QKRequest as Analysis

        return Analysis(head=(self.layer, self.head), query=self.query, keys=[self.key], by="source_token")


def _answer(r: Any) -> dict:
    """The JSON of one cell's attribution (plain floats, 4 decimals)."""

    def f(x: Any) -> float:
        return round(float(x), 4)

    t = r.terms(0, int(r.queries[0, 0]), int(r.keys[0, 0]))
    rows = t.sum(1).abs().argsort(descending=True)[:TOP].tolist()
    cols = t.sum(0).abs().argsort(descending=True)[:TOP].tolist()
    return {
        "layer": r.layer,
        "head": r.head,
        "query": int(r.queries[0, 0]),
        "key": int(r.keys[0, 0]),
        "logit": f(r.logits[0, 0, 0]),
        "score": f(r.score()[0, 0, 0]),
        "softcap": r.softcap,
        "attention": f(r.pattern[0, 0, 0]),
        "max_error": float(r.max_error()),
        "tokens": r.tokens[0],
        "pairs": [[a, b, f(v)] for a, b, v in r.top_pairs(TOP)],
        "table": {
            "query_components": [r.names[i] for i in rows],
            "key_components": [r.names[j] for j in cols],
            "z": [[f(t[i, j]) for j in cols] for i in rows],
        },
        "sources": {
            side: [[h, u, tok, f(v)] for h, u, tok, v in r.top_sources(side, TOP)]
            for side in ("key", "query")
        },
    }


@router.post("/api/qk")
async def qk(req: Annotated[QKRequest, body(QKRequest)], request: Request, st: State) -> Any:
    from heads import run
    from heads.errors import HeadsteerValueError

    analysis = req.analysis()
    analysis.check_config(st.model)  # a refused family or head: 400 naming it, before any job
    enc = st.encoded(req.prompt, st.chat(req.raw))
    n = int(enc.attention_mask[0].sum())
    if req.query >= n or req.key > req.query:
        raise HeadsteerValueError(
            f"cell (query {req.query}, key {req.key}) is not in the pattern: positions 0..{n - 1}, "
            "key <= query"
        )

    def work(emit: Any, flag: threading.Event) -> dict:
        r = run(st.model, analysis, enc)
        return {"qk": _answer(r)}

    key = ("qk", req.tab) if req.tab else None
    answer = await run_job(st.jobs, st.lock, req.job, work, request, supersede=key)
    refused = job_answer(answer)
    if refused is not None:
        return refused
    return answer["qk"]
