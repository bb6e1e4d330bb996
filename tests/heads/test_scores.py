"""HeadScores / HeadSet, and the span-attention scorer against the eager oracle."""

import json
import math

import pytest
import torch

from heads import HeadScores, HeadSet, encode_prompts, span_attention
from heads.results.scores import SCHEMA_VERSION
from tests.support.oracle import llama_forward


def _scores(n_layers=3, n_heads=4, n_kv=2):
    torch.manual_seed(0)
    return HeadScores(torch.rand(n_layers, n_heads), "test", {"a": 1}, "tiny-llama", n_kv, seed=3)


def test_to_frame():
    s = _scores()
    df = s.to_frame()
    assert list(df.columns) == ["layer", "head", "kv_head", "score"]
    assert len(df) == 12
    row = df[(df["layer"] == 2) & (df["head"] == 3)].iloc[0]
    assert row.kv_head == 1 and row.score == pytest.approx(s.scores[2, 3].item())


def test_top_ties_and_nan():
    t = torch.tensor([[1.0, 3.0], [3.0, float("nan")]])
    s = HeadScores(t, "x")
    assert s.top(2).heads == ((0, 1), (1, 0))  # tie broken by (layer, head)
    assert list(s._ranked()) == [(0, 1), (1, 0), (0, 0)]  # NaN dropped
    assert s.per_layer(1) == HeadSet([(0, 1), (1, 0)])
    assert s.threshold(2.0) == HeadSet([(0, 1), (1, 0)])
    with pytest.raises(ValueError):
        s.top(0)


def test_save_load_roundtrip(tmp_path, tiny_llama):
    s = _scores()
    s.scores[1, 1] = float("nan")
    p = s.save(tmp_path / "s.json")
    back = HeadScores.load(p, model=tiny_llama)
    assert back.method == "test" and back.params == {"a": 1} and back.seed == 3 and back.n_kv_heads == 2
    assert torch.equal(torch.nan_to_num(back.scores, 7.0), torch.nan_to_num(s.scores, 7.0))
    assert math.isnan(back.scores[1, 1])


def test_load_checks_model_and_schema(tmp_path, tiny_llama):
    p = _scores(n_layers=5).save(tmp_path / "s.json")
    with pytest.raises(ValueError, match="n_layers, n_heads, n_kv_heads"):
        HeadScores.load(p, model=tiny_llama)
    data = json.loads(p.read_text())
    data["schema_version"] = SCHEMA_VERSION + 1
    p.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="schema_version"):
        HeadScores.load(p)
    (tmp_path / "x.json").write_text('{"0": [1]}')
    with pytest.raises(ValueError, match="not a headsteer HeadScores"):
        HeadScores.load(tmp_path / "x.json")


def test_headset_parse(tmp_path):
    assert HeadSet.parse({"1": [2, 0], 0: [1]}).to_dict() == {"0": [1], "1": [0, 2]}
    assert HeadSet.parse([1], 3, 2).heads == ((1, 0), (1, 1))
    assert HeadSet.parse([(2, 1), [0, 0]]).heads == ((0, 0), (2, 1))
    f = HeadSet([(3, 1)]).save(tmp_path / "h.json")
    assert json.loads(f.read_text()) == {"3": [1]}
    assert HeadSet.parse(str(f)) == HeadSet([(3, 1)])
    with pytest.raises(ValueError, match="unknown layer 5"):
        HeadSet.parse({"5": [0]}, 3, 4)
    with pytest.raises(ValueError, match="unknown head 4 in layer 0"):
        HeadSet.parse({"0": [4]}, 3, 4)
    with pytest.raises(ValueError, match="head must be an int"):
        HeadSet.parse({"0": ["x"]})
    with pytest.raises(TypeError, match="top"):
        HeadSet.parse(_scores())
    with pytest.raises(FileNotFoundError):
        HeadSet.parse(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="not valid JSON"):
        HeadSet.parse(str(tmp_path / "bad.json"))


