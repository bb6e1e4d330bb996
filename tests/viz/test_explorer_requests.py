"""Bad requests to the explorer: one-line HTTP 400 (413, 415, 403) naming the problem, before any job,
and the server goes on."""

import json

import pytest
from fastapi.testclient import TestClient

from tests.support.explorer import PROMPT, scored
from viz.explorer import MAX_BODY_BYTES, MAX_NEW_TOKENS, create_explorer
from viz.explorer.app import MAX_ANSWER_CHARS, MAX_PROMPT_CHARS


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


def test_a_white_space_answer_is_a_token(client):
    """`"\\n"` or `" "` is a one-token answer, not an empty one (found by a breaker)."""
    r = client.post("/api/patch", json={"clean": "The cat sat", "corrupted": "The dog sat", "answer": "\n"})
    assert r.status_code == 200, r.text
    assert scored(client, {"clean": "The cat sat", "corrupted": "The dog sat", "answer": " "}, "/api/patch")[
        -1
    ].get("result")
