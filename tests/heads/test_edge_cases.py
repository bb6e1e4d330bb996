"""Bad and concurrent input: threads, sliding windows, chat templates, malformed files, mutation."""

import dataclasses
import json
import threading

import pytest
import torch

from heads import (
    HeadScale,
    HeadScores,
    HeadSet,
    editing,
    encode_prompts,
    forward,
    span_attention,
)
from steer import Pasta, SteeredModel
from tests.support import ZeroRow, make_tiny


@pytest.fixture()
def enc(tokenizer):
    return encode_prompts(tokenizer, ["Threads **must not** see each other.", "Short one."], chat=False)


def _run_two_threads(hm, enc, edits_a):
    """Thread A holds `edits_a` while thread B runs a plain forward in between A's steps."""
    a_in, b_done = threading.Event(), threading.Event()
    out = {}

    def a():
        with editing(hm, edits_a):
            a_in.set()
            b_done.wait(30)
            out["a"] = forward(hm, enc)

    def b():
        a_in.wait(30)
        out["b"] = forward(hm, enc)
        b_done.set()

    ts = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out


@pytest.mark.parametrize("kind", ["output", "attention"])
def test_edits_do_not_leak_to_other_threads(tiny_llama, enc, kind):
    base = forward(tiny_llama, enc)
    edit = HeadScale(layer=0, heads=[1], factor=0.0) if kind == "output" else ZeroRow(layer=0, heads=[1])
    with editing(tiny_llama, [edit]):
        want_a = forward(tiny_llama, enc)
    fresh = HeadScale(layer=0, heads=[1], factor=0.0) if kind == "output" else ZeroRow(layer=0, heads=[1])
    out = _run_two_threads(tiny_llama, enc, [fresh])
    assert torch.equal(out["b"], base)
    assert torch.equal(out["a"], want_a)
    assert tiny_llama.model.config._attn_implementation == "sdpa"
    assert all(not o._forward_pre_hooks for o in tiny_llama.out_projs)


def test_overlapping_contexts_in_threads_keep_steering_until_last_exit(tiny_llama, enc):
    with editing(tiny_llama, [ZeroRow(layer=1, heads=[2])]):
        want_b = forward(tiny_llama, enc)
    a_in, a_out = threading.Event(), threading.Event()
    out = {}

    def a():
        with editing(tiny_llama, [ZeroRow(layer=0, heads=[0])], require_fired=False):
            a_in.set()
            a_out.wait(30)

    def b():
        a_in.wait(30)
        with editing(tiny_llama, [ZeroRow(layer=1, heads=[2])]):
            a_out.set()
            ta.join(30)  # A has exited: B must still be steered
            out["b"] = forward(tiny_llama, enc)

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start()
    tb.start()
    tb.join(60)
    assert torch.equal(out["b"], want_b)
    assert tiny_llama.model.config._attn_implementation == "sdpa"


def test_sliding_window_layers_refuse_once_the_cache_slides(tokenizer):
    hm = make_tiny("mistral", tokenizer, sliding_window=16)
    assert hm.sliding_window(0) == 16
    sm = SteeredModel(hm)
    short = sm.generate("A **b** c", steer=Pasta({"0": [0]}), max_new_tokens=3, chat=False)
    assert (
        short.token_ids
        == sm.generate(
            "A **b** c", steer=Pasta({"0": [0]}), max_new_tokens=3, chat=False, use_cache=False
        ).token_ids
    )
    long = "**Important words** " + "then a long tail of filler text " * 4
    with pytest.raises(ValueError, match="sliding-window attention"):
        sm.generate(long, steer=Pasta({"0": [0]}), max_new_tokens=3, chat=False)
    assert hm.model.config._attn_implementation == "sdpa"


def test_chat_spans_land_in_the_message_not_the_template(tokenizer):
    special = set(tokenizer.all_special_ids)
    enc = encode_prompts(tokenizer, "**AI** assistant")  # "AI assistant" is also in the system prompt
    t0, t1 = enc.spans[0][0]
    user_at = enc.texts[0].index("<|im_start|>user")
    assert enc.char_spans[0][0][0] > user_at
    assert tokenizer.decode(enc.input_ids[0, t0:t1]).strip() == "AI"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "**user**"}]
    enc = encode_prompts(tokenizer, msgs)
    ((c0, c1),) = enc.char_spans[0]
    assert enc.texts[0][c0 - 1 : c1 + 1] == "\nuser<"  # the content, not the role name
    assert not any(t in special for t in enc.input_ids[0, slice(*enc.spans[0][0])].tolist())


