"""`headsteer serve` under requests that try to break it: tiny sampling values, batch-mates of a
failing request, clients that disconnect, huge bodies, values that overflow, one log line per
request; per-row SpotLight on long prompts and per-row PASTA bias that broadcasts.

One server process (tiny random model) is shared by the module; every request loop is bounded
and has a timeout."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import torch  # noqa: E402

from heads import ProbEdit  # noqa: E402
from steer import Pasta, Spotlight, SteeredModel  # noqa: E402
from steer.serving import (  # noqa: E402
    Batcher,
    BatchGenerator,
    RequestCancelled,
    SamplingParams,
    ServeRequest,
    _RowBias,
    parse_steer,
)
from tests.support.serve import serve_subprocess  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

MAX_TOKENS_LONG = 440


@pytest.fixture(scope="module")
def srv(tiny_llama_dir, tmp_path_factory):
    """`headsteer serve` on the tiny model: 1 MiB bodies, 200 prompt tokens, 300 ms batch wait."""
    logf = tmp_path_factory.mktemp("serve") / "stderr.log"
    args = ["--batch-wait-ms", "300", "--max-body-mb", "1", "--max-prompt-tokens", "200"]
    with serve_subprocess(tiny_llama_dir, args, logf) as base:
        yield base, logf


def _post(base: str, body, path: str = "/v1/chat/completions", timeout: float = 60) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        text = e.read()
        return e.code, (json.loads(text) if text else {})


def _chat(content: str = "hello there", **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def _message(reply: dict) -> str:
    return reply["error"]["message"]


# ------------------------------------------------------------------ 2: sampling over the whole range
@pytest.mark.parametrize(
    "params", [{"temperature": 1e-45}, {"temperature": 1e-40}, {"temperature": 1, "top_p": 1e-300}]
)
def test_tiny_temperature_and_top_p_answer_greedy(srv, params):
    base, _ = srv
    status, greedy = _post(base, _chat(temperature=0))
    assert status == 200
    status, reply = _post(base, _chat(seed=3, **params))
    assert status == 200, reply
    # a tiny temperature is greedy; a tiny top_p keeps only the top token: greedy too
    assert reply["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]


def test_pick_is_safe_in_process():
    """`_pick` over extreme logits and parameters: always a valid token, the top one when it must be."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.0, 3.0, -float("inf"), 2.999, float("nan")])
    for t, p in [(1e-45, 1.0), (5e-324, 1.0), (2.0, 1e-300), (1.0, 1e-300), (1e-45, 1e-300)]:
        assert BatchGenerator._pick(logits, SamplingParams(temperature=t, top_p=p), gen) == 1
    for _ in range(20):  # top_p 1 at temperature 2 samples among the finite tokens only
        assert BatchGenerator._pick(logits, SamplingParams(temperature=2.0), gen) in (0, 1, 3)


# ------------------------------------------------------------------ 1: batch-mates
def test_tiny_temperature_does_not_fail_its_batch_mates(srv):
    base, _ = srv
    alone = _post(base, _chat("the sky is", temperature=0))[1]["choices"][0]["message"]["content"]
    with ThreadPoolExecutor(2) as ex:  # both land in one batch (300 ms wait)
        a = ex.submit(_post, base, _chat("the sky is", temperature=0))
        b = ex.submit(_post, base, _chat("other words", temperature=1e-45))
        (sa, ra), (sb, rb) = a.result(60), b.result(60)
    assert (sa, sb) == (200, 200), (ra, rb)
    assert ra["choices"][0]["message"]["content"] == alone


class _FailsAtRun(ProbEdit):
    """Passes validation, fails in the forward pass (a request that breaks a batch)."""

    def apply(self, probs, call):
        raise ValueError("boom at run time")


class _FailingIntervention:
    def edits(self, model, enc):
        return [_FailsAtRun(layer=1)]


def _submit_all(batcher: Batcher, items: list, on_delta=None) -> list:
    done: dict[int, object] = {}
    event = threading.Event()

    def finish(i):
        def cb(result):
            done[i] = result
            if len(done) == len(items):
                event.set()

        return cb

    jobs = [batcher.submit(p, on_delta(i) if on_delta else None, finish(i)) for i, p in enumerate(items)]
    assert event.wait(120)
    return [done[i] for i in range(len(items))], jobs


