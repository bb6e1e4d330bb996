"""The explorer's raw-text switch (`raw`): every endpoint that takes a prompt runs it as the
library does with `chat=False` (no chat template), and pair work defaults to plain text."""

import json

import pytest
import torch

PROMPT = "Ignore this. **Remember the word apple** and say something"


def events(text: str) -> list[dict]:
    return [json.loads(ln[6:]) for ln in text.split("\n\n") if ln.startswith("data: ")]


def test_info_says_whether_there_is_a_chat_template(client):
    assert client.get("/api/info").json()["chat_template"] is True


@pytest.mark.parametrize("raw", [False, True])
def test_pattern_span_and_card_follow_the_switch(client, model, raw):
    from heads.inputs.prompts import encode_prompts
    from heads.scorers.attention_mass import head_pattern, span_attention
    from heads.scorers.roles.lens import AttentionLens

    chat = not raw
    d = client.post("/api/pattern", json={"prompt": PROMPT, "layer": 1, "head": 2, "raw": raw}).json()
    probs, tokens, spans = head_pattern(model, PROMPT, 1, 2, chat=chat)
    assert d["tokens"] == tokens and [tuple(s) for s in d["spans"]] == spans
    torch.testing.assert_close(torch.tensor(d["probs"]), probs.float(), atol=3e-4, rtol=0)
    assert ("<|im_start|>" in "".join(tokens)) is chat  # the template's tokens, or none
    ev = events(client.post("/api/scores", json={"prompt": PROMPT, "score": "span", "raw": raw}).text)
    want = span_attention(model, PROMPT, chat=chat).scores.float()
    torch.testing.assert_close(torch.tensor(ev[-1]["result"]["scores"]), want, atol=1e-4, rtol=0)
    card = client.post("/api/head", json={"prompt": PROMPT, "layer": 1, "head": 2, "raw": raw}).json()
    text = encode_prompts(model.tokenizer, PROMPT, chat=chat).texts[0]
    top = AttentionLens.init(model, [(1, 2)]).top_tokens(model, text, 1, 2, k=5)
    assert card["lens_tokens"] == list(top["untrained_tokens"].iloc[-1])


def test_generation_follows_the_switch(client, model):
    from steer import Pasta
    from steer.steered_model import SteeredModel

    sm = SteeredModel(model)
    heads = [[0, 0], [1, 1]]
    body = {
        "prompt": PROMPT,
        "max_new_tokens": 6,
        "raw": True,
        "steered": True,
        "heads": heads,
        "alpha": 0.01,
    }
    got = "".join(e.get("text", "") for e in events(client.post("/api/generate", json=body).text))
    pasta = Pasta(heads={0: [0], 1: [1]}, alpha=0.01)
    want = sm.generate(PROMPT, [pasta], max_new_tokens=6, chat=False, progress=False).texts[0]
    templated = sm.generate(PROMPT, [pasta], max_new_tokens=6, progress=False).texts[0]
    assert got == want and want != templated


def test_pair_work_is_plain_text_unless_asked(client, model):
    from heads.scorers.patching.activation import patch
    from heads.scorers.patching.pairs import PromptPair, encode_pairs

    pair = {"clean": "The cat sat on the mat", "corrupted": "The dog sat on the mat", "answer": " and"}
    for raw in (None, False):
        body = pair if raw is None else {**pair, "raw": raw}
        res = events(client.post("/api/patch", json=body).text)[-1]["result"]
        pairs = encode_pairs(model, [PromptPair(**pair)], chat=raw is False)
        assert res["tokens"] == pairs.position_labels(0)
        want = patch(model, pairs, "head_out", metric="log_prob").mean.float()
        got = torch.tensor([[float("nan") if v is None else v for v in row] for row in res["scores"]])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, equal_nan=True)
    r = client.post("/api/generate", json={"prompt": PROMPT, "raw": "yes"})
    assert r.status_code == 400 and r.json()["error"] == "raw must be true or false, got 'yes'"
