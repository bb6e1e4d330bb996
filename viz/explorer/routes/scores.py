"""`POST /api/scores`: the overview grid of one score, as a job (event stream)."""

import threading
from typing import Annotated, Any

from fastapi import APIRouter

from heads.errors import HeadsteerValueError
from viz.explorer import scores as jobs_of
from viz.explorer.jobs import job_stream
from viz.explorer.requests import ScoresRequest
from viz.explorer.routes.common import State, body
from viz.explorer.scores import PROBE_TASK, grid

__all__ = ["router"]

router = APIRouter()


@router.post("/api/scores")
async def scores(req: Annotated[ScoresRequest, body(ScoresRequest)], st: State) -> Any:
    """Everything a score refuses for a known reason is refused here, before its job: a prompt
    without a span for `span`, a family DLA cannot decompose, MAPS on a family without its
    first-MLP source representation, the probes on a tokenizer without a chat template."""
    model, kind, prompt = st.model, req.score, req.prompt
    chat = st.chat(req.raw)
    enc = st.encoded(prompt, chat)  # bad markup, too many tokens: 400 for every kind
    # the analysis request the Python API builds for the scores that are one (`heads.run` runs
    # it), checked against the model before the job: a refusal is a 400 naming it
    analysis = jobs_of.score_request(kind, chat)
    if analysis is not None:
        analysis.check_config(model)
    relations = None
    if kind == "span":
        if not enc.spans[0]:
            raise HeadsteerValueError("span attention needs a span: mark it in the prompt with **...**")
    elif kind == "dla":
        from heads.scorers.patching.logit import check_dla_model

        check_dla_model(model)  # a post-norm family or a final norm without eps: HTTP 400
    elif kind == "maps" and st.cache["maps"] is None:
        no_maps = st.maps_refusal()
        if no_maps is not None:
            raise HeadsteerValueError(f"the MAPS score cannot run on this model: {no_maps}")
        from probes.datasets.relations import load_relations

        relations = load_relations(model.tokenizer, d_vocab=model.d_vocab).relations
    elif kind == "probes" and st.cache["probes"] is None:
        if not st.has_chat_template:
            raise HeadsteerValueError(
                f"the probes score needs a chat template (the {PROBE_TASK} requests are chats); "
                "this tokenizer has none"
            )
    no_first_mlp = st.maps_refusal() if kind == "atlas" and st.cache["atlas"] is None else None

    def work(emit: Any, flag: threading.Event) -> dict:
        if kind == "atlas":
            return jobs_of.atlas_result(model, st.cache, emit, flag, no_first_mlp)
        if kind in ("dla", "ships"):
            got = st.prompt_scores.get((kind, prompt, chat))
            if got is None:
                if kind == "dla":
                    got = jobs_of.dla_result(model, prompt, chat, emit, flag)
                else:
                    got = jobs_of.ships_result(model, prompt, emit, flag, analysis)
                st.prompt_scores.put((kind, prompt, chat), got)
            return {"result": got}
        if kind == "maps":
            return {"result": jobs_of.maps_result(model, st.cache, relations, emit, flag, analysis)}
        if kind == "probes":
            return {"result": jobs_of.probes_result(model, st.cache, emit, flag)}
        if kind == "span":
            from heads.scorers.attention_mass import span_attention

            s = span_attention(model, prompt, chat=chat).scores
        else:
            from heads import run

            assert analysis is not None  # sinks: a SinkStatsRequest
            s = run(model, analysis, [prompt]).sink_mass.scores
        return {"result": {"score": kind, "scores": grid(s)}}

    return job_stream(st.jobs, st.lock, req.job, work)