def test_failing_request_fails_alone_even_when_others_stream(tiny_llama, monkeypatch):
    """A batch whose forward fails is rerun without the offender: streamed batch-mates resume
    after what they already sent (no text twice), and a row whose sampling fails ends alone."""
    gen = BatchGenerator(tiny_llama)
    ok = [
        gen.prepare(
            ServeRequest("hello there", False, [], params=SamplingParams(max_tokens=5, temperature=0))
        )
        for _ in range(2)
    ]
    ok.append(
        gen.prepare(ServeRequest("a b c", False, [], params=SamplingParams(max_tokens=4)))
    )  # random seed
    bad = gen.prepare(ServeRequest("x y", False, [], params=SamplingParams(max_tokens=3, temperature=0)))
    bad.steer = [_FailingIntervention()]
    alone = [gen.run([p])[0].text for p in ok]
    batcher = Batcher(gen, max_batch=8, wait_s=0.3)
    pieces: dict[int, list[str]] = {0: [], 1: [], 2: [], 3: []}
    results, _ = _submit_all(batcher, [*ok, bad], on_delta=lambda i: pieces[i].append)
    assert [r.text for r in results[:3]] == alone
    assert "".join(pieces[0]) == alone[0] and "".join(pieces[2]) == alone[2]  # streamed once, whole
    assert isinstance(results[3], ValueError) and "boom" in str(results[3])
    # a row whose sampling fails (not the forward): that row alone gets the error, no rerun
    real = BatchGenerator._pick

    def pick(logits, params, g):
        if params.temperature == 0.5:
            raise RuntimeError("sampling broke")
        return real(logits, params, g)

    monkeypatch.setattr(BatchGenerator, "_pick", staticmethod(pick))
    odd = gen.prepare(ServeRequest("x y", False, [], params=SamplingParams(max_tokens=3, temperature=0.5)))
    n = len(batcher.batches)
    results, _ = _submit_all(batcher, [ok[0], odd])
    assert results[0].text == alone[0] and isinstance(results[1], RuntimeError)
    assert batcher.batches[n:] == [2]
    batcher.close(30)


def test_cancelled_job_stops_its_row_only(tiny_llama):
    gen = BatchGenerator(tiny_llama)
    long = gen.prepare(
        ServeRequest("hello", False, [], params=SamplingParams(max_tokens=MAX_TOKENS_LONG, temperature=0))
    )
    short = gen.prepare(ServeRequest("a b", False, [], params=SamplingParams(max_tokens=3, temperature=0)))
    alone = gen.run([short])[0].token_ids
    seen = {"n": 0}

    def cancelled(row: int) -> bool:
        seen["n"] += 1
        return row == 0 and seen["n"] > 10

    out = gen.run([long, short], cancelled=cancelled)
    assert isinstance(out[0], RequestCancelled) and 0 < out[0].completion_tokens < 10
    assert out[1].token_ids == alone


