"""The explorer's long-prompt pattern view: the overview and the exact windows (`viz.explorer.overview`).

The oracle is the full pattern of a plain forward (`output_attentions=True`, every `[H, T, T]`),
pooled and sliced here with loops and slices independent of the product's block reducer.
"""

import pytest
import torch
from fastapi.testclient import TestClient

from heads.engine.forward import forward
from heads.inputs.prompts import encode_prompts
from viz.explorer import create_explorer
from viz.explorer.limits import MAX_WINDOW
from viz.explorer.overview import record_overview

FULL = 128  # the tests' full-pattern limit: a 301-token prompt gets the overview


@pytest.fixture(scope="module")
def prompt(tokenizer):
    """A plain-text prompt of exactly 301 tokens (blocks of 2: the last block has one token)."""
    ids = tokenizer("The quick brown fox jumps over the lazy dog by the bank. " * 40)["input_ids"]
    text = tokenizer.decode(ids[:301])
    assert encode_prompts(tokenizer, text, chat=False).length == 301
    return text


@pytest.fixture(scope="module")
def full(model, prompt):
    """`[L, H, T, T]` fp32: every layer's pattern from a plain forward."""
    enc = encode_prompts(model.tokenizer, prompt, chat=False)
    return torch.stack([a[0] for a in forward(model, enc, output_attentions=True).attentions]).float()


@pytest.fixture(scope="module")
def client(model):
    return TestClient(create_explorer(model, full_pattern_tokens=FULL))


