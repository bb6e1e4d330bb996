"""`headsteer serve`: the OpenAI client against a server started here, per-request steering,
batching that never changes an answer, streaming, stop strings, bad requests, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from heads import ProbEdit, load_model  # noqa: E402
from steer import Ablate, Pasta, SteeredModel  # noqa: E402
from steer.serving import Batcher, BatchGenerator, SamplingParams, ServeRequest, parse_steer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Read this: the key is **blue**. What is the key?"
PASTA = [{"method": "pasta", "heads": {"1": [0, 2], "2": [1]}, "alpha": 0.01}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    """`headsteer serve --model tiny` in a subprocess on a free loopback port."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "viz.cli",
            "serve",
            "--model",
            tiny_llama_dir,
            "--port",
            str(port),
            "--json",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read().decode()[-2000:]}")
        try:
            _get(base + "/v1/models")
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.3)
    yield proc, base
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def test_serve_json_prints_its_url(server):
    proc, base = server
    lines = []  # the listening line, the loading line, then the JSON
    while not (lines and lines[-1].startswith("{")) and len(lines) < 5:
        lines.append(proc.stdout.readline().decode())
    data = json.loads(lines[-1])
    assert lines[0].startswith("server listening on " + base + "/v1"), lines  # at bind time, before the load
    assert data["url"] == base + "/v1" and data["model"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tiny_served(tiny_llama_dir):
    """The same model, loaded here as the oracle."""
    return load_model(tiny_llama_dir)


def _chat(client, model, content, steer=None, **kw):
    extra = {} if steer is None else {"steer": steer}
    extra.update(kw.pop("extra", {}))
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        extra_body=extra,
        **{"temperature": 0, "max_tokens": 6, **kw},
    )


def test_models_lists_the_served_model(client, tiny_llama_dir):
    ids = [m.id for m in client.models.list().data]
    assert ids == [tiny_llama_dir]


def test_steered_chat_equals_steered_model_generate(client, tiny_llama_dir, tiny_served):
    r = _chat(client, tiny_llama_dir, PROMPT, PASTA)
    sm = SteeredModel(tiny_served)
    heads = {"1": [0, 2], "2": [1]}
    steered = sm.generate(PROMPT, steer=[Pasta(heads, alpha=0.01)], max_new_tokens=6)
    plain = sm.generate(PROMPT, max_new_tokens=6)
    assert r.choices[0].message.content == steered.text
    assert steered.text != plain.text  # the steering changed this answer, so it was applied
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == int(sm.encode(PROMPT).attention_mask.sum())
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_concurrent_requests_answer_as_alone(client, tiny_llama_dir):
    """Mixed steering, sent together (batched by the server) and one at a time: same answers."""
    jobs = [
        dict(content=PROMPT, steer=PASTA),
        dict(content="Say something about cats and dogs, please"),
        dict(content=PROMPT, steer=[{"method": "pasta", "heads": [[0, 1]], "alpha": 0.1}]),
        dict(content="Tell me a story about the sea", steer=[{"method": "ablate", "heads": {"0": [0, 3]}}]),
        dict(
            content="the key is blue", steer=[{"method": "spotlight", "tau": 0.3}], extra={"emphasize": "key"}
        ),
        dict(content="Sample a word", temperature=1.0, seed=11, max_tokens=5),
        dict(content=PROMPT, steer=PASTA, max_tokens=3),
    ]

    def run(job):
        job = dict(job)
        r = _chat(client, tiny_llama_dir, job.pop("content"), job.pop("steer", None), **job)
        return r.choices[0].message.content, r.usage.completion_tokens

    alone = [run(j) for j in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, jobs * 2))
    assert together == alone * 2


def test_streaming_matches_non_streaming(client, tiny_llama_dir):
    full = _chat(client, tiny_llama_dir, PROMPT, PASTA, max_tokens=8)
    stream = _chat(
        client,
        tiny_llama_dir,
        PROMPT,
        PASTA,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            finish = c.finish_reason or finish
    assert len(pieces) > 1
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == "length"
    assert usage.completion_tokens == 8 and usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_stop_and_seed(client, tiny_llama_dir):
    kw = dict(model=tiny_llama_dir, prompt="Once upon a time", max_tokens=8, temperature=0)
    free = client.completions.create(**kw).choices[0]
    assert free.finish_reason == "length"
    stop = free.text[len(free.text) // 2 :][:3]
    assert stop.strip()
    cut = client.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.text == free.text[: free.text.find(stop)]
    assert cut.finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kw, stop=[stop], stream=True) if c.choices
    )
    assert streamed == cut.text
    sampled = dict(kw, temperature=1.0, top_p=0.9, seed=7)
    a, b = (client.completions.create(**sampled).choices[0].text for _ in range(2))
    assert a == b


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"steer": [{"method": "nope"}]}, "unknown method"),
        ({"steer": [{"method": "pasta", "heads": {"1": [0]}, "alpha": -1}]}, "alpha"),
        ({"steer": [{"method": "pasta", "heads": {"99": [0]}}]}, "99"),
        ({"steer": [{"method": "pasta", "heads": "/etc/passwd"}]}, "heads"),
        ({"steer": [{"method": "pasta", "heads": {"1": [0]}, "bogus": 1}]}, "bogus"),
        ({"steer": "pasta"}, "steer must be a list"),
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**6}, "exceeds"),
        ({"emphasize": "not in the prompt at all"}, "not in the prompt"),
        ({"model": "other"}, "unknown model"),
        ({"n": 2}, "n must be 1"),
    ],
)
def test_bad_requests_get_400(client, tiny_llama_dir, body, needle):
    content = body.pop("content", "Tell me about the **sea**" if "emphasize" not in body else "plain text")
    model = body.pop("model", tiny_llama_dir)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], extra_body=body, max_tokens=2
        )
    message = info.value.body["message"]
    assert "\n" not in message
    assert needle.lower() in message.lower()


