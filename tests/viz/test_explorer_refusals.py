"""Work the explorer (and the server) can tell will fail is refused or skipped before it starts.

Found by a breaker: the explorer's Patch on a GPT-2 model ran the whole head sweep, then ended
with advice the page cannot follow. The same kind, looked for on every endpoint and family:
a steered generation that a sliding window stops part-way (after tokens were streamed), MAPS,
the atlas and the head card on a family without MAPS' first-MLP source representation (OLMo 2).
"""

import json

import pytest
import torch
from fastapi.testclient import TestClient

from heads import HeadModel
from viz.explorer import create_explorer

PROMPT = "Ignore this. **Remember the word apple** and say something"


def events(text: str) -> list[dict]:
    return [json.loads(ln[6:]) for ln in text.split("\n\n") if ln.startswith("data: ")]


def test_patch_on_gpt2_gives_both_maps_as_the_library_does(tokenizer):
    """GPT-2 (absolute positions) patches `resid_pre` exactly: the explorer draws the library's
    head map and layer x position map."""
    from heads.scorers.patching.activation import patch
    from heads.scorers.patching.pairs import PromptPair, encode_pairs
    from tests.support import make_tiny

    model = make_tiny("gpt2", tokenizer)
    pair = {"clean": "The cat sat on the mat", "corrupted": "The dog sat on the mat", "answer": " and"}
    pairs = encode_pairs(model, [PromptPair(**pair)])
    r = TestClient(create_explorer(model)).post("/api/patch", json=pair)
    assert r.status_code == 200, r.text
    ev = events(r.text)
    assert not any("error" in e for e in ev), ev[-1]
    res = ev[-1]["result"]
    for key, kind in (("scores", "head_out"), ("positions", "resid_pre")):
        want = patch(model, pairs, kind, metric="log_prob").mean
        got = [[v if v is not None else float("nan") for v in row] for row in res[key]]
        torch.testing.assert_close(torch.tensor(got), want.float(), atol=1e-4, rtol=0, equal_nan=True)
    assert res["tokens"] == pairs.position_labels(0)


def test_a_refused_position_kind_skips_the_position_map_with_the_librarys_reason(tokenizer, monkeypatch):
    """Where the library refuses `resid_pre` on a family (the `PatchRequest`'s kind check,
    `check_kind_family`), the explorer leaves the position map out with that reason, before the
    sweep, and the head map still runs."""
    from heads.scorers.patching import request
    from heads.scorers.patching.activation import patch
    from heads.scorers.patching.pairs import PromptPair, encode_pairs
    from tests.support import make_tiny

    model = make_tiny("gpt2", tokenizer)
    reason = "kind='resid_pre' is not available on this family (test refusal)"
    real = request.check_kind_family

    def refusing(family, kind, *rest):
        if kind == "resid_pre":
            raise ValueError(reason)
        real(family, kind, *rest)

    monkeypatch.setattr(request, "check_kind_family", refusing)
    pair = {"clean": "The cat sat on the mat", "corrupted": "The dog sat on the mat", "answer": " and"}
    pairs = encode_pairs(model, [PromptPair(**pair)])
    r = TestClient(create_explorer(model)).post("/api/patch", json=pair)
    assert r.status_code == 200, r.text
    ev = events(r.text)
    res = ev[-1]["result"]
    assert res["positions"] is None and reason in res["positions_note"]
    want = patch(model, pairs, "head_out", metric="log_prob").mean
    got = [[v if v is not None else float("nan") for v in row] for row in res["scores"]]
    torch.testing.assert_close(torch.tensor(got), want.float(), atol=1e-4, rtol=0, equal_nan=True)
    assert sum("status" in e and "residual" in e["status"] for e in ev) == 0  # the sweep never started


@pytest.fixture(scope="module")
def windowed(tokenizer):
    from tests.support import make_tiny

    return make_tiny("mistral", tokenizer, sliding_window=24)


RAW = "the key is **blue** and the door"  # 7 tokens as plain text


def _fails_alone(model, steer, n: int) -> bool:
    """The oracle: does `SteeredModel.generate` stop part-way for `n` new tokens?"""
    from steer.steered_model import SteeredModel

    try:
        SteeredModel(model).generate(
            RAW, steer, max_new_tokens=n, min_new_tokens=n, chat=False, progress=False
        )
    except ValueError as exc:
        assert "sliding-window" in str(exc)
        return True
    return False