def test_after_span_skips_prompts_without_rows(tiny_llama):
    a = span_attention(
        tiny_llama, ["Read **this** and more words", "ends with **the span**"], chat=False, query="after_span"
    )
    b = span_attention(tiny_llama, "Read **this** and more words", chat=False, query="after_span")
    torch.testing.assert_close(a.scores, b.scores, atol=1e-6, rtol=0)
    assert a.params["n_prompts"] == 1
    with pytest.raises(ValueError, match="must not end the prompt"):
        span_attention(tiny_llama, "ends with **the span**", chat=False, query="after_span")


def test_mutated_edits_are_checked_at_use(tiny_llama, enc):
    h = HeadScale(layer=0, heads=[0], factor=0.5)
    h.factor = float("nan")
    with pytest.raises(ValueError, match="finite"):
        with editing(tiny_llama, h):
            pass
    with pytest.raises(ValueError, match="10000"):
        HeadScale(layer=0, heads=[0], factor=1e300)
    g = HeadScale(layer=0, heads=[0], factor=0.0)
    with editing(tiny_llama, g):
        first = forward(tiny_llama, enc)
    g.heads = [3]
    with editing(tiny_llama, g):
        second = forward(tiny_llama, enc)
    with editing(tiny_llama, HeadScale(layer=0, heads=[3], factor=0.0)):
        want = forward(tiny_llama, enc)
    assert torch.equal(second, want) and not torch.equal(first, second)
    with pytest.raises(TypeError, match="row_heads must be a bool"):
        with editing(tiny_llama, HeadScale(layer=0, row_heads=[[True] * 4])):
            pass


def test_pasta_is_frozen_and_accepts_numpy():
    np = pytest.importorskip("numpy")
    p = Pasta({"0": [1]}, alpha=np.float32(0.05))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.alpha = float("nan")
    assert dataclasses.replace(p, alpha=0.5).alpha == 0.5
    with pytest.raises(ValueError, match="alpha"):
        dataclasses.replace(p, alpha=float("inf"))
    assert HeadSet.parse([(np.int64(0), np.int64(1))]).heads == ((0, 1),)


def test_single_intervention_and_type_errors(tiny_llama):
    sm = SteeredModel(tiny_llama)
    a = sm.generate("Hi **there**", steer=Pasta({"0": [1]}), max_new_tokens=2)
    b = sm.generate("Hi **there**", steer=[Pasta({"0": [1]})], max_new_tokens=2)
    assert a.token_ids == b.token_ids
    with pytest.raises(TypeError, match="emphasize"):
        sm.generate("Hi there", emphasize=5)
    with pytest.raises(TypeError, match="span to emphasize"):
        sm.generate("Hi there", emphasize=[[5]])
    with pytest.raises(TypeError, match="tokenizer"):
        encode_prompts(tiny_llama, "hi")
    with pytest.raises(TypeError, match="role and content"):
        sm.generate([{"role": "user", "content": None}])


def test_prompt_longer_than_position_limit(tokenizer):
    gpt2 = make_tiny("gpt2", tokenizer)
    with pytest.raises(ValueError, match="limit of 512 positions"):
        SteeredModel(gpt2).generate("word " * 600, max_new_tokens=2, chat=False)
    with pytest.raises(ValueError, match="limit of 512 positions"):
        SteeredModel(gpt2).generate("word " * 500, max_new_tokens=40, chat=False)


def _bad_file(tmp_path, **changes):
    data = HeadScores(torch.zeros(2, 4), "m", n_kv_heads=2).to_json()
    data.update(changes)
    p = tmp_path / "s.json"
    p.write_text(json.dumps(data))
    return p


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"scores": [1.0, 2.0]}, "row of"),
        ({"scores": [[0, 0, 0, 0], [0, 0, 0]]}, "4 numbers"),
        ({"scores": "oops"}, "rows"),
        ({"scores": [[True, 0, 0, 0], [0, 0, 0, 0]]}, "not a number"),
        ({"method": 5}, "'method' must be str"),
        ({"n_kv_heads": "2"}, "'n_kv_heads' must be int"),
        ({"n_kv_heads": 3}, "does not divide"),
        ({"seed": "x"}, "'seed'"),
        ({"params": [1, 2]}, "'params'"),
    ],
)
def test_malformed_scores_files(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        HeadScores.load(_bad_file(tmp_path, **changes))


def test_scores_file_errors_name_the_file(tmp_path):
    p = _bad_file(tmp_path)
    data = json.loads(p.read_text())
    del data["method"]
    p.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="s.json.*missing 'method'"):
        HeadScores.load(p)
    p.write_text("")
    with pytest.raises(ValueError, match="s.json.*not valid JSON"):
        HeadScores.load(p)
    with pytest.raises(TypeError, match="HeadModel"):
        HeadScores.load(_bad_file(tmp_path), "model")
    with pytest.raises(ValueError, match="inf"):
        HeadScores(torch.tensor([[float("inf")]]), "x").save(tmp_path / "inf.json")
