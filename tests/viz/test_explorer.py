"""The head explorer (`viz.explorer`): its views (page, score grids, patterns, head card, patching map,
atlas) on a tiny model, and its documented API.

The other explorer API tests: test_explorer_scores.py (the DLA, Ships, MAPS and probes grids),
test_explorer_steering.py, test_explorer_requests.py (bad input), test_explorer_jobs.py (cancelling,
job slots); their shared helpers are in tests/support/explorer.py."""

import pytest
import torch
from fastapi.testclient import TestClient

from heads.scorers.attention_mass import head_pattern, span_attention
from tests.support.explorer import PROMPT, events, fake_detectors, scored
from viz.explorer import create_explorer


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


def test_scores_grid_matches_scorer(client, model):
    ev = scored(client, {"prompt": PROMPT, "score": "span"})
    grid = torch.tensor(ev[-1]["result"]["scores"])
    assert grid.shape == (model.n_layers, model.n_heads)
    torch.testing.assert_close(grid, span_attention(model, PROMPT).scores.float(), atol=1e-4, rtol=0)
    sinks = scored(client, {"prompt": PROMPT, "score": "sinks"})[-1]["result"]
    assert len(sinks["scores"]) == model.n_layers


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


def test_pattern_json_has_four_decimals(client, model):
    r = client.post("/api/pattern", json={"prompt": PROMPT, "layer": 0, "head": 1})
    values = [v for row in r.json()["probs"] for v in row]
    assert all(len(repr(v).split(".")[-1]) <= 4 for v in values), [v for v in values if len(repr(v)) > 6][:3]


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