def pooled(p: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block mean / block max of one `[T, T]` pattern (probabilities, >= 0): `A p A^T` with the
    block indicator `A` `[G, T]` over the cell counts, and per block row the max of its rows
    masked by `A`."""
    t = p.shape[0]
    a = (torch.arange(t)[None, :] // b == torch.arange(-(-t // b))[:, None]).float()  # [G, T]
    n = a.sum(1)
    mean = a @ p @ a.T / (n[:, None] * n[None, :])
    top = torch.stack([(p[i * b : (i + 1) * b].amax(0)[None, :] * a).amax(1) for i in range(a.shape[0])])
    return mean, top


def test_overview_equals_the_full_pattern_pooled(model, prompt, full):
    enc = encode_prompts(model.tokenizer, prompt, chat=False)
    ov = record_overview(model, enc, grid=64)  # blocks of 5: 61 of them, the last has one token
    assert ov.block == 5 and ov.grid_mean.shape == (model.n_layers, model.n_heads, 61, 61)
    for layer, head in ((0, 0), (1, 3), (2, 1)):
        p = full[layer, head]
        mean, top = pooled(p, 5)
        torch.testing.assert_close(ov.grid_mean[layer, head], mean, atol=1e-6, rtol=0)
        torch.testing.assert_close(ov.grid_max[layer, head], top, atol=1e-6, rtol=0)
    torch.testing.assert_close(ov.col_mass, full.sum(-2), atol=1e-5, rtol=0)  # sums of 301 rows
    torch.testing.assert_close(ov.row_max, full.amax(-1), atol=1e-6, rtol=0)
    logs = torch.where(full > 0, full.log(), 0.0)
    torch.testing.assert_close(ov.row_entropy, -(full * logs).sum(-1), atol=1e-5, rtol=0)
    # a grid that does not divide T: blocks of 7 (43 of them, the last has 301 - 42 * 7 = 7)
    ov7 = record_overview(model, enc, grid=44)
    assert ov7.block == 7
    torch.testing.assert_close(ov7.grid_mean[2, 2], pooled(full[2, 2], 7)[0], atol=1e-6, rtol=0)


def test_the_api_sends_the_overview_of_a_long_prompt(client, model, prompt, full):
    r = client.post(
        "/api/pattern", json={"prompt": prompt, "raw": True, "layer": 1, "head": 2, "tab": "t-overview"}
    )
    assert r.status_code == 200, r.text
    d = r.json()
    assert "probs" not in d and len(d["tokens"]) == 301  # never the [T, T] pattern
    o = d["overview"]
    assert o["pool"] == "max" and o["block"] == 2
    mean, top = pooled(full[1, 2], 2)
    torch.testing.assert_close(torch.tensor(o["grid"]), top, atol=1e-9, rtol=5e-4)  # 4 significant digits
    torch.testing.assert_close(torch.tensor(o["col_mass"]), full[1, 2].sum(0), atol=1e-9, rtol=5e-4)
    torch.testing.assert_close(torch.tensor(o["row_max"]), full[1, 2].amax(-1), atol=1e-9, rtol=5e-4)
    again = client.post(
        "/api/pattern",
        json={"prompt": prompt, "raw": True, "layer": 1, "head": 2, "tab": "t-overview", "pool": "mean"},
    ).json()
    assert again["cached"] is True and again["overview"]["pool"] == "mean"
    torch.testing.assert_close(torch.tensor(again["overview"]["grid"]), mean, atol=1e-9, rtol=5e-4)
    # a short prompt keeps today's full pattern
    short = client.post(
        "/api/pattern", json={"prompt": "one two three", "raw": True, "layer": 0, "head": 0}
    ).json()
    assert "overview" not in short and len(short["probs"]) == len(short["tokens"])


@pytest.mark.parametrize("prepared", [False, True])
def test_a_window_equals_the_full_patterns_slice(client, prompt, full, prepared):
    tab = f"t-window-{prepared}"
    if prepared:  # the overview keeps the residuals: windows start at their layer
        assert client.post("/api/prepare", json={"prompt": prompt, "raw": True, "tab": tab}).json()[
            "overview"
        ]
    for layer, head, (q0, q1, k0, k1) in (
        (0, 1, (0, 3, 0, 3)),
        (1, 0, (45, 301, 44, 300)),
        (2, 3, (300, 301, 0, 256)),
    ):
        body = {"prompt": prompt, "raw": True, "layer": layer, "head": head, "tab": tab}
        r = client.post("/api/pattern", json={**body, "q0": q0, "q1": q1, "k0": k0, "k1": k1})
        assert r.status_code == 200, r.text
        d = r.json()
        assert d["window"] == [q0, q1, k0, k1] and d["cached"] is prepared
        want = full[layer, head, q0:q1, k0:k1]
        torch.testing.assert_close(torch.tensor(d["probs"]), want, atol=5e-5 + 1e-7, rtol=0)  # 4 decimals
    enc = encode_prompts(client.app.state.explorer.model.tokenizer, prompt, chat=False)
    from viz.explorer.overview import pattern_window

    ov = client.app.state.explorer.overviews.get(tab, prompt, chat=False)
    exact = pattern_window(client.app.state.explorer.model, enc, 2, 1, (10, 200, 5, 150), ov)
    torch.testing.assert_close(exact, full[2, 1, 10:200, 5:150], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("window", "named"),
    [
        ({"q0": 0, "q1": 302, "k0": 0, "k1": 3}, "q1=302"),
        ({"q0": 0, "q1": 3, "k0": 0, "k1": 400}, "k1=400"),
        ({"q0": 5, "q1": 5, "k0": 0, "k1": 3}, "q0=5"),
        ({"q0": 0, "q1": MAX_WINDOW + 1, "k0": 0, "k1": 3}, f"q1-q0={MAX_WINDOW + 1}"),
        ({"q0": 0, "q1": 3, "k0": 10, "k1": 11 + MAX_WINDOW}, f"k1-k0={MAX_WINDOW + 1}"),
        ({"q0": -1, "q1": 3, "k0": 0, "k1": 3}, "q0"),
        ({"q0": 0, "q1": 3, "k0": 0}, "missing k1"),
        ({"q0": 0, "q1": 3, "k0": 0, "k1": "4"}, "k1"),
    ],
)
def test_a_bad_window_is_400_naming_it(client, prompt, window, named):
    body = {"prompt": prompt, "raw": True, "layer": 0, "head": 0, **window}
    r = client.post("/api/pattern", json=body)
    assert r.status_code == 400 and named in r.json()["error"], r.text


def test_a_prompt_longer_than_the_context_is_400_naming_both(client, model, tokenizer):
    ids = tokenizer("word " * 700)["input_ids"][:600]
    text = tokenizer.decode(ids)
    n = encode_prompts(tokenizer, text, chat=False).length
    assert n > model.max_positions
    for path in ("/api/prepare", "/api/pattern"):
        r = client.post(
            path,
            json={"prompt": text, "raw": True, "layer": 0, "head": 0}
            if path.endswith("n")
            else {"prompt": text, "raw": True},
        )
        assert r.status_code == 400, r.text
        assert f"{n} tokens" in r.json()["error"] and f"limit of {model.max_positions}" in r.json()["error"]


@pytest.mark.parametrize(("kind", "overrides"), [("mistral", {"sliding_window": 64}), ("gpt2", {})])
def test_overview_and_window_on_a_sliding_window_and_an_absolute_position_family(
    tokenizer, prompt, kind, overrides
):
    """A window shorter than the prompt (Mistral) and learned absolute positions (GPT-2): the
    overview and a window started from a kept residual equal the plain forward's pattern."""
    from tests.support import make_tiny
    from viz.explorer.overview import pattern_window

    hm = make_tiny(kind, tokenizer, **overrides)
    enc = encode_prompts(tokenizer, prompt, chat=False)
    full = torch.stack([a[0] for a in forward(hm, enc, output_attentions=True).attentions]).float()
    if kind == "mistral":
        assert full[1, 0, 300, :200].abs().max() == 0  # the window really cuts the prompt
    ov = record_overview(hm, enc, grid=64)
    assert 1 in ov.residuals
    layer = hm.n_layers - 1
    torch.testing.assert_close(ov.grid_max[layer, 1], pooled(full[layer, 1], 5)[1], atol=1e-6, rtol=0)
    got = pattern_window(hm, enc, layer, 1, (100, 301, 30, 286), ov)
    torch.testing.assert_close(got, full[layer, 1, 100:301, 30:286], atol=1e-6, rtol=0)


def test_a_window_from_a_lower_kept_layer_and_past_its_rows(model, prompt, full, monkeypatch):
    """Residuals of every other layer only (a small budget): a window of layer 2 runs layers 1 and
    2 on its rows alone, the earlier positions' keys as a cache; keys after its last row too."""
    from viz.explorer import overview

    enc = encode_prompts(model.tokenizer, prompt, chat=False)
    monkeypatch.setattr(overview, "OVERVIEW_RESIDUAL_BYTES", 301 * model.d_model * 4)  # one layer's
    ov = record_overview(model, enc, grid=64)
    assert list(ov.residuals) == [1] and ov.start_layer(2) == 1 and ov.kv is not None
    for window in ((120, 301, 0, 256), (10, 20, 5, 200)):
        q0, q1, k0, k1 = window
        got = overview.pattern_window(model, enc, 2, 3, window, ov)
        torch.testing.assert_close(got, full[2, 3, q0:q1, k0:k1], atol=1e-6, rtol=0)
