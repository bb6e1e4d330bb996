"""The head explorer (`viz.explorer`): API on a tiny model, and one real-browser load."""

import json

import pytest
import torch
from fastapi.testclient import TestClient

from heads.scorers.attention_mass import head_pattern, span_attention
from viz.explorer import MAX_BODY_BYTES, MAX_NEW_TOKENS, create_explorer
from viz.explorer.app import MAX_ANSWER_CHARS, MAX_PROMPT_CHARS

PROMPT = "Ignore this. **Remember the word apple** and say something"


@pytest.fixture(scope="module")
def model(tokenizer):
    from tests.support import make_tiny

    return make_tiny("llama", tokenizer)


@pytest.fixture(scope="module")
def client(model):
    return TestClient(create_explorer(model))


def events(text: str) -> list[dict]:
    return [json.loads(ln[6:]) for ln in text.split("\n\n") if ln.startswith("data: ")]


def test_page_and_plotly_are_local(client):
    page = client.get("/")
    assert page.status_code == 200
    assert 'src="/plotly.min.js"' in page.text and "cdn" not in page.text.lower()
    assert "innerHTML" not in page.text  # user strings go through textContent only
    js = client.get("/plotly.min.js")
    assert js.status_code == 200 and len(js.content) > 1_000_000
    assert js.headers["content-encoding"] == "gzip"  # sent compressed, decoded to the same file
    plain = client.get("/plotly.min.js", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and plain.content == js.content


def scored(client, body, path="/api/scores"):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    ev = events(r.text)
    assert "job" in ev[0], ev[0]
    return ev


def test_scores_grid_matches_scorer(client, model):
    ev = scored(client, {"prompt": PROMPT, "score": "span"})
    grid = torch.tensor(ev[-1]["result"]["scores"])
    assert grid.shape == (model.n_layers, model.n_heads)
    torch.testing.assert_close(grid, span_attention(model, PROMPT).scores.float(), atol=1e-4, rtol=0)
    sinks = scored(client, {"prompt": PROMPT, "score": "sinks"})[-1]["result"]
    assert len(sinks["scores"]) == model.n_layers


def fake_detectors(model, monkeypatch):
    """Random detector scores in place of the (slow) real detectors: the app's plumbing is tested."""
    from heads.results.scores import HeadScores
    from heads.scorers.roles import detectors

    g = torch.Generator().manual_seed(0)

    def fake(*names):
        def run(m, *a, **k):
            out = {
                n: HeadScores(torch.rand(m.n_layers, m.n_heads, generator=g), n, model=m.name) for n in names
            }
            return out if len(names) > 1 else out[names[0]]

        return run

    monkeypatch.setattr(detectors, "pattern_scores", fake("induction", "previous_token", "self"))
    for name in ("copying", "successor", "retrieval"):
        monkeypatch.setattr(detectors, f"{name}_scores", fake(name))
    return fake


def test_atlas_roles_and_progress(model, monkeypatch):
    from heads.scorers.roles.atlas import role_labels

    fake_detectors(model, monkeypatch)
    client = TestClient(create_explorer(model))
    assert client.get("/api/info").json()["atlas_ready"] is False
    ev = scored(client, {"prompt": PROMPT, "score": "atlas"})
    progress = [e["progress"] for e in ev if "progress" in e]
    assert progress == [[0, 4], [1, 4], [2, 4], [3, 4], [4, 4]]
    assert any("status" in e for e in ev)
    d = ev[-1]["result"]
    assert set(d["columns"]) == {"induction", "previous_token", "self", "copying", "successor", "retrieval"}
    cols = d["columns"]
    import pandas as pd

    frame = pd.DataFrame(
        [{k: cols[k][la][h] for k in cols} for la in range(model.n_layers) for h in range(model.n_heads)]
    )
    want = list(role_labels(frame))
    got = [d["roles"][la][h] for la in range(model.n_layers) for h in range(model.n_heads)]
    assert got == want and set(got) <= set(d["role_order"]) and len(set(got)) > 1
    assert client.get("/api/info").json()["atlas_ready"] is True
    card = client.post("/api/head", json={"prompt": PROMPT, "layer": 1, "head": 0}).json()
    assert card["atlas"]["role"] == d["roles"][1][0]  # the card shows the atlas row once known


def test_pattern_of_a_head(client, model):
    r = client.post("/api/pattern", json={"prompt": PROMPT, "layer": 1, "head": 2})
    assert r.status_code == 200, r.text
    d = r.json()
    probs, tokens, spans = head_pattern(model, PROMPT, 1, 2)
    assert d["tokens"] == tokens and [tuple(s) for s in d["spans"]] == spans
    got = torch.tensor(d["probs"])
    # fp16 in the cache (half an ulp below 1: 2.5e-4) plus the 4-decimal rounding (5e-5)
    torch.testing.assert_close(got, probs.float(), atol=3e-4, rtol=0)
    torch.testing.assert_close(got.sum(-1), torch.ones(len(tokens)), atol=1e-2, rtol=0)


def test_patterns_are_recorded_once_per_tab_and_prompt(model, monkeypatch):
    """One forward records every head (each equal to `head_pattern`); later clicks only read;
    another tab or prompt gets its own entry; a prompt over the budget falls back to one head."""
    from viz.explorer import patterns as patterns_mod

    calls = []
    real = patterns_mod.all_patterns
    monkeypatch.setattr(patterns_mod, "all_patterns", lambda m, p: calls.append(p) or real(m, p))
    client = TestClient(create_explorer(model))
    tab = "tab-aaaa-0001"
    assert client.post("/api/prepare", json={"prompt": PROMPT, "tab": tab}).json()["cached"] is True
    for layer, head in ((0, 0), (1, 2), (model.n_layers - 1, model.n_heads - 1)):
        d = client.post(
            "/api/pattern", json={"prompt": PROMPT, "layer": layer, "head": head, "tab": tab}
        ).json()
        want = head_pattern(model, PROMPT, layer, head)[0]
        assert d["cached"] is True
        torch.testing.assert_close(torch.tensor(d["probs"]), want.float(), atol=3e-4, rtol=0)
    assert calls == [PROMPT]  # one forward for the prompt, none per click
    client.post("/api/pattern", json={"prompt": PROMPT, "layer": 0, "head": 0, "tab": "tab-bbbb-0002"})
    client.post("/api/pattern", json={"prompt": PROMPT + " more", "layer": 0, "head": 0, "tab": tab})
    assert len(calls) == 3
    r = client.post("/api/prepare", json={"prompt": PROMPT, "tab": "../etc"})
    assert r.status_code == 400 and "tab" in r.json()["error"]
    small = TestClient(create_explorer(model, pattern_cache_bytes=0))
    d = small.post("/api/pattern", json={"prompt": PROMPT, "layer": 1, "head": 2}).json()
    assert d["cached"] is False
    torch.testing.assert_close(torch.tensor(d["probs"]), head_pattern(model, PROMPT, 1, 2)[0].float(),
                               atol=1e-4, rtol=0)  # fmt: skip


def test_pattern_cache_drops_least_recent_over_budget():
    from viz.explorer.patterns import PatternCache, Patterns

    one = Patterns(torch.zeros(2, 2, 4, 4, dtype=torch.float16), ["a"] * 4, [])  # 256 bytes
    cache = PatternCache(budget=2 * one.nbytes)
    cache.put("t", "p1", one)
    cache.put("t", "p2", one)
    assert cache.get("t", "p1") is one  # p1 is now the most recent
    cache.put("t", "p3", one)
    assert cache.get("t", "p2") is None and cache.get("t", "p1") is one and len(cache) == 2
    big = Patterns(torch.zeros(2, 2, 8, 8, dtype=torch.float16), ["a"] * 8, [])
    cache.put("t", "big", big)  # larger than the whole budget: not kept, nothing dropped
    assert cache.get("t", "big") is None and len(cache) == 2


def test_head_card_lens_and_maps(client, model):
    from heads.scorers.maps.static import salient_operations
    from heads.scorers.roles.lens import AttentionLens

    r = client.post("/api/head", json={"prompt": PROMPT, "layer": 1, "head": 2})
    assert r.status_code == 200, r.text
    d = r.json()
    from heads.inputs.prompts import encode_prompts

    text = encode_prompts(model.tokenizer, PROMPT).texts[0]
    top = AttentionLens.init(model, [(1, 2)]).top_tokens(model, text, 1, 2, k=5)
    assert d["lens_tokens"] == list(top["untrained_tokens"].iloc[-1]) and len(d["lens_tokens"]) == 5
    ops = salient_operations(model, 1, 2, k_s=5, k_m=3)
    assert [m["source"] for m in d["maps"]] == list(ops["source"])


def test_steered_stream_differs(client, model):
    heads = [[layer, h] for layer in range(model.n_layers) for h in range(model.n_heads)]
    base = {"prompt": PROMPT, "max_new_tokens": 12}
    pe = scored(client, {**base, "steered": False}, "/api/generate")
    se = scored(client, {**base, "steered": True, "heads": heads, "alpha": 1e-4}, "/api/generate")
    assert pe[-1] == {"done": True} and se[-1] == {"done": True}
    # the steered run ends with the per-layer span share, unsteered and steered
    from steer.pasta.method import Pasta

    share = next(e["span_share"] for e in se if "span_share" in e)
    assert not any("span_share" in e for e in pe)
    pasta = Pasta(heads={la: list(range(model.n_heads)) for la in range(model.n_layers)}, alpha=1e-4)
    before = span_attention(model, PROMPT).scores.mean(1)
    after = span_attention(model, PROMPT, steer=[pasta]).scores.mean(1)
    torch.testing.assert_close(torch.tensor(share["before"]), before.float(), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(share["after"]), after.float(), atol=1e-4, rtol=0)
    assert (after > before).all()  # PASTA scales the other keys down by alpha on every head
    pt = "".join(e.get("text", "") for e in pe)
    st = "".join(e.get("text", "") for e in se)
    assert len(pe) > 3 and pt  # streamed in several pieces
    assert pt != st


def test_patching_map_matches_patch(client, model):
    from heads.scorers.patching.activation import patch
    from heads.scorers.patching.pairs import PromptPair, encode_pairs

    pair = {"clean": "The cat sat on the mat", "corrupted": "The dog sat on the mat", "answer": " and"}
    ev = scored(client, pair, "/api/patch")
    assert any("progress" in e for e in ev)
    d = ev[-1]["result"]
    pairs = encode_pairs(model, [PromptPair(**pair)])
    want = patch(model, pairs, "head_out", metric="log_prob").mean
    torch.testing.assert_close(torch.tensor(d["scores"], dtype=torch.float).nan_to_num(9.0),
                               want.float().nan_to_num(9.0), atol=1e-4, rtol=0)  # fmt: skip
    assert d["metric"] == "log_prob"
    early = next(e["heads_map"] for e in ev if "heads_map" in e)  # sent before the position sweep
    assert early["scores"] == d["scores"]
    pos = patch(model, pairs, "resid_pre", metric="log_prob")
    got = torch.tensor(d["positions"], dtype=torch.float)
    assert got.shape == (model.n_layers, pairs.width) and d["tokens"] == pos.labels
    torch.testing.assert_close(got.nan_to_num(9.0), pos.mean.float().nan_to_num(9.0), atol=1e-4, rtol=0)


def test_cancel_stops_generation_and_sweep(model):
    app = create_explorer(model)
    client = TestClient(app)
    jobs = app.state.jobs
    # cancel flagged before the job's work runs: it never starts and ends cancelled
    job = "cancel-me-0001"
    real_start = jobs.start

    def start_and_cancel(j):
        flag = real_start(j)
        flag.set()
        return flag

    jobs.start = start_and_cancel
    try:
        ev = scored(client, {"prompt": PROMPT, "max_new_tokens": 50, "job": job}, "/api/generate")
        assert ev[-1] == {"cancelled": True} and not any("text" in e for e in ev)
        ev = scored(client, {"prompt": PROMPT, "score": "sinks", "job": job})
        assert ev[-1] == {"cancelled": True}
    finally:
        jobs.start = real_start
    assert jobs.running() == 0
    # a cancel in the middle: the stream stops early, and the next job works
    pieces = []
    with client.stream(
        "POST", "/api/generate", json={"prompt": PROMPT, "max_new_tokens": 200, "job": job}
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                pieces.append(ev)
                if "text" in ev and sum("text" in e for e in pieces) == 2:
                    assert client.post("/api/cancel", json={"job": job}).json()["cancelled"] is True
    assert pieces[-1] == {"cancelled": True}
    assert sum("text" in e for e in pieces) < 20
    assert client.post("/api/cancel", json={"job": job}).json()["cancelled"] is False  # it is over
    assert scored(client, {"prompt": PROMPT, "max_new_tokens": 3}, "/api/generate")[-1] == {"done": True}


def test_bad_requests_are_one_line_and_server_survives(client):
    for body in (
        {"prompt": ""},
        {"prompt": PROMPT, "layer": 99, "head": 0},
        {"prompt": PROMPT, "layer": 0, "head": "x"},
    ):
        for path in ("/api/pattern", "/api/head"):
            r = client.post(path, json=body)
            assert r.status_code == 400 and "\n" not in r.json()["error"], r.text
    r = client.post("/api/generate", json={"prompt": "no span here", "steered": True, "heads": [[0, 0]]})
    assert r.status_code == 400 and "span" in r.json()["error"]
    r = client.post("/api/scores", json={"prompt": "no span here", "score": "span"})
    assert r.status_code == 400 and "span" in r.json()["error"]
    r = client.post("/api/scores", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    r = client.post("/api/patch", json={"clean": "The cat sat", "corrupted": "A dog", "answer": " x"})
    assert r.status_code == 400 and "align" in r.json()["error"], r.text
    assert scored(client, {"prompt": PROMPT})[-1]["result"]["score"] == "span"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b'{"prompt": "a **b**", "layer": ' + b"9" * 5000 + b', "head": 0}', "too large: an integer of 5000"),
        (b"{not json", "not valid JSON: Expecting property name"),
        (b"[" * 20_000, "nested too deeply"),
    ],
)
def test_unparsable_body_names_the_problem(client, data, needle):
    """A 5000-digit integer (beyond Python's `int(str)` limit) is "too large", not "not valid JSON"."""
    for path in ("/api/pattern", "/api/scores"):
        r = client.post(path, content=data, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and needle in r.json()["error"], r.text
        assert "\n" not in r.json()["error"]


@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_noop_alpha_is_400_with_the_cli_warning_text(client, alpha):
    """alpha 1 (a no-op) or above 1 (de-emphasizes the span): HTTP 400 whose message is the
    warning `headsteer generate --alpha` prints before running (it used to run silently)."""
    import warnings

    from steer.pasta.method import check_alpha

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_alpha(alpha)
    want = str(caught[0].message)
    r = client.post(
        "/api/generate", json={"prompt": PROMPT, "steered": True, "heads": [[0, 0]], "alpha": alpha}
    )
    assert r.status_code == 400 and r.json()["error"] == want, r.text


def test_bounds_of_new_endpoints(client):
    r = client.post("/api/scores", json={"prompt": "a" * (MAX_BODY_BYTES + 10)})
    assert r.status_code == 413 and "limit" in r.json()["error"]
    r = client.post("/api/generate", json={"prompt": PROMPT, "max_new_tokens": MAX_NEW_TOKENS + 1})
    assert r.status_code == 400 and "max_new_tokens" in r.json()["error"]
    r = client.post(
        "/api/patch", json={"clean": "a" * (MAX_PROMPT_CHARS + 1), "corrupted": "b", "answer": "c"}
    )
    assert r.status_code == 400 and "limit" in r.json()["error"]
    long = "x" * (MAX_ANSWER_CHARS + 1)
    r = client.post("/api/patch", json={"clean": "The cat", "corrupted": "The dog", "answer": long})
    assert r.status_code == 400 and "answer" in r.json()["error"]
    for bad in ("short", "has space inside!", 7, "x" * 65):
        r = client.post("/api/cancel", json={"job": bad})
        assert r.status_code == 400 and "job" in r.json()["error"]
        r = client.post("/api/generate", json={"prompt": PROMPT, "job": bad})
        assert r.status_code == 400 and "job" in r.json()["error"]
    r = client.post("/api/scores", json={"prompt": PROMPT, "score": "../etc/passwd"})
    assert r.status_code == 400 and "score" in r.json()["error"]


def test_jobs_are_bounded():
    from viz.explorer.app import Jobs

    jobs = Jobs(limit=2)
    jobs.start("aaaaaaaa")
    with pytest.raises(ValueError, match="already running"):
        jobs.start("aaaaaaaa")
    jobs.start("bbbbbbbb")
    with pytest.raises(ValueError, match="2 jobs"):
        jobs.start("cccccccc")
    jobs.end("aaaaaaaa")
    jobs.start("cccccccc")


def test_non_loopback_host_warns(monkeypatch, capsys):
    from viz.cli import explore as mod

    class FakeRun:
        as_json = False

        def load(self):
            raise SystemExit(0)  # stop before loading anything

    with pytest.raises(SystemExit):
        mod.explore_command(FakeRun(), host="0.0.0.0", port=8765)
    assert "not a loopback" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mod.explore_command(FakeRun(), host="127.0.0.1", port=8765)
    assert "warning" not in capsys.readouterr().err


def test_atlas_given_is_used_without_computing(model, tmp_path, monkeypatch):
    from heads.scorers.roles.atlas import HeadAtlas, head_atlas

    fake_detectors(model, monkeypatch)
    atlas = head_atlas(
        model, detectors={}, scores={"induction": span_attention(model, PROMPT)}, thumbnails=False
    )
    path = atlas.save(tmp_path / "atlas.json")
    client = TestClient(create_explorer(model, atlas=HeadAtlas.load(path)))
    assert client.get("/api/info").json()["atlas_ready"] is True
    ev = scored(client, {"prompt": PROMPT, "score": "atlas"})
    assert not any("progress" in e for e in ev)  # nothing computed
    roles = ev[-1]["result"]["roles"]
    assert [roles[la][h] for la, h in zip(atlas.frame["layer"], atlas.frame["head"], strict=True)] == list(
        atlas.frame["role"]
    )


def test_docs_list_every_endpoint_and_response_field(client):
    """docs/explorer.md's HTTP API table has a row per API route, and each row names every
    field of that endpoint's JSON response (read from real responses)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs/explorer.md").read_text()
    rows = {
        ln.split("|")[1].strip(): ln for ln in page.splitlines() if ln.startswith("| `") and "/api/" in ln
    }
    routes = {r.path for r in client.app.routes if getattr(r, "path", "").startswith("/api/")}
    assert {k.split()[1].strip("`") for k in rows} == routes
    tab = "tab-" + "x" * 8
    replies = {
        "GET /api/info": client.get("/api/info").json(),
        "POST /api/prepare": client.post("/api/prepare", json={"prompt": PROMPT, "tab": tab}).json(),
        "POST /api/pattern": client.post(
            "/api/pattern", json={"prompt": PROMPT, "layer": 0, "head": 1}
        ).json(),
        "POST /api/head": client.post("/api/head", json={"prompt": PROMPT, "layer": 0, "head": 1}).json(),
        "POST /api/cancel": client.post("/api/cancel", json={"job": "j" * 8}).json(),
    }
    replies["GET /api/info"].update(replies["GET /api/info"].pop("limits"))
    for endpoint, reply in replies.items():
        row = next(v for k, v in rows.items() if k.startswith(f"`{endpoint}`"))
        for key in reply:
            assert f"`{key}`" in row, (endpoint, key)
    stream = events(client.post("/api/generate", json={"prompt": PROMPT, "max_new_tokens": 1}).text)
    generate_row = next(v for k, v in rows.items() if "/api/generate" in k)
    for ev in stream:
        for key in ev:
            assert f'"{key}"' in generate_row or key in ("job", "status"), key  # events: {"key": ...}


def _steer_cases():
    from steer import Ablate, Act, InstaBoost, Pasta, Spotlight

    return [  # (method, request fields, the same intervention built directly)
        ("pasta", {"alpha": 1e-3, "heads": [[0, 0], [1, 1]]}, Pasta(heads={0: [0], 1: [1]}, alpha=1e-3)),
        ("spotlight", {"tau": 0.6}, Spotlight(tau=0.6)),
        ("instaboost", {"multiplier": 20.0}, InstaBoost(multiplier=20.0)),
        ("act", {"beta": 0.0, "heads": [[0, 0], [1, 2]]}, Act(heads={0: [0], 1: [2]}, beta=0.0)),
        ("ablate", {"eps": 0.0, "heads": [[0, 1], [1, 0]]}, Ablate(heads={0: [1], 1: [0]}, eps=0.0)),
    ]


@pytest.mark.parametrize("case", range(5), ids=["pasta", "spotlight", "instaboost", "act", "ablate"])
def test_each_steering_method_streams_what_generate_gives(client, model, case):
    """Every method of the panel: the streamed steered text is `SteeredModel.generate`'s text for
    the same intervention built in Python."""
    from steer.steered_model import SteeredModel

    method, fields, intervention = _steer_cases()[case]
    body = {"prompt": PROMPT, "max_new_tokens": 10, "steered": True, "method": method, **fields}
    evs = scored(client, body, "/api/generate")
    assert evs[-1] == {"done": True}, evs[-1]
    got = "".join(e.get("text", "") for e in evs)
    sm = SteeredModel(model)
    want = sm.generate(PROMPT, [intervention], max_new_tokens=10, progress=False).texts[0]
    plain = sm.generate(PROMPT, [], max_new_tokens=10, progress=False).texts[0]
    assert got == want
    assert any("span_share" in e for e in evs)  # the prompt has a span: the chart is drawn
    if method == "act":  # random weights put no token over ACT's sink threshold: nothing to calibrate
        return
    assert want != plain, f"{method} at {fields} does not change the tiny model's text"


def test_steering_methods_listed_and_checked(client):
    info = client.get("/api/info").json()
    assert set(info["steer_methods"]) == {"pasta", "spotlight", "instaboost", "act", "ablate"}
    assert info["steer_methods"]["spotlight"] == {
        "parameter": "tau",
        "default": 0.1,
        "heads": "refused",
        "span": True,
    }
    base = {"prompt": PROMPT, "steered": True}
    cases = [
        ({"method": "nope"}, "unknown method 'nope'"),
        ({"method": ["pasta"]}, "unknown method ['pasta']"),
        ({"method": "spotlight", "heads": [[0, 0]]}, "spotlight steers every head"),
        ({"method": "spotlight", "alpha": 0.1}, "spotlight does not use alpha: its parameter is tau"),
        ({"method": "spotlight", "tau": 1.5}, "tau"),
        ({"method": "instaboost", "multiplier": 1.0}, "no-op"),  # a no-op is refused
        ({"method": "act", "beta": 2}, "beta must be in [0, 1], got 2"),
        ({"method": "ablate"}, "heads must be a non-empty list"),
        ({"method": "ablate", "heads": [[0, 0]], "eps": 1}, "no-op"),  # eps 1 is a no-op
        ({"method": "ablate", "heads": [[0, 0]], "mode": "xx"}, "unknown ablation method 'xx'"),
        ({"method": "pasta", "heads": [[0, 99]]}, "bad head [0, 99]"),
    ]
    for fields, needle in cases:
        r = client.post("/api/generate", json={**base, **fields})
        assert r.status_code == 400, (fields, r.text)
        msg = r.json()["error"]
        assert needle in msg and "\n" not in msg and "steer[0]" not in msg, (fields, msg)
    r = client.post("/api/generate", json={"prompt": "no span", "steered": True, "method": "instaboost"})
    assert r.status_code == 400 and "instaboost needs a span" in r.json()["error"]
    # ACT and ablation need no span: the same prompt without one runs
    evs = scored(
        client, {"prompt": "no span", "steered": True, "method": "act", "max_new_tokens": 2}, "/api/generate"
    )
    assert evs[-1] == {"done": True} and not any("span_share" in e for e in evs)
