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
    monkeypatch.setattr(patterns_mod, "all_patterns", lambda m, p, **k: calls.append(p) or real(m, p, **k))
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


def cancel_on_start(jobs):
    """Make every job of `jobs` cancelled as soon as it registers (before its work runs);
    returns the real `start` to put back."""
    real_start = jobs.start

    def start_and_cancel(j):
        flag = real_start(j)
        flag.set()
        return flag

    jobs.start = start_and_cancel
    return real_start


def test_cancel_stops_generation_and_sweep(model, monkeypatch):
    app = create_explorer(model)
    client = TestClient(app)
    jobs = app.state.jobs
    # cancel flagged before the job's work runs: it never starts and ends cancelled
    job = "cancel-me-0001"
    real_start = cancel_on_start(jobs)
    try:
        ev = scored(client, {"prompt": PROMPT, "max_new_tokens": 50, "job": job}, "/api/generate")
        assert ev[-1] == {"cancelled": True} and not any("text" in e for e in ev)
        ev = scored(client, {"prompt": PROMPT, "score": "sinks", "job": job})
        assert ev[-1] == {"cancelled": True}
    finally:
        jobs.start = real_start
    assert jobs.running() == 0
    # a cancel in the middle: nothing is streamed after the cancel is acknowledged, the slot is
    # freed when the stream ends, and the next job works (no count that depends on speed)
    record = gated_streamer(monkeypatch, after=2)
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
    assert record["after_cancel"] == [] and len(record["emitted"]) == 2  # nothing after the acknowledgement
    assert sum("text" in e for e in pieces) == 2
    assert jobs.running() == 0  # the slot is free once the stream has ended
    assert client.post("/api/cancel", json={"job": job}).json()["cancelled"] is False  # it is over
    monkeypatch.undo()
    assert scored(client, {"prompt": PROMPT, "max_new_tokens": 3}, "/api/generate")[-1] == {"done": True}


def gated_streamer(monkeypatch, after: int) -> dict:
    """Make the explorer's generation stream `after` text pieces, then wait for its job's cancel
    flag (so it cannot end on its own before the test cancels it); records every piece emitted
    and those emitted once the flag was set."""
    import viz.explorer.routes.generate as gen

    real = gen._Streamer
    record: dict = {"emitted": [], "after_cancel": []}

    def make(tokenizer, emit, flag):
        def watched(ev):
            if "text" in ev:
                record["emitted"].append(ev["text"])
                if flag.is_set():
                    record["after_cancel"].append(ev["text"])
            emit(ev)

        s = real(tokenizer, watched, flag)
        put = s.put

        def gated_put(value):
            if len(record["emitted"]) >= after:
                assert flag.wait(60), "the test never cancelled"
            put(value)

        s.put = gated_put
        return s

    monkeypatch.setattr(gen, "_Streamer", make)
    return record


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
    import sys

    from viz.cli import explore as mod

    class FakeRun:
        as_json = False

        def say(self, msg):
            print(msg, file=sys.stderr)

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


def route_paths(routes) -> list[str]:
    """The paths of `routes`, those of included routers too (FastAPI keeps an included router
    as one entry, its routes under `original_router`)."""
    out = []
    for r in routes:
        sub = getattr(r, "original_router", None)
        out += route_paths(sub.routes) if sub is not None else [getattr(r, "path", "")]
    return out