def test_bad_scores_shape():
    with pytest.raises(ValueError, match="n_layers, n_heads"):
        HeadScores(torch.zeros(3), "x")
    with pytest.raises(ValueError, match="n_kv_heads"):
        HeadScores(torch.zeros(2, 4), "x", n_kv_heads=3)


def test_span_attention_equals_oracle(tiny_llama, tokenizer):
    prompts = ["The **red box** is on the table. Where is it?", "Read **this part** only, please."]
    scores = span_attention(tiny_llama, prompts, chat=False, batch_size=1)
    enc = encode_prompts(tokenizer, prompts, chat=False)
    g = enc.span_mask()
    per_layer = {}

    def grab(layer, probs):
        per_layer[layer] = (probs[:, :, -1, :] * g[:, None, :]).sum(-1).mean(0)
        return probs

    llama_forward(tiny_llama.model, enc.input_ids, enc.attention_mask, grab)
    want = torch.stack([per_layer[la] for la in range(3)])
    torch.testing.assert_close(scores.scores, want, atol=1e-6, rtol=0)
    assert scores.method == "span_attention" and scores.model == "tiny-llama"


def test_span_attention_after_span_rows_and_errors(tiny_llama):
    s = span_attention(tiny_llama, "A **b** c d e f", chat=False, query="after_span")
    assert torch.all((s.scores >= 0) & (s.scores <= 1 + 1e-6))
    with pytest.raises(ValueError, match="no prompt has an emphasized span"):
        span_attention(tiny_llama, "no span here", chat=False)
    with pytest.raises(ValueError, match="query"):
        span_attention(tiny_llama, "A **b**", query="first")
    with pytest.raises(ValueError, match="empty prompt list"):
        span_attention(tiny_llama, [])


@pytest.mark.parametrize("head", ["1.5", '"2"', "true", "null", "NaN", "2.0", "[1]", "{}"])
def test_head_file_with_a_non_int_head_is_a_value_error(tmp_path, head):
    f = tmp_path / "h.json"
    f.write_text(f'{{"0": [{head}]}}')
    with pytest.raises(ValueError, match="head must be an int"):
        HeadSet.parse(str(f), 3, 4)


@pytest.mark.parametrize("spec", [[(0, True)], [(None, 1)], [(0, float("nan"))], [("0", 1)], {"0": [1.0]}])
def test_non_int_heads_in_python_are_value_errors(spec):
    with pytest.raises(ValueError, match="must be an int"):
        HeadSet.parse(spec)


def test_deeply_nested_head_file_is_a_clean_value_error(tmp_path):
    f = tmp_path / "deep.json"
    f.write_text("[" * 100_000)
    with pytest.raises(ValueError, match="deep.json.*not valid JSON"):
        HeadSet.parse(str(f))
    g = tmp_path / "deep_scores.json"
    g.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply"):
        HeadScores.load(g)


def test_duplicate_json_keys_are_refused(tmp_path):
    f = tmp_path / "dup.json"
    f.write_text('{"0": [1], "0": [2]}')
    with pytest.raises(ValueError, match="duplicate key '0'"):
        HeadSet.parse(str(f))
    p = _scores().save(tmp_path / "s.json")
    p.write_text(p.read_text().replace('"method": "test",', '"method": "test", "method": "other",'))
    with pytest.raises(ValueError, match="duplicate key 'method'"):
        HeadScores.load(p)


def test_saves_refuse_to_overwrite_and_create_parents(tmp_path):
    s = _scores()
    p = s.save(tmp_path / "new" / "sub" / "s.json")
    assert p.is_file()
    with pytest.raises(ValueError, match="exists.*overwrite=True"):
        _scores(n_layers=2).save(p)
    assert HeadScores.load(p).n_layers == 3  # untouched
    _scores(n_layers=2).save(p, overwrite=True)
    assert HeadScores.load(p).n_layers == 2
    h = HeadSet([(0, 1)]).save(tmp_path / "a" / "h.json")
    with pytest.raises(ValueError, match="exists"):
        HeadSet([(2, 2)]).save(h)
    assert HeadSet.parse(str(h)) == HeadSet([(0, 1)])
    assert HeadSet([(2, 2)]).save(h, overwrite=True) == h and HeadSet.parse(str(h)) == HeadSet([(2, 2)])
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ValueError, match="symlink"):
        HeadSet([(0, 1)]).save(link, overwrite=True)
    assert not (tmp_path / "elsewhere.json").exists()