def test_pasta_without_span_and_bad_json_get_400(server, client, tiny_llama_dir):
    with pytest.raises(openai.BadRequestError, match="span"):
        _chat(client, tiny_llama_dir, "no markup here", [{"method": "pasta", "heads": {"1": [0]}}])
    req = urllib.request.Request(
        server[1] + "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 400
    assert _get(server[1] + "/v1/models")["data"]  # still serving


class _Boom(ProbEdit):
    def apply(self, probs, call):
        raise ValueError("boom")


class _Failing:
    """An intervention whose edit fails inside the forward pass."""

    def edits(self, model, enc):
        return [_Boom(layer=1)]


def test_batcher_batches_and_keeps_answers(tiny_llama):
    """In process: concurrent submissions share batches; each answer equals its run alone."""
    gen = BatchGenerator(tiny_llama)
    reqs = [
        ServeRequest(PROMPT, True, parse_steer(PASTA), params=SamplingParams(max_tokens=5, temperature=0)),
        ServeRequest("hello there", False, [], params=SamplingParams(max_tokens=4, temperature=0)),
        ServeRequest(PROMPT, True, [Ablate({"2": [3]})], params=SamplingParams(max_tokens=6, temperature=0)),
        ServeRequest("a b c", True, [], params=SamplingParams(max_tokens=3, temperature=0.7, seed=1)),
        ServeRequest("fails", True, [_Failing()], params=SamplingParams(max_tokens=3, temperature=0)),
    ]
    prepared = [gen.prepare(r) for r in reqs]
    with pytest.raises(ValueError, match="boom"):
        gen.run([prepared[-1]])
    alone = [gen.run([p])[0].token_ids for p in prepared[:-1]] + [None]
    batcher = Batcher(gen, max_batch=8, wait_s=0.5)

    def submit_all(items: list) -> list:
        done: dict[int, list[int] | None] = {}
        event = threading.Event()

        def finish(i):
            def cb(result):
                done[i] = None if isinstance(result, ValueError) else result.token_ids
                if len(done) == len(items):
                    event.set()

            return cb

        for i, p in enumerate(items):
            batcher.submit(p, None, finish(i))
        assert event.wait(120)
        return [done[i] for i in range(len(items))]

    assert submit_all(prepared[:-1]) == alone[:-1]
    assert batcher.batches == [4]  # one batch of four, every answer as alone
    assert [len(x) for x in alone[:-1]] == [5, 4, 6, 3]
    assert submit_all(prepared) == alone  # the failing request fails alone; the others are kept
    assert batcher.batches[1:] == [5] + [1] * 5  # the batch failed, so each request ran alone
    batcher.close(30)
    with pytest.raises(RuntimeError, match="shutting down"):
        batcher.submit(prepared[0], None, lambda r: None)


def test_cli_refuses_non_loopback_host():
    from typer.testing import CliRunner

    from viz.cli.main import app

    res = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0"])
    assert res.exit_code == 2
    assert "loopback" in res.output
    res = CliRunner().invoke(app, ["serve", "--dtype", "float8"])
    assert res.exit_code == 2
    assert "--dtype" in res.output


def test_sigterm_finishes_in_flight_requests(server, client, tiny_llama_dir):
    """Last test of the module: SIGTERM while a request streams; it still completes, exit 0."""
    proc, _ = server
    stream = _chat(
        client,
        tiny_llama_dir,
        PROMPT,
        PASTA,
        max_tokens=300,
        stream=True,
        stream_options={"include_usage": True},
    )
    it = iter(stream)
    first = next(it)
    assert first.choices[0].delta.role == "assistant"
    proc.send_signal(signal.SIGTERM)
    finish = usage = None
    for chunk in it:
        usage = chunk.usage or usage
        for c in chunk.choices:
            finish = c.finish_reason or finish
    assert finish == "length"
    assert usage.completion_tokens == 300
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown
    assert proc.wait(60) in (0, -signal.SIGTERM)
    with pytest.raises(openai.APIConnectionError):
        _chat(client, tiny_llama_dir, PROMPT)