def test_steered_generation_on_a_sliding_window_is_refused_exactly_when_it_would_stop(windowed):
    """On a layer with a 24-key window, a 7-token prompt takes 16 new tokens under PASTA and
    stops at 17 (the engine's check, once the KV cache drops positions): the explorer and the
    server refuse exactly the runs `SteeredModel.generate` would stop, before any token; an
    edit outside the attention pattern (ablation) is never refused."""
    from heads.inputs.prompts import encode_prompts
    from steer import Ablate, Pasta
    from steer.serving import BatchGenerator, SamplingParams, ServeRequest

    assert (
        windowed.sliding_window(0) == 24 and encode_prompts(windowed.tokenizer, RAW, chat=False).length == 7
    )
    from tests.support.explorer import cancel_on_start

    app = create_explorer(windowed)
    cancel_on_start(app.state.jobs)  # an accepted request's job is cancelled before it runs: no generation
    client = TestClient(app)
    gen = BatchGenerator(windowed)
    base = {"prompt": RAW, "raw": True, "steered": True}
    for n in (16, 17):  # the boundary: 7 + 16 < 24 <= 7 + 17
        fails = _fails_alone(windowed, [Pasta(heads={0: [0]}, alpha=0.01)], n)
        assert fails == (n >= 17)
        r = client.post(
            "/api/generate", json={**base, "method": "pasta", "heads": [[0, 0]], "max_new_tokens": n}
        )
        if fails:
            assert r.status_code == 400, r.text
            msg = r.json()["error"]
            assert msg.startswith(f"max_new_tokens={n}: layer 0 uses sliding-window") and "at most 16" in msg
        else:  # accepted: a job was started (and cancelled at once by this test)
            assert r.status_code == 200 and events(r.text)[-1] == {"cancelled": True}, r.text[-300:]
        req = ServeRequest(
            RAW, False, [Pasta(heads={0: [0]}, alpha=0.01)], params=SamplingParams(max_tokens=n)
        )
        if fails:
            with pytest.raises(ValueError, match=f"max_tokens={n}: layer 0"):
                gen.prepare(req)
        else:
            gen.prepare(req)
    assert not _fails_alone(windowed, [Ablate(heads={0: [0]})], 17)
    r = client.post(
        "/api/generate", json={**base, "method": "ablate", "heads": [[0, 0]], "max_new_tokens": 30}
    )
    assert r.status_code == 200 and events(r.text)[-1] == {"cancelled": True}


@pytest.fixture(scope="module")
def olmo2(tokenizer):
    from tests.support.families import tiny_family_model

    hm = tiny_family_model("olmo2", vocab_size=len(tokenizer), max_position_embeddings=512)
    return HeadModel(hm.model, tokenizer, name="tiny-olmo2")


def test_first_mlp_work_on_olmo2_is_refused_or_left_out_up_front(olmo2, monkeypatch):
    """OLMo 2's MLP reads the raw residual (no input norm), so MAPS' first-MLP source
    representation is not defined (the library refuses it by family): the MAPS score is HTTP 400
    before any work; the atlas runs without the two detectors that read it (named, with the
    reason); the head card keeps its logit-lens part and says why MAPS is left out."""
    from heads.scorers.maps.static import first_mlp
    from heads.scorers.roles import detectors
    from tests.support.explorer import fake_detectors

    with pytest.raises(ValueError) as refused:
        first_mlp(olmo2, torch.zeros(1, olmo2.d_model))
    reason = " ".join(str(refused.value).split())
    fake_detectors(olmo2, monkeypatch)
    called = []
    for name in ("copying", "successor"):
        real = getattr(detectors, f"{name}_scores")
        monkeypatch.setattr(
            detectors, f"{name}_scores", lambda m, *a, _n=name, _r=real, **k: called.append(_n) or _r(m)
        )
    client = TestClient(create_explorer(olmo2))
    r = client.post("/api/scores", json={"prompt": PROMPT, "score": "maps"})
    assert r.status_code == 400 and reason in r.json()["error"], r.text
    ev = events(client.post("/api/scores", json={"prompt": PROMPT, "score": "atlas"}).text)
    res = ev[-1]["result"]
    assert called == [] and res["skipped"] == {"copying": reason, "successor": reason}
    assert {"induction", "previous_token", "retrieval"} <= set(res["columns"]) and "copying" not in res[
        "columns"
    ]
    card = client.post("/api/head", json={"prompt": PROMPT, "layer": 1, "head": 0})
    assert card.status_code == 200, card.text
    d = card.json()
    assert len(d["lens_tokens"]) == 5 and d["maps"] == [] and reason in d["maps_note"]
