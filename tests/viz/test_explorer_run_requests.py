"""The explorer's analysis routes build the request the Python API builds from the body, check it
against the model before any job (a refusal: HTTP 400 naming the value, `heads.run` never
called), and run it through `heads.run` (the request passed there is captured and compared with
the one built in Python from the same values)."""

import pytest

import heads
from heads.scorers.patching.request import PatchRequest
from heads.scorers.qk.request import QKRequest
from heads.scorers.safety.request import ShipsRequest
from heads.scorers.sink_requests import SinkStatsRequest

PROMPT = "The cat sat on the mat and the dog sat on the rug"


@pytest.fixture
def captured(monkeypatch):
    """The requests passed to `heads.run`; none is run (the job fails after the capture)."""
    seen: list = []

    def fake(model, request, *inputs, **kw):
        seen.append(request)
        raise RuntimeError("captured")

    monkeypatch.setattr(heads, "run", fake)
    return seen


def test_qk_refuses_a_position_beyond_the_model_before_any_run(client, model, captured):
    body = {"prompt": PROMPT, "raw": True, "layer": 1, "head": 0, "query": 10**7, "key": 2}
    r = client.post("/api/qk", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "position 10000000 is beyond the model's" in error and "\n" not in error
    assert captured == []


def test_qk_runs_the_api_request(client, captured):
    body = {"prompt": PROMPT, "raw": True, "layer": 2, "head": 3, "query": 5, "key": 2}
    client.post("/api/qk", json=body)
    assert captured == [QKRequest(head=(2, 3), query=5, keys=[2], by="source_token")]


@pytest.mark.parametrize(
    ("score", "expected"),
    [("sinks", SinkStatsRequest(chat=False)), ("ships", ShipsRequest())],
)
def test_scores_run_the_api_request(client, captured, score, expected):
    r = client.post("/api/scores", json={"prompt": PROMPT, "raw": True, "score": score})
    assert r.status_code == 200, r.text  # the job's stream; its work stopped at the capture
    assert captured == [expected]


def test_patch_runs_the_api_request(client, captured):
    body = {"clean": "When Mary and John went, John gave it to", "corrupted":
            "When Mary and John went, Mary gave it to", "answer": " Mary"}  # fmt: skip
    r = client.post("/api/patch", json=body)
    assert r.status_code == 200, r.text
    assert captured == [PatchRequest(kind="head_out", metric="log_prob")]
