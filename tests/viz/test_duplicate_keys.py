"""A JSON request body that gives a key twice is refused with HTTP 400 naming the key, on every
POST route of the explorer and the server (one place: the shared body parser,
`heads._util.validation.load_json_body`): "the last one wins" would silently run another
request than the one the user wrote (`{"layer": 0, ..., "layer": 1}` drew layer 1)."""

import pytest
from fastapi.testclient import TestClient

from tests.support import make_tiny
from viz.explorer import create_explorer
from viz.server.app import create_app

EXPLORER_BODIES = {
    "/api/pattern": '{"prompt": "a", "layer": 0, "head": 0, "layer": 1}',
    "/api/head": '{"prompt": "a", "layer": 0, "head": 0, "head": 1}',
    "/api/prepare": '{"prompt": "a", "prompt": "b"}',
    "/api/scores": '{"detector": "x", "detector": "y"}',
    "/api/generate": '{"prompt": "a", "prompt": "b"}',
    "/api/cancel": '{"job": "a", "job": "b"}',
    "/api/patch": '{"clean": "a", "corrupted": "b", "answer": " c", "answer": " d"}',
    "/api/qk": '{"prompt": "a", "layer": 0, "head": 0, "layer": 1}',
}
"""Every POST route of the explorer -> a body with one key given twice (the key is the repeated one)."""

SERVER_BODIES = {
    "/v1/chat/completions": '{"messages": [{"role": "user", "content": "hi", "role": "user"}]}',
    "/v1/completions": '{"prompt": "a", "max_tokens": 1, "max_tokens": 2}',
}


def _repeated(body: str) -> str:
    import re

    keys = re.findall(r'"(\w+)":', body)
    return next(k for i, k in enumerate(keys) if k in keys[:i])


def test_every_explorer_post_route_is_covered():
    from viz.explorer.routes import ROUTERS

    posts = {r.path for router in ROUTERS for r in router.routes if "POST" in getattr(r, "methods", ())}
    assert posts == set(EXPLORER_BODIES)


@pytest.fixture(scope="module")
def explorer(tokenizer):
    return TestClient(create_explorer(make_tiny("llama", tokenizer)))


@pytest.mark.parametrize("route", sorted(EXPLORER_BODIES))
def test_explorer_refuses_a_duplicate_key(explorer, route):
    body = EXPLORER_BODIES[route]
    r = explorer.post(route, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, (route, r.status_code, r.text[:300])
    assert f"duplicate key '{_repeated(body)}'" in r.text


@pytest.mark.parametrize("route", sorted(SERVER_BODIES))
def test_server_refuses_a_duplicate_key(tiny_llama, route):
    body = SERVER_BODIES[route]
    with TestClient(create_app(tiny_llama)) as client:
        r = client.post(route, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, (route, r.status_code, r.text[:300])
    assert f"duplicate key '{_repeated(body)}'" in r.text
