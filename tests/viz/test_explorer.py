"""The head explorer (`viz.explorer`): API on a tiny model, and one real-browser load."""

import json
import re
import shutil
import socket
import subprocess
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient

from heads.scorers.attention_mass import head_pattern, span_attention
from viz.explorer import MAX_BODY_BYTES, MAX_NEW_TOKENS, create_explorer

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


def test_scores_grid_matches_scorer(client, model):
    r = client.post("/api/scores", json={"prompt": PROMPT, "score": "span"})
    assert r.status_code == 200, r.text
    grid = torch.tensor(r.json()["scores"])
    assert grid.shape == (model.n_layers, model.n_heads)
    torch.testing.assert_close(grid, span_attention(model, PROMPT).scores.float(), atol=1e-4, rtol=0)
    sinks = client.post("/api/scores", json={"prompt": PROMPT, "score": "sinks"})
    assert sinks.status_code == 200, sinks.text
    assert len(sinks.json()["scores"]) == model.n_layers


def test_pattern_of_a_head(client, model):
    r = client.post("/api/pattern", json={"prompt": PROMPT, "layer": 1, "head": 2})
    assert r.status_code == 200, r.text
    d = r.json()
    probs, tokens, spans = head_pattern(model, PROMPT, 1, 2)
    assert d["tokens"] == tokens and [tuple(s) for s in d["spans"]] == spans
    got = torch.tensor(d["probs"])
    torch.testing.assert_close(got, probs.float(), atol=1e-4, rtol=0)
    torch.testing.assert_close(got.sum(-1), torch.ones(len(tokens)), atol=1e-3, rtol=0)


def test_steered_stream_differs(client, model):
    heads = [[layer, h] for layer in range(model.n_layers) for h in range(model.n_heads)]
    base = {"prompt": PROMPT, "max_new_tokens": 12}
    plain = client.post("/api/generate", json={**base, "steered": False})
    steered = client.post("/api/generate", json={**base, "steered": True, "heads": heads, "alpha": 1e-4})
    assert plain.status_code == steered.status_code == 200
    pe, se = events(plain.text), events(steered.text)
    assert pe[-1] == {"done": True} and se[-1] == {"done": True}
    pt = "".join(e.get("text", "") for e in pe)
    st = "".join(e.get("text", "") for e in se)
    assert len(pe) > 2 and pt  # streamed in several pieces
    assert pt != st


def test_bad_requests_are_one_line_and_server_survives(client):
    for body in (
        {"prompt": ""},
        {"prompt": PROMPT, "layer": 99, "head": 0},
        {"prompt": PROMPT, "layer": 0, "head": "x"},
    ):
        r = client.post("/api/pattern", json=body)
        assert r.status_code == 400 and "\n" not in r.json()["error"], r.text
    r = client.post("/api/generate", json={"prompt": "no span here", "steered": True, "heads": [[0, 0]]})
    assert r.status_code == 400 and "span" in r.json()["error"]
    r = client.post("/api/scores", json={"prompt": "no span here", "score": "span"})
    assert r.status_code == 400 and "span" in r.json()["error"]
    r = client.post("/api/scores", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert client.post("/api/scores", json={"prompt": PROMPT}).status_code == 200


def test_oversize_requests_refused(client):
    r = client.post("/api/scores", json={"prompt": "a" * (MAX_BODY_BYTES + 10)})
    assert r.status_code == 413 and "limit" in r.json()["error"]
    r = client.post("/api/generate", json={"prompt": PROMPT, "max_new_tokens": MAX_NEW_TOKENS + 1})
    assert r.status_code == 400 and "max_new_tokens" in r.json()["error"]


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


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium")
def test_page_in_headless_chromium(model, tmp_path):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_explorer(model), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(100):
        if server.started:
            break
        time.sleep(0.05)
    try:
        shot = tmp_path / "explorer.png"
        base = [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1100",
            "--virtual-time-budget=10000", "--enable-logging=stderr", "--v=0",
        ]  # fmt: skip
        url = f"http://127.0.0.1:{port}/"
        dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120)
        errors = [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln and "rror" in ln]
        assert not errors, errors
        assert 'class="main-svg"' in dom.stdout  # Plotly drew the grid
        assert "heatmaplayer" in dom.stdout
        assert re.search(r'id="error"[^>]*></div>', dom.stdout), "the page shows an error"
        subprocess.run([*base, f"--screenshot={shot}", url], capture_output=True, timeout=120)
        assert shot.is_file() and shot.stat().st_size > 10_000
    finally:
        server.should_exit = True
        thread.join(timeout=10)
