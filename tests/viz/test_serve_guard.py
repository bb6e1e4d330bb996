"""Cross-site use of `headsteer serve` and `headsteer explore`: JSON-only bodies, the Host check
on loopback binds (however `--host` spells the loopback name), the server's API key, and the
address printed at bind time."""

import json
import socket

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from viz.cli.main import app as cli
from viz.server.app import create_app
from viz.web.guard import loopback_hosts

pytest.importorskip("uvicorn")

KEY = "s3cret-key-0001"
CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1, "temperature": 0}


def test_server_refuses_text_plain_and_foreign_hosts(tiny_llama):
    """Found by a breaker: a `text/plain` POST (which any web page may send cross-site without a
    preflight) ran a generation, and `Host: evil.example` (DNS rebinding) was served."""
    app = create_app(tiny_llama, hosts=loopback_hosts("127.0.0.1", "127.0.0.1"))
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        r = client.post(
            "/v1/chat/completions", content=json.dumps(CHAT), headers={"Content-Type": "text/plain"}
        )
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], r.text
        for path in ("/v1/models", "/v1/chat/completions"):
            r = client.request(
                "POST" if "chat" in path else "GET", path, json=CHAT, headers={"Host": "evil.example:8000"}
            )
            assert r.status_code == 403 and "'evil.example'" in r.json()["error"]["message"], r.text
        assert app.state.batcher.batches == []  # none of them reached the model
        for host in ("127.0.0.1:8000", "LOCALHOST.:8000", "[::1]:8000", "127.0.0.2"):
            assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
        r = client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
        assert app.state.batcher.batches == [1]


def test_server_api_key(tiny_llama):
    """With an API key every route needs `Authorization: Bearer KEY`; the OpenAI client sends it."""
    openai = pytest.importorskip("openai")
    app = create_app(tiny_llama, api_key=KEY)
    with TestClient(app) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"X-Api-Key": KEY}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
                r = client.request(method, path, json=CHAT, headers=headers)
                assert r.status_code == 401 and "API key" in r.json()["error"]["message"], (headers, r.text)
        assert app.state.batcher.batches == []
        good = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=client, max_retries=0)
        assert [m.id for m in good.models.list().data] == [tiny_llama.name]
        r = good.chat.completions.create(model=tiny_llama.name, messages=CHAT["messages"], max_tokens=1)
        assert r.usage.completion_tokens == 1
        bad = openai.OpenAI(
            base_url="http://testserver/v1", api_key="nope", http_client=client, max_retries=0
        )
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def _serve_and_capture(monkeypatch, model, args: list[str]):
    """Run `headsteer ARGS` with the model load faked and uvicorn replaced: returns the CLI result
    and the (app, port) it would have served."""
    import viz.cli.explore
    import viz.cli.listen
    from viz.cli.common import Run

    monkeypatch.setattr(Run, "load", lambda *a, **k: model)
    served = []

    def fake_run(app_, sock, **kw):
        served.append((app_, sock.getsockname()[1]))
        sock.close()

    monkeypatch.setattr(viz.cli.listen, "run_uvicorn", fake_run)
    monkeypatch.setattr(viz.cli.explore, "run_uvicorn", fake_run)
    return CliRunner().invoke(cli, args), served


@pytest.mark.parametrize("host", ["LOCALHOST", "localhost.", "Localhost.", "127.1", "127.0.0.1"])
@pytest.mark.parametrize("command", ["explore", "serve"])
def test_loopback_by_address_keeps_the_host_check(tiny_llama, monkeypatch, command, host):
    """Found by a breaker: `explore --host LOCALHOST` (or `localhost.`) bound 127.0.0.1 but turned
    the Host check off (the name was compared case-sensitively); `serve` refused those names
    as not loopback. Decided by the address bound: the check stays on."""
    res, served = _serve_and_capture(monkeypatch, tiny_llama, [command, "--host", host, "--port", "0"])
    assert res.exit_code == 0, res.output
    assert "not a loopback" not in res.output
    app_, port = served[0]
    client = TestClient(app_, base_url=f"http://127.0.0.1:{port}")
    path = "/api/info" if command == "explore" else "/v1/models"
    assert client.get(path, headers={"Host": f"evil.example:{port}"}).status_code == 403
    assert client.get(path, headers={"Host": f"{host}:{port}"}).status_code == 200
    assert client.get(path, headers={"Host": f"localhost:{port}"}).status_code == 200


def test_serve_needs_an_api_key_off_loopback(tiny_llama, monkeypatch):
    res, served = _serve_and_capture(monkeypatch, tiny_llama, ["serve", "--host", "0.0.0.0", "--port", "0"])
    assert res.exit_code == 2 and "--api-key" in res.output and not served, res.output
    monkeypatch.setenv("HEADSTEER_API_KEY", KEY)  # from the environment: not in `ps`
    res, served = _serve_and_capture(monkeypatch, tiny_llama, ["serve", "--host", "0.0.0.0", "--port", "0"])
    assert res.exit_code == 0, res.output
    assert "plain HTTP" in res.stderr  # the key travels unencrypted: said once
    client = TestClient(served[0][0], base_url="http://10.1.2.3:8000")
    assert (
        client.get("/v1/models", headers={"Host": "any.example"}).status_code == 401
    )  # no Host check, a key
    ok = client.get("/v1/models", headers={"Host": "any.example", "Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    res = CliRunner().invoke(cli, ["serve", "--api-key", "has space"])
    assert res.exit_code == 2 and "--api-key" in res.output


@pytest.mark.parametrize(
    ("command", "what", "path"), [("explore", "explorer", "/"), ("serve", "server", "/v1")]
)
def test_port_0_prints_the_url_before_the_model_loads(monkeypatch, command, what, path):
    """Found by a newcomer: `explore --port 0` printed its URL only once the model had loaded. The
    load fails here: the URL with the real port was printed before it, and the port is freed."""
    from heads.errors import HeadsteerValueError
    from viz.cli.common import Run

    def load(*a, **k):
        raise HeadsteerValueError("the load failed on purpose")

    monkeypatch.setattr(Run, "load", load)
    res = CliRunner().invoke(cli, [command, "--port", "0"])
    assert res.exit_code == 2 and "the load failed on purpose" in res.stderr, res.output
    first = res.stderr.splitlines()[0]
    prefix = f"{what} listening on http://127.0.0.1:"
    assert first.startswith(prefix), res.stderr
    port = int(first.removeprefix(prefix).split("/")[0].split(";")[0])
    assert port > 0 and first.split(";")[0].endswith(f":{port}{path}")
    with socket.socket() as s:  # closed after the failed load
        s.bind(("127.0.0.1", port))
