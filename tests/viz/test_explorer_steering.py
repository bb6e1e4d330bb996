"""The explorer's steered generation: each steering method streams what `SteeredModel.generate`
gives, and its parameters are checked."""

import pytest
import torch

from heads.scorers.attention_mass import span_attention
from tests.support.explorer import PROMPT, scored


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


def test_edit_errors_are_400_before_the_job(client):
    """What an intervention refuses only when its edits are built (an ablation eps beyond the
    dtype, stacked factors) is HTTP 400 before any job starts, not an error event in a stream."""
    r = client.post(
        "/api/generate",
        json={"prompt": PROMPT, "steered": True, "method": "ablate", "heads": [[0, 0]], "eps": 1e30},
    )
    assert r.status_code == 400 and "overflows float32" in r.json()["error"], r.text
    assert scored(client, {"prompt": PROMPT, "max_new_tokens": 1}, "/api/generate")[-1] == {"done": True}
