"""The explorer's job machinery under clients that leave and a server that stops: what it
guarantees (job slots, cancellation, nothing run for a gone client), never how long it takes.

Every wait here is on an observable state (`Jobs.running()`, a response's last event), bounded
only so that a broken build fails instead of hanging."""

import json
import os
import signal
import socket
import threading

import pytest
import requests
from fastapi.testclient import TestClient

from tests.support.explorer import PROMPT, cancel_on_start, gated_streamer, scored
from tests.support.waiting import wait_until
from viz.explorer import create_explorer

LIMIT_S = 60  # a request's timeout: every wait below ends on a state (`wait_until`)


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """Send one JSON POST on a new socket and leave it open, unread (a client that may go away)."""
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def counting(monkeypatch, module, name: str) -> list:
    """Count the calls of `module.name` (it still runs)."""
    calls: list = []
    real = getattr(module, name)

    def wrapped(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(module, name, wrapped)
    return calls


def test_abandoned_prepares_and_cards_hold_slots_and_never_run(model, monkeypatch):
    """Found by a breaker: 120 abandoned prepares made a 1-token generation wait for all of
    them. Prepares and head cards are jobs: each holds a slot while it waits for the model, a
    client that leaves cancels it before it runs, its slot is freed, and the model runs nothing
    for it, so the next generation finds the model free."""
    from tests.viz.test_explorer_browser import serve
    from viz.explorer import patterns
    from viz.explorer.state import ExplorerState

    recorded = counting(monkeypatch, patterns, "all_patterns")
    cards = counting(monkeypatch, ExplorerState, "card_parts")
    app = create_explorer(model)
    jobs, lock = app.state.jobs, app.state.explorer.lock
    url, stop = serve(app)
    try:
        with lock:  # the model is busy (another job): every request below waits for it
            socks = [raw_post(url, "/api/prepare", {"prompt": f"{PROMPT} {i}", "tab": f"tab-{i:04d}-x"})
                     for i in range(4)]  # fmt: skip
            socks.append(raw_post(url, "/api/head", {"prompt": PROMPT, "layer": 1, "head": 0}))
            wait_until(lambda: jobs.running() == 5, "each waiting request holds a job slot")
            for s in socks:
                s.close()
            wait_until(lambda: jobs.running() == 0, "the gone clients' jobs end while they wait")
        assert recorded == [] and cards == []  # nothing ran for a client that left
        r = requests.post(url + "api/generate", json={"prompt": PROMPT, "max_new_tokens": 1}, timeout=LIMIT_S)
        assert r.status_code == 200 and r.text.rstrip().endswith('data: {"done": true}'), r.text
    finally:
        stop()


def test_a_tabs_new_prepare_cancels_its_previous_one(model, monkeypatch):
    """The page sends a prepare after every pause in typing: a tab's new prepare cancels the one
    still waiting, so only the last prompt is recorded; another tab's prepare is kept."""
    from tests.viz.test_explorer_browser import serve
    from viz.explorer import patterns

    recorded = counting(monkeypatch, patterns, "all_patterns")
    app = create_explorer(model)
    jobs, lock = app.state.jobs, app.state.explorer.lock
    url, stop = serve(app)
    answers: dict[str, dict] = {}

    def prepare(name: str, prompt: str, tab: str) -> threading.Thread:
        def run():
            r = requests.post(url + "api/prepare", json={"prompt": prompt, "tab": tab}, timeout=LIMIT_S)
            answers[name] = r.json()

        t = threading.Thread(target=run)
        t.start()
        return t

    try:
        with lock:
            first = prepare("first", PROMPT + " one", "tab-aaaa-0001")
            wait_until(lambda: jobs.running() == 1, "the first prepare waits")
            other = prepare("other", PROMPT + " two", "tab-bbbb-0002")
            wait_until(lambda: jobs.running() == 2, "another tab's prepare waits beside it")
            second = prepare("second", PROMPT + " three", "tab-aaaa-0001")
            first.join(LIMIT_S)
            assert answers["first"] == {"cancelled": True}  # answered while the model is still busy
            assert jobs.running() == 2
        for t in (second, other):
            t.join(LIMIT_S)
        assert answers["second"]["cached"] is True and answers["other"]["cached"] is True
        assert sorted(a[1] for a in recorded) == [PROMPT + " three", PROMPT + " two"]
        assert jobs.running() == 0
    finally:
        stop()


def test_cached_pattern_needs_no_job_slot(model):
    """A click on a prompt already recorded reads memory only: it answers even when every job
    slot is taken."""
    from fastapi.testclient import TestClient

    app = create_explorer(model)
    client = TestClient(app)
    tab = "tab-cccc-0003"
    assert client.post("/api/prepare", json={"prompt": PROMPT, "tab": tab}).json()["cached"] is True
    for i in range(app.state.jobs.limit):
        app.state.jobs.start(f"busy-job-{i:04d}")
    r = client.post("/api/pattern", json={"prompt": PROMPT, "layer": 0, "head": 0, "tab": tab})
    assert r.status_code == 200 and r.json()["cached"] is True
    r = client.post("/api/prepare", json={"prompt": PROMPT + " new", "tab": tab})
    assert r.status_code == 400 and "jobs are already running" in r.json()["error"]


def test_ctrl_c_cancels_every_job_and_stops_the_server(model, monkeypatch):
    """Found by a breaker: Ctrl-C left `headsteer explore` running until every job had streamed
    to its end. A real SIGINT to `headsteer explore` (in this process) while one generation waits
    for the model and others queue: every stream ends `{"cancelled": true}` as Cancel ends it, a
    waiting prepare answers `{"cancelled": true}`, and the command returns while the model is
    still busy, so no job ran to its end first."""
    from typer.testing import CliRunner

    import viz.cli.explore
    from viz.cli.common import Run
    from viz.cli.main import app as cli

    monkeypatch.setattr(Run, "load", lambda *a, **k: model)
    served: list = []
    real_run = viz.cli.explore.run_uvicorn

    def run_and_capture(app_, sock, **kw):
        served.append((app_, sock.getsockname()[1]))
        real_run(app_, sock, **kw)

    monkeypatch.setattr(viz.cli.explore, "run_uvicorn", run_and_capture)
    got: dict[str, list] = {}
    state: dict = {"released_by_deadline": False, "interrupted": False, "failure": None}

    def interrupt() -> None:
        if not state["interrupted"]:
            state["interrupted"] = True
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C

    def client() -> None:
        try:
            wait_until(lambda: served, "the server is built")
            app_, port = served[0]
            url = f"http://127.0.0.1:{port}/"
            wait_until(lambda: _answers(url), "the server answers")
            lock, jobs = app_.state.explorer.lock, app_.state.jobs
            lock.acquire()  # the model is busy: nothing below can end on its own
            try:

                def stream(name: str, body: dict) -> None:
                    r = requests.post(url + "api/generate", json=body, stream=True, timeout=LIMIT_S)
                    lines = r.iter_lines(decode_unicode=True)
                    got[name] = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]

                def prepare() -> None:
                    r = requests.post(url + "api/prepare", json={"prompt": PROMPT}, timeout=LIMIT_S)
                    got["prepare"] = [r.json()]

                body = {"prompt": PROMPT, "max_new_tokens": 200}
                threads = [threading.Thread(target=stream, args=(f"gen{i}", body)) for i in range(3)]
                threads.append(threading.Thread(target=prepare))
                for t in threads:
                    t.start()
                wait_until(lambda: jobs.running() == 4, "four jobs wait for the model")
                interrupt()
                for t in threads:
                    t.join(LIMIT_S)
                    if t.is_alive():  # broken: let the jobs end, so that the test fails instead of hanging
                        state["released_by_deadline"] = True
                        lock.release()
                        t.join(LIMIT_S)
            finally:
                if not state["released_by_deadline"]:
                    lock.release()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            state["failure"] = exc
        finally:
            interrupt()  # the server must stop whatever happened, or the test would hang

    helper = threading.Thread(target=client)
    helper.start()
    res = CliRunner().invoke(cli, ["explore", "--port", "0"])
    helper.join(LIMIT_S)
    assert state["failure"] is None, state["failure"]
    assert not state["released_by_deadline"], "the server waited for its jobs to end on their own"
    assert res.exit_code == 0 and "server stopped" in res.output, res.output
    for name in ("gen0", "gen1", "gen2"):
        assert got[name][0].keys() == {"job"} and got[name][-1] == {"cancelled": True}, got[name]
        assert not any("text" in e for e in got[name])  # they never ran
    assert got["prepare"] == [{"cancelled": True}]
    assert served[0][0].state.jobs.stopping.is_set()


def _answers(url: str) -> bool:
    try:
        return requests.get(url + "api/info", timeout=5).status_code == 200
    except requests.ConnectionError:
        return False


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