def test_docs_list_every_endpoint_and_response_field(client):
    """docs/explorer.md's HTTP API table has a row per API route, and each row names every
    field of that endpoint's JSON response (read from real responses)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs/explorer.md").read_text()
    rows = {
        ln.split("|")[1].strip(): ln for ln in page.splitlines() if ln.startswith("| `") and "/api/" in ln
    }
    routes = {p for p in route_paths(client.app.routes) if p.startswith("/api/")}
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


# ----------------------------------------------------------------------- dla, ships, maps, probes
NEW_SCORES = ("dla", "ships", "maps", "probes")


def progress_of_events(ev: list[dict]) -> list[list[int]]:
    got = [e["progress"] for e in ev if "progress" in e]
    assert got, ev
    assert all(0 <= d <= t for d, t in got) and [d for d, _ in got] == sorted(d for d, _ in got)
    assert got[-1][0] == got[-1][1]  # ends at its total
    return got


def oracle_dla(model, prompt):
    """The library's per-head direct logit of the model's own top next token (last position)."""
    from heads.engine.forward import forward
    from heads.inputs.prompts import encode_prompts
    from heads.scorers.patching.logit import head_logits
    from heads.scorers.patching.pairs import PromptPair, encode_pairs

    text = encode_prompts(model.tokenizer, prompt).texts[0]
    logits = forward(model, encode_prompts(model.tokenizer, text, chat=False, markup=False))[0, -1]
    top, second = logits.topk(2).indices.tolist()
    answer, _ = head_logits(model, encode_pairs(model, [PromptPair(text, text, top, second)]))
    return answer[0], top


def oracle_maps(model):
    from heads.scorers.maps.static import maps_scores
    from probes.datasets.relations import load_relations

    rels = load_relations(model.tokenizer, d_vocab=model.d_vocab).relations
    return maps_scores(model, rels, progress=False)


def oracle_probes(model):
    from probes.head_probes import collect_head_outputs, fit_head_probes, probe_data
    from viz.explorer.app import PROBE_LIMIT, PROBE_TASK

    data = probe_data(PROBE_TASK, "train", limit=PROBE_LIMIT)
    acts = collect_head_outputs(model, data.prompts, "last", chat=data.chat, progress=False)
    return fit_head_probes(acts, data.labels, groups=data.groups, model=model, progress=False), data


def rounded(t):
    return torch.tensor([[round(v, 5) for v in row] for row in t.float().tolist()])


def test_new_scores_equal_library_scorers_with_progress(model):
    """Each new grid equals its library scorer called directly (exact after rounding to 5
    decimals), progress events arrive, the head card then shows the head's values, and a
    second card for the same head computes nothing."""
    from heads.engine.options import SweepOptions
    from heads.inputs.prompts import encode_prompts
    from heads.inputs.tokens import readable_token
    from heads.scorers.safety.ships import ships

    app = create_explorer(model)
    client = TestClient(app)
    L, H = model.n_layers, model.n_heads
    got = {}
    for kind in NEW_SCORES:
        ev = scored(client, {"prompt": PROMPT, "score": kind})
        assert "result" in ev[-1], ev[-1]
        got[kind] = ev[-1]["result"]
        assert got[kind]["score"] == kind and torch.tensor(got[kind]["scores"]).shape == (L, H)
        steps = progress_of_events(ev)
        if kind in ("maps", "probes"):
            assert len(steps) >= L, steps  # maps: one per layer; probes: prompt batches, then heads
    want, top = oracle_dla(model, PROMPT)
    assert torch.equal(torch.tensor(got["dla"]["scores"]), rounded(want))
    assert got["dla"]["token"] == readable_token(model.tokenizer, top)
    plain = encode_prompts(model.tokenizer, PROMPT, chat=False).texts[0]
    assert "**" not in plain
    want = ships(model, plain, options=SweepOptions(progress=False)).scores.scores
    assert torch.equal(torch.tensor(got["ships"]["scores"]), rounded(want))
    ms = oracle_maps(model)
    stack = torch.stack([ms.relation[n].scores for n in ms.names()])
    assert torch.equal(torch.tensor(got["maps"]["scores"]), rounded(stack.amax(0)))
    assert set(got["maps"]["columns"]) == set(ms.names())
    for n in ms.names():
        assert torch.equal(torch.tensor(got["maps"]["columns"][n]), rounded(ms.relation[n].scores))
    for la in range(L):
        for h in range(H):
            name = got["maps"]["best_relation"][la][h]
            assert ms.relation[name].scores[la, h] == stack[:, la, h].max()
    res, data = oracle_probes(model)
    assert torch.equal(torch.tensor(got["probes"]["scores"]), rounded(res.accuracy.scores))
    assert torch.equal(torch.tensor(got["probes"]["columns"]["auc"]), rounded(res.auc.scores))
    assert got["probes"]["n"] == len(data.prompts) == res.n
    # the card shows every computed score's value for the head, from the caches
    from heads.scorers.maps import static
    from heads.scorers.roles import lens

    calls = []
    real_top, real_ops = lens.AttentionLens.top_tokens, static.salient_operations

    def count_top(self, *a, **k):
        calls.append("lens")
        return real_top(self, *a, **k)

    def count_ops(*a, **k):
        calls.append("maps")
        return real_ops(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lens.AttentionLens, "top_tokens", count_top)
        mp.setattr(static, "salient_operations", count_ops)
        first = client.post("/api/head", json={"prompt": PROMPT, "layer": 2, "head": 1}).json()
        assert calls == ["lens", "maps"]
        again = client.post("/api/head", json={"prompt": PROMPT, "layer": 2, "head": 1}).json()
        assert again == first and calls == ["lens", "maps"]  # nothing recomputed
        other = client.post("/api/head", json={"prompt": PROMPT + " more", "layer": 2, "head": 1}).json()
        assert calls == ["lens", "maps", "lens"]  # a new prompt: its lens only (MAPS is per head)
    assert set(first["scores"]) == set(NEW_SCORES)
    for kind in NEW_SCORES:
        assert first["scores"][kind] == got[kind]["scores"][2][1]
    assert set(other["scores"]) == {"maps", "probes"}  # dla / ships are per prompt
    assert first["maps_describe"] == ms.describe(2, 1)
    # asked again, a prompt's dla grid and the server's maps come from the caches: no progress
    for kind in ("dla", "maps", "probes"):
        ev = scored(client, {"prompt": PROMPT, "score": kind})
        assert ev[-1]["result"] == got[kind] and not any("progress" in e for e in ev)


def stop_after_first_step(monkeypatch, module, name):
    """Wrap `module.name` so that after its first progress step it waits until the test has
    posted `/api/cancel` (set the returned event); also returns the steps it reported."""
    import threading

    real = getattr(module, name)
    posted = threading.Event()
    seen: list[tuple[int, int]] = []

    def wrapped(*a, progress=None, **k):
        options = k.pop("options", None)  # an analysis taking SweepOptions gets its progress there
        if options is not None:
            progress = options.progress

        def step(done, total):
            seen.append((done, total))
            progress(done, total)  # the explorer's callback: raises once the job is cancelled
            if done > 0 and not posted.is_set():
                assert posted.wait(30)

        if options is not None:
            return real(*a, options=options.replace(progress=step), **k)
        return real(*a, progress=step, **k)

    monkeypatch.setattr(module, name, wrapped)
    return posted, seen


@pytest.mark.parametrize(
    ("kind", "module", "name"),
    [
        ("maps", "heads.scorers.maps.static", "run_maps"),  # the explorer runs a MapsRequest
        ("probes", "probes.head_probes", "collect_head_outputs"),
    ],
)
def test_cancel_stops_a_new_score_mid_run(model, monkeypatch, kind, module, name):
    import importlib

    app = create_explorer(model)
    client = TestClient(app)
    job = f"cancel-{kind}-0001"
    posted, seen = stop_after_first_step(monkeypatch, importlib.import_module(module), name)
    ev = []
    with client.stream("POST", "/api/scores", json={"prompt": PROMPT, "score": kind, "job": job}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev.append(json.loads(line[6:]))
                if "progress" in ev[-1] and ev[-1]["progress"][0] > 0 and not posted.is_set():
                    assert client.post("/api/cancel", json={"job": job}).json()["cancelled"] is True
                    posted.set()
    assert ev[-1] == {"cancelled": True}
    done = [e["progress"] for e in ev if "progress" in e]
    assert done and done[-1][0] < done[-1][1]  # stopped before its total
    assert len(seen) == 2 and seen[0][0] < seen[0][1]  # the scorer's next step raised
    assert app.state.jobs.running() == 0
    monkeypatch.undo()  # the next run is the real one, and completes
    ev = scored(client, {"prompt": PROMPT, "score": kind})
    assert "result" in ev[-1] and ev[-1]["result"]["score"] == kind


@pytest.mark.parametrize("kind", NEW_SCORES)
def test_new_scores_cancelled_before_start(model, kind):
    app = create_explorer(model)
    client = TestClient(app)
    jobs = app.state.jobs
    cancel_on_start(jobs)
    ev = scored(client, {"prompt": PROMPT, "score": kind, "job": f"pre-{kind}-0001"})
    assert ev[-1] == {"cancelled": True} and not any("progress" in e for e in ev)
    assert jobs.running() == 0


def test_score_names_in_info_and_bad_name(client):
    names = client.get("/api/info").json()["scores"]
    assert names == ["span", "sinks", "atlas", "dla", "ships", "maps", "probes"]
    r = client.post("/api/scores", json={"prompt": PROMPT, "score": "mapz"})
    assert r.status_code == 400 and "'mapz'" in r.json()["error"]
    assert all(n in r.json()["error"] for n in names)


def test_dla_on_an_unsupported_model_is_400_before_work(tokenizer):
    """A final norm that is neither an RMSNorm nor a LayerNorm (here an L1 norm without an
    `eps`) cannot be frozen: one line, HTTP 400, and the server goes on."""
    from tests.support import make_tiny

    hm = make_tiny("llama", tokenizer)

    class L1Norm(torch.nn.Module):
        def forward(self, x):
            return x / x.abs().mean(-1, keepdim=True)

    hm.model.model.norm = L1Norm()
    client = TestClient(create_explorer(hm))
    r = client.post("/api/scores", json={"prompt": PROMPT, "score": "dla"})
    err = r.json()["error"]
    assert r.status_code == 400 and ("freeze" in err or "frozen" in err) and "\n" not in err
    assert "result" in scored(client, {"prompt": PROMPT, "score": "ships"})[-1]


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


def test_unknown_and_misplaced_fields_are_400(client):
    """A typo must not silently run the default (`"scores"` for `"score"`), and steering fields
    without `"steered": true` must not silently give unsteered text (found by a breaker)."""
    cases = [
        ("/api/scores", {"prompt": PROMPT, "scores": "sinks"}, "unknown field(s) ['scores']"),
        *[
            ("/api/scores", {"prompt": "a **b", "score": k}, "unbalanced '**' markup")
            for k in ("sinks", "ships")
        ],
        ("/api/scores", {"prompt": "a \ud800 b", "score": "sinks"}, "lone surrogate"),
        ("/api/pattern", {"prompt": PROMPT, "layer": 0, "head": 0, "bogus": 1}, "unknown field(s) ['bogus']"),
        ("/api/cancel", {"job": "j" * 8, "tab": "x"}, "unknown field(s) ['tab']"),
        ("/api/patch", {"clean": "a", "corrupted": "b", "answer": "c", "metric": "x"}, "['metric']"),
        ("/api/generate", {"prompt": PROMPT, "method": "zzz", "heads": [[0, 0]]}, 'add "steered": true'),
        ("/api/generate", {"prompt": PROMPT, "alpha": 0.1}, "alpha only apply to a steered run"),
        ("/api/generate", {"prompt": PROMPT, "bogus": 1}, "unknown field(s) ['bogus']"),
    ]
    for path, body, needle in cases:  # json.dumps escapes a lone surrogate as \ud800
        r = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and needle in r.json()["error"], (path, r.text)
    assert scored(client, {"prompt": PROMPT, "max_new_tokens": 1}, "/api/generate")[-1] == {"done": True}


def test_edit_errors_are_400_before_the_job(client):
    """What an intervention refuses only when its edits are built (an ablation eps beyond the
    dtype, stacked factors) is HTTP 400 before any job starts, not an error event in a stream."""
    r = client.post(
        "/api/generate",
        json={"prompt": PROMPT, "steered": True, "method": "ablate", "heads": [[0, 0]], "eps": 1e30},
    )
    assert r.status_code == 400 and "overflows float32" in r.json()["error"], r.text
    assert scored(client, {"prompt": PROMPT, "max_new_tokens": 1}, "/api/generate")[-1] == {"done": True}


def test_a_client_that_leaves_cancels_its_jobs(model, monkeypatch):
    """Closing the page (or a script dropping its stream) stops its jobs: a running generation
    at its next token, a job still waiting for the model before it starts; the job slots are
    freed (found by a breaker: orphaned jobs ran to the end and held the slots). The running
    generation cannot end on its own here (it waits for its cancel flag after one piece), so
    every assertion is on what cancelling guarantees, not on time."""
    import requests

    from tests.support.waiting import wait_until
    from tests.viz.test_explorer_browser import serve

    record = gated_streamer(monkeypatch, after=1)
    app = create_explorer(model)
    url, stop = serve(app)
    try:
        body = {"prompt": PROMPT, "max_new_tokens": 200}
        first = requests.post(
            url + "api/generate", json={**body, "job": "leaver-run-1"}, stream=True, timeout=60
        )
        lines = first.iter_lines()
        assert b"job" in next(lines)
        while b'"text"' not in next(lines):
            pass
        waiting = [  # queued behind the first: they wait for the model
            requests.post(
                url + "api/generate", json={**body, "job": f"leaver-wait-{i}"}, stream=True, timeout=60
            )
            for i in range(3)
        ]
        for r in waiting:
            assert b"job" in next(r.iter_lines())
        assert app.state.jobs.running() == 4
        for r in (first, *waiting):
            r.close()
        wait_until(
            lambda: app.state.jobs.running() == 0, "the jobs of a gone client end and free their slots"
        )
        assert len(record["emitted"]) == 1 and record["after_cancel"] == []  # the waiting ones never ran
        monkeypatch.undo()
        done = requests.post(url + "api/generate", json={"prompt": PROMPT, "max_new_tokens": 1}, timeout=60)
        assert done.status_code == 200 and '"done": true' in done.text
    finally:
        stop()


def test_prompts_and_pairs_are_checked_before_any_job(client):
    """Found by a breaker: each of these was an HTTP 200 stream ending in an error event (or an
    all-null map, or a silent 200) instead of a 400 before the work."""
    long = "\u0800" * 3000  # 3000 characters, far more tokens than the explorer takes
    cases = [
        ("/api/prepare", {"prompt": long}, "tokens"),
        ("/api/pattern", {"prompt": long, "layer": 0, "head": 0}, "tokens"),
        ("/api/scores", {"prompt": long, "score": "sinks"}, "tokens"),
        ("/api/generate", {"prompt": long, "max_new_tokens": 1}, "tokens"),
        ("/api/generate", {"prompt": "a **b", "max_new_tokens": 1}, "unbalanced '**' markup"),
        ("/api/generate", {"prompt": "a \ud800 b"}, "prompt has a lone surrogate"),
        (
            "/api/patch",
            {"clean": "The cat \ud800", "corrupted": "The dog x", "answer": " a"},
            "clean has a lone",
        ),
        (
            "/api/patch",
            {"clean": "The cat sat", "corrupted": "The cat sat", "answer": " on"},
            "the same text",
        ),
        (
            "/api/patch",
            {"clean": "The cat sat", "corrupted": "The dog sat", "answer": " on", "counterfactual": " on"},
            "counterfactual is the answer",
        ),
    ]
    for path, body, needle in cases:
        r = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and needle in r.json()["error"], (path, r.text[:300])


def test_pattern_json_has_four_decimals(client, model):
    r = client.post("/api/pattern", json={"prompt": PROMPT, "layer": 0, "head": 1})
    values = [v for row in r.json()["probs"] for v in row]
    assert all(len(repr(v).split(".")[-1]) <= 4 for v in values), [v for v in values if len(repr(v)) > 6][:3]


def test_cross_site_requests_are_refused(model):
    """A page of another site can send a text/plain POST without asking (no CORS preflight), and a
    DNS-rebinding page reaches the loopback port under its own Host name: both refused."""
    from viz.explorer.app import LOOPBACK_HOSTS

    guarded = TestClient(create_explorer(model, hosts=LOOPBACK_HOSTS), base_url="http://127.0.0.1:8765")
    body = json.dumps({"prompt": "hi", "max_new_tokens": 1})
    r = guarded.post("/api/generate", content=body, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]
    r = guarded.get("/api/info", headers={"Host": "attacker.example:8765"})
    assert r.status_code == 403 and "attacker.example" in r.json()["error"]
    assert guarded.get("/api/info").status_code == 200
    assert guarded.get("/api/info", headers={"Host": "[::1]:8765"}).status_code == 200
    assert guarded.get("/api/info", headers={"Host": "localhost"}).status_code == 200


def test_a_client_gone_before_its_stream_starts_frees_the_slot(model):
    """A client that closes its socket right after sending the request (before the first event)
    left its job registered for ever; 16 of them locked every job endpoint (found by a breaker)."""
    import socket

    from tests.support.waiting import wait_until
    from tests.viz.test_explorer_browser import serve

    app = create_explorer(model)
    seen = []  # every request that reached the job registry (a refused one included)
    real_start = app.state.jobs.start

    def counting_start(job):
        seen.append(job)
        return real_start(job)

    app.state.jobs.start = counting_start
    url, stop = serve(app)
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    try:
        for i in range(20):
            body = json.dumps({"prompt": "hi", "max_new_tokens": 1, "job": f"leakjob{i:04d}"}).encode()
            with socket.create_connection((host, int(port))) as s:
                s.sendall(
                    b"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
        # the server may take the 20 requests after the sockets closed: wait for that state
        wait_until(
            lambda: len(seen) == 20 and app.state.jobs.running() == 0, "20 requests seen, no slot held"
        )
        import requests

        r = requests.post(url + "api/generate", json={"prompt": PROMPT, "max_new_tokens": 1}, timeout=30)
        assert r.status_code == 200 and '"done": true' in r.text, r.text
    finally:
        stop()


def test_a_white_space_answer_is_a_token(client):
    """`"\\n"` or `" "` is a one-token answer, not an empty one (found by a breaker)."""
    r = client.post("/api/patch", json={"clean": "The cat sat", "corrupted": "The dog sat", "answer": "\n"})
    assert r.status_code == 200, r.text
    assert scored(client, {"clean": "The cat sat", "corrupted": "The dog sat", "answer": " "}, "/api/patch")[
        -1
    ].get("result")