# ------------------------------------------------------------------ 3: disconnected clients
def _open_and_drop(base: str, body: dict, first_bytes: bool, after_s: float = 0.2) -> None:
    """Send `body` and close the connection: once the first bytes of the answer arrived
    (`first_bytes`: a stream, which answers at once), else after `after_s` (a whole answer sends
    nothing before it is done; the assertions accept both outcomes of that race)."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        if first_bytes:
            assert s.recv(1), "the stream sent nothing"
        else:
            time.sleep(after_s)


def _log_lines(logf: Path, needle: str) -> list[str]:
    return [ln for ln in logf.read_text().splitlines() if needle in ln]


@pytest.mark.parametrize("stream", [False, True])
def test_disconnected_clients_are_cancelled(srv, stream):
    """Each dropped request is logged once, never as a whole answer: a stream (dropped after its
    first bytes) as cancelled; a whole answer as cancelled, or as 499 if it was dropped before
    its body was read. None runs to max_tokens, and the next request is answered."""
    base, logf = srv
    body = _chat("tell me a long story", max_tokens=MAX_TOKENS_LONG, temperature=0, stream=stream)
    needle = '"POST /v1/chat/completions"'
    before = len(_log_lines(logf, needle))
    threads = [threading.Thread(target=_open_and_drop, args=(base, body, stream)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    status, _ = _post(base, _chat(max_tokens=1), timeout=120)
    assert status == 200
    wait_until(lambda: len(_log_lines(logf, needle)) >= before + 4, "a log line per request")
    lines = [ln for ln in _log_lines(logf, needle)[before:] if "completion_tokens=1 finish=length" not in ln]
    assert len(lines) == 3, logf.read_text()[-3000:]
    for ln in lines:
        assert "finish=cancelled" in ln or (not stream and " 499 " in ln and "finish=" not in ln), ln
        if "completion_tokens=" in ln:  # how far its row got: far from max_tokens
            assert int(ln.split("completion_tokens=")[1].split()[0]) < MAX_TOKENS_LONG, ln


def _read_response(sock: socket.socket) -> bytes:
    """Headers and the announced body of one HTTP response (they may come in separate packets)."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(4096)
        if not part:
            return data
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(ln.split(b":", 1)[1])
            for ln in head.split(b"\r\n")
            if ln.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        part = sock.recv(4096)
        if not part:
            break
        body += part
    return head + b"\r\n\r\n" + body


# ------------------------------------------------------------------ 4: body size and bounds
def test_body_over_the_limit_gets_413_before_it_is_read(srv):
    base, _ = srv
    host, port = base.removeprefix("http://").split(":")
    # a declared 300 MB body: refused from its Content-Length, before a byte of it is sent
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {300 * 2**20}\r\n\r\n".encode()
        )
        head = _read_response(s)
    assert head.startswith(b"HTTP/1.1 413") and b"--max-body-mb" in head, head
    # chunked (no Content-Length): refused once the limit is passed
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        piece = b"x" * 65536
        head = f"{len(piece):x}\r\n".encode()
        try:
            for _ in range(40):  # 2.5 MiB at most, then give up
                s.sendall(head + piece + b"\r\n")
        except OSError:
            pass  # the server answered and closed
        s.settimeout(20)
        answer = s.recv(200)
    assert answer.startswith(b"HTTP/1.1 413")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"messages": [{"role": "user", "content": "hi"}] * 300}, "messages has 300 items"),
        (_chat(stop=["a", "b", "c", "d", "e"]), "stop has 5 strings"),
        (_chat(stop="x" * 300), "stop must be up to 4"),
        (_chat(emphasize=["a"] * 20), "emphasize has 20"),
        (_chat("word " * 400), "--max-prompt-tokens"),
        (_chat(steer=[{"method": ["pasta"]}]), "steer[0].method"),
        (_chat(steer=[{"method": {"a": 1}}]), "steer[0].method"),
        (_chat(seed=2**70), "seed must be an integer in [0, 2**63 - 1]"),
        (_chat(seed=-1), "seed must be"),
        (_chat(temperature=10**400), "temperature must be a finite number"),
        (_chat(steer=[{"method": "pasta", "heads": {"1" * 5000: [0]}}]), "5000 digits"),
        (_chat(steer=[{"method": "pasta", "heads": {"1": [0]}, "alpha": 10**400}]), "alpha"),
        (_chat("bad \ud800 text"), "lone surrogate"),
        (_chat("the **key**", steer=[{"method": "spotlight", "layers": [10**30]}]), "layer"),
        # OpenAI fields the server does not implement: refused by name, never silently ignored
        (_chat(logit_bias={"1": 100}), "logit_bias is not supported"),
        (_chat(presence_penalty=2), "presence_penalty is not supported"),
        (_chat(frequency_penalty="x"), "frequency_penalty is not supported"),
        (_chat(response_format={"type": "json_object"}), "response_format is not supported"),
        (_chat(top_logprobs=5), "top_logprobs is not supported"),
        (_chat(top_k=40), "top_k is not supported"),
        (_chat(user=[1]), "user must be a str"),
        (_chat(stream_options="x"), "stream_options must be an object"),
        # compared with their type: true is not 1, 0 is not false
        (_chat(n=True), "n must be 1"),
        (_chat(n=1.0), "n must be 1"),
        (_chat(best_of=True), "best_of is not supported"),
        (_chat(echo=0), "echo is not supported"),
        (_chat(logprobs=0), "logprobs is not supported"),
        (_chat(max_tokens=2**70), "max_tokens=1180591620717411303424 with the prompt's"),
        (_chat(max_tokens=int("9" * 4000)), "max_tokens=an int of 4000 digits"),
        # stacked entries whose factors multiply past float32's bound on one head
        (
            _chat(steer=[{"method": "ablate", "heads": {"1": [0]}, "mode": "sc", "eps": 10000}] * 8),
            "multiply to",
        ),
    ],
)
def test_bad_values_get_400_naming_the_field(srv, body, needle):
    base, _ = srv
    data = json.dumps(body).encode()  # json escapes a lone surrogate as \ud800
    status, reply = _post(base, data)
    assert status == 400, reply
    message = _message(reply)
    assert needle in message and "\n" not in message and len(message) < 400, message


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b'{"messages": [], "seed": ' + b"7" * 5000 + b"}", "too large: an integer of 5000 digits"),
        (b'{"seed": -' + b"1" * 4301 + b"}", "too large: an integer of 4301 digits"),
        (b"{not json", "not valid JSON: Expecting property name"),
        (b"[" * 100_000, "nested too deeply"),
        (b'{"prompt": "\xff"}', "not valid UTF-8"),
    ],
)
def test_unparsable_body_gets_400_naming_the_problem(srv, data, needle):
    """A 5000-digit integer is beyond Python's `int(str)` limit: the 400 says the number is too
    large (not "not valid JSON"); other unparsable bodies say where."""
    status, reply = _post(srv[0], data)
    message = _message(reply)
    assert status == 400 and needle in message and "\n" not in message and len(message) < 400, message


