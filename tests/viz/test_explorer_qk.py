"""`POST /api/qk`: a pattern cell's QK attribution from the explorer, against the library."""

import pytest

from heads import encode_prompts, qk_attribution

PROMPT = "Ignore this. **Remember the word apple** and say something"


def test_cell_equals_the_library(client, model):
    enc = encode_prompts(model.tokenizer, PROMPT, chat=False)
    n = int(enc.attention_mask[0].sum())
    body = {"prompt": PROMPT, "raw": True, "layer": 2, "head": 3, "query": n - 1, "key": 2}
    r = client.post("/api/qk", json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    lib = qk_attribution(model, enc, (2, 3), query=n - 1, keys=[2], by="source_token")
    assert d["logit"] == pytest.approx(float(lib.logits[0, 0, 0]), abs=1e-4)
    assert d["attention"] == pytest.approx(float(lib.pattern[0, 0, 0]), abs=1e-4)
    assert [p[:2] for p in d["pairs"]] == [list(p[:2]) for p in lib.top_pairs(12)]
    assert d["max_error"] < 1e-4 and len(d["tokens"]) == n
    t = d["table"]
    assert len(t["z"]) == len(t["query_components"]) and len(t["z"][0]) == len(t["key_components"])
    assert d["sources"]["key"][0][0] == lib.top_sources("key", 1)[0][0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"key": 9, "query": 3}, "not in the pattern"),
        ({"query": 500}, "not in the pattern"),
        ({"layer": 7}, "head: unknown layer 7: this model has 3 (layers 0..2)"),
        ({"head": 9}, "head: unknown head 9 in layer 1"),
        ({"query": -1}, "query must be an int >= 0"),
        ({"key": "a"}, "key must be"),
        ({"prompt": ""}, "prompt"),
    ],
)
def test_bad_cells_are_400_one_line(client, change, message):
    body = {"prompt": PROMPT, "raw": True, "layer": 1, "head": 0, "query": 5, "key": 2, **change}
    r = client.post("/api/qk", json=body)
    assert r.status_code == 400 and message in r.json()["error"] and "\n" not in r.json()["error"]