def test_head_set_dict_and_file_order_layers_numerically(tmp_path):
    import json

    hs = HeadSet.parse({"10": [1], "2": [3, 0], "1": [4]})
    assert list(hs.to_dict()) == ["1", "2", "10"]  # not "1", "10", "2"
    path = hs.save(tmp_path / "h.json")
    assert list(json.loads(path.read_text())) == ["1", "2", "10"]
    assert "{1: [4], 2: [0, 3], 10: [1]}" in repr(hs)  # int layers, numeric order


def test_from_cache_refuses_partial_caches_and_bad_positions():
    """`HeadScores.from_cache` on a mapping shaped like an ActivationCache: the value is the span
    share of the query row; a missing layer, a bad query, a span the query cannot see, float
    bounds or a float mask are errors, never quietly wrong scores."""
    torch.manual_seed(0)
    pattern = torch.softmax(torch.randn(2, 3, 5, 5), -1)  # [B, H, q, k]
    cache = {f"blocks.{layer}.attn.hook_pattern": pattern * (layer + 1) for layer in range(2)}
    got = HeadScores.from_cache(cache, (1, 3), query=-1)
    want = pattern[:, :, -1, 1:3].sum(-1).mean(0)
    torch.testing.assert_close(got.scores, torch.stack([want, 2 * want]))
    assert HeadScores.from_cache(cache, (1, 3), query=2).scores.shape == (2, 3)
    with pytest.raises(ValueError, match=r"layers \[0\]"):
        HeadScores.from_cache({"blocks.1.attn.hook_pattern": pattern}, (1, 3))
    for bad in (5, -6, 1.5, "last", None, True):
        with pytest.raises(ValueError, match="query must be an int"):
            HeadScores.from_cache(cache, (1, 3), query=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sees none of it"):
        HeadScores.from_cache(cache, (3, 5), query=1)
    with pytest.raises(ValueError, match="bounds must be ints"):
        HeadScores.from_cache(cache, (1.7, 3.2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bool tensor"):
        HeadScores.from_cache(cache, torch.full((2, 5), 0.3))
    empty_row = torch.zeros(2, 5, dtype=torch.bool)
    empty_row[0, 1:3] = True
    with pytest.raises(ValueError, match=r"batch rows \[1\]"):
        HeadScores.from_cache(cache, empty_row)
    with pytest.raises(TypeError, match="ActivationCache"):
        HeadScores.from_cache(None, (1, 3))
    import numpy as np

    same = HeadScores.from_cache(cache, (np.int64(1), 3), query=np.int64(-1))  # numpy ints are ints
    torch.testing.assert_close(same.scores, got.scores)
    for bad_layer in (torch.rand(2, 3, 5, 7), torch.rand(2, 2, 5, 5), torch.rand(3, 5, 5), [[0.0]]):
        with pytest.raises(ValueError, match="blocks.1.attn.hook_pattern must be"):
            HeadScores.from_cache({**cache, "blocks.1.attn.hook_pattern": bad_layer}, (1, 3))


def test_from_cache_skips_keys_with_odd_layer_digits():
    """A key whose layer is not ASCII digits (`¹`) or absurdly long is not a layer: no raw
    int() error, the layers found are the well-formed ones."""
    pattern = torch.softmax(torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(0)), -1)
    cache = {
        "blocks.0.attn.hook_pattern": pattern,
        "blocks.\u00b9.attn.hook_pattern": pattern,
        "blocks." + "9" * 5000 + ".attn.hook_pattern": pattern,
    }
    assert HeadScores.from_cache(cache, (0, 2)).scores.shape == (1, 2)