def test_client_gone_while_sending_its_body_is_one_log_line(srv):
    """A client that closes before its announced body arrived: one 499 access line, no
    traceback in the server's log, and the next request is answered."""
    base, logf = srv
    host, port = base.removeprefix("http://").split(":")
    before = logf.read_text().count("Traceback")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"a":'
        )
    wait_until(
        lambda: any(" 499 " in ln for ln in _log_lines(logf, '"POST /v1/chat/completions"')[-3:]),
        "the server logs the gone client's 499 line",
    )
    assert _post(base, _chat(max_tokens=1, temperature=0))[0] == 200
    assert logf.read_text().count("Traceback") == before, logf.read_text()[-3000:]


# ------------------------------------------------------------------ 5: one log line per request
def test_one_log_line_per_request(srv):
    base, logf = srv
    tag = "/v1/completions"
    before = len(_log_lines(logf, f'"POST {tag}"'))
    assert _post(base, {"prompt": "one two", "max_tokens": 2, "temperature": 0}, tag)[0] == 200
    assert _post(base, {"prompt": 3}, tag)[0] == 400
    wait_until(lambda: len(_log_lines(logf, f'"POST {tag}"')) >= before + 2, "two log lines")
    lines = _log_lines(logf, f'"POST {tag}"')[before:]
    assert len(lines) == 2, lines
    assert " 200 " in lines[0] and "prompt_tokens=" in lines[0] and "completion_tokens=2" in lines[0]
    assert lines[0].endswith("ms") and " 400 " in lines[1]


