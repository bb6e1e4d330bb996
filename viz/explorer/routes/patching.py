"""`POST /api/patch`: activation patching of one clean / corrupted pair, as a job (event stream).

The route builds the analysis requests `heads.patch` builds (`heads.PatchRequest`, the page's
body being the pair) and runs them through `heads.run`.

Two sweeps, one job: `head_out` (the `[L, H]` map, sent as soon as it is done), then
`resid_pre` (the `[L, T]` layer x position map). A family on which the library refuses
`resid_pre` (it names why) is known before the job: the position sweep is then skipped with
that note (`positions: null`, `positions_note`), and the head map still runs.
"""

import threading
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter

from viz.explorer.jobs import job_stream
from viz.explorer.requests import PatchRequest
from viz.explorer.routes.common import State, body
from viz.explorer.scores import grid, progress_reporter
from viz.explorer.state import ExplorerState
from viz.web.body import one_line

__all__ = ["kind_refusal", "router"]

router = APIRouter()


def kind_refusal(st: ExplorerState, kind: str) -> str | None:
    """Why patching `kind` is refused on this model's family (the `PatchRequest`'s own check
    against the model, `check_config`, the one `heads.patch` runs before any forward), or None."""
    from heads.scorers.patching.request import PatchRequest

    try:
        PatchRequest(kind=kind).check_config(st.model)
    except ValueError as exc:
        return one_line(exc)
    return None


@router.post("/api/patch")
async def patching(req: Annotated[PatchRequest, body(PatchRequest)], st: State) -> Any:
    from heads import PatchRequest as Patch
    from heads import run
    from heads.engine.options import SweepOptions
    from heads.scorers.patching.pairs import PromptPair, check_pairs_differ, encode_pairs

    model = st.model
    pair = PromptPair(req.clean, req.corrupted, req.answer, req.counterfactual)
    check_pairs_differ([pair])  # the library's check: the same text, the answer as counterfactual
    pairs = encode_pairs(model, [pair], chat=st.chat(req.raw))  # checks before work
    check_pairs_differ(pairs, counterfactual=req.counterfactual is not None)  # the same on tokens
    metric = "logit_diff" if req.counterfactual is not None else "log_prob"
    head_map = Patch(kind="head_out", metric=metric)
    head_map.check_config(model)  # the requests heads.run runs, against the model: 400 before the job
    no_positions = kind_refusal(st, "resid_pre")

    def work(emit: Callable[[dict], None], flag: threading.Event) -> dict:
        options = SweepOptions(progress=progress_reporter(emit, flag))
        emit({"status": "patching head outputs (layer x head)"})
        res = run(model, head_map, pairs, options=options)
        heads = {
            "scores": grid(res.mean),
            "metric": metric,
            "clean_metric": round(float(res.clean[0]), 5),
            "corrupt_metric": round(float(res.corrupt[0]), 5),
        }
        emit({"heads_map": heads})  # drawn while the position sweep runs
        if no_positions is not None:
            note = f"the layer x position map is left out on this model: {no_positions}"
            return {
                "result": {
                    **heads,
                    "positions": None,
                    "positions_note": note,
                    "tokens": pairs.position_labels(0),
                }
            }
        emit({"status": "patching the residual stream (layer x position)"})
        pos = run(model, Patch(kind="resid_pre", metric=metric), pairs, options=options)
        return {"result": {**heads, "positions": grid(pos.mean), "tokens": pos.labels}}

    return job_stream(st.jobs, st.lock, req.job, work)