# ------------------------------------------------------------------ 6: SpotLight on long prompts
def test_spotlight_on_a_prompt_over_the_query_block_runs_as_in_python(tiny_llama, monkeypatch):
    """Layer-granularity SpotLight on a prompt longer than the query block: the server's per-row
    edits run on the fused kernel as `SteeredModel` does, with the same tokens."""
    from heads.engine import state

    monkeypatch.setattr(state, "QUERY_BLOCK", 16)
    prompt = "Some filler words here and there. " * 3 + "The key is **blue**. What is the key?"
    spot = Spotlight(tau=0.5)
    want = SteeredModel(tiny_llama).generate(prompt, spot, max_new_tokens=4, chat=False, progress=False)
    gen = BatchGenerator(tiny_llama)
    reqs = [
        ServeRequest(prompt, False, [spot], params=SamplingParams(max_tokens=4, temperature=0)),
        ServeRequest("short one", False, [], params=SamplingParams(max_tokens=2, temperature=0)),
    ]
    prepared = [gen.prepare(r) for r in reqs]
    assert prepared[0].enc.length > 16
    out = gen.run(prepared)
    assert out[0].token_ids[: len(want.token_ids[0])] == list(want.token_ids[0])
    assert out[1].token_ids == gen.run([prepared[1]])[0].token_ids


# ------------------------------------------------------------------ 7: per-row PASTA bias broadcasts
def test_row_pasta_bias_broadcasts(tiny_llama, monkeypatch):
    gen = BatchGenerator(tiny_llama)
    steer = parse_steer([{"method": "pasta", "heads": {"1": [0, 2]}, "alpha": 0.01}])
    other = parse_steer([{"method": "pasta", "heads": {"1": [3]}, "alpha": 0.1}])
    reqs = [
        ServeRequest(
            "the key is **blue** ok", False, steer, params=SamplingParams(max_tokens=3, temperature=0)
        ),
        ServeRequest("hello", False, [], params=SamplingParams(max_tokens=3, temperature=0)),
        ServeRequest("a **red** one", False, other, params=SamplingParams(max_tokens=3, temperature=0)),
    ]
    prepared = [gen.prepare(r) for r in reqs]
    shapes = []
    real = _RowBias.bias

    def bias(self, call):
        out = real(self, call)
        shapes.append((tuple(out.shape), call.batch, call.k_len))
        return out

    monkeypatch.setattr(_RowBias, "bias", bias)
    out = gen.run(prepared)
    assert shapes and all(s == (b, 1, 1, k) for s, b, k in shapes)  # [B, 1, 1, K], never [B, H, Q, K]
    for p, o in zip(prepared, out, strict=True):  # and the answers are those of each request alone
        assert o.token_ids == gen.run([p])[0].token_ids
    mask = gen._edits(prepared, max(p.enc.length for p in prepared))[0].head_mask(3, 4, torch.device("cpu"))
    assert mask.tolist() == [[True, False, True, False], [False] * 4, [False, False, False, True]]
    assert isinstance(Pasta(heads={"1": [0]}), Pasta)


def test_row_pasta_kernel_masks_are_not_per_head(tiny_llama, monkeypatch):
    """A batch whose rows steer different heads hands SDPA no `[B, H, Q, K]` mask for its
    prompts: every prompt mask the kernel sees is `[B|1, 1, Q, K]` (the model's own, or the
    model's plus a row's bias). A decode step (one query row) may pass `[B, H, 1, K]`, which is
    smaller than the layer's KV cache."""
    import torch.nn.functional as F  # noqa: N812

    gen = BatchGenerator(tiny_llama)
    one = parse_steer([{"method": "pasta", "heads": {"0": [0, 2], "1": [1]}, "alpha": 0.01}])
    two = parse_steer([{"method": "pasta", "heads": {"1": [1, 3]}, "alpha": 0.2}])
    params = SamplingParams(max_tokens=2, temperature=0)
    reqs = [
        ServeRequest("the key is **blue** ok then", False, one, params=params),
        ServeRequest("a **red** one", False, two, params=params),
        ServeRequest("plain words here", False, [], params=params),
    ]
    prepared = [gen.prepare(r) for r in reqs]
    alone = [gen.run([p])[0].token_ids for p in prepared]
    seen = []
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, **kw):
        if attn_mask is not None:
            seen.append(tuple(attn_mask.shape))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    out = gen.run(prepared)
    prompt = [s for s in seen if s[2] > 1]
    assert prompt and all(s[0] in (1, 3) and s[1] == 1 for s in prompt), sorted(set(prompt))
    assert all(s[1] == 1 or s[2] == 1 for s in seen), sorted(set(seen))  # per head: decode only
    assert [o.token_ids for o in out] == alone  # each answer is that of its request alone
