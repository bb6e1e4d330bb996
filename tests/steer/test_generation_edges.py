"""Generation edges (issue 16 part 2): attention outputs inside edits, absolute edit positions at
decode steps, ACT without a KV cache, batch rows that a span-based method cannot steer."""

import math
import warnings

import pytest
import torch

import heads.engine.state as engine_state
from heads import EditNeverFired, HeadScale, Recorder, editing, encode_prompts
from heads.scorers.sinks import SinkRule
from steer import Act, InstaBoost, Knockout, Pasta, PastaBias, Spotlight, SteeredModel, UnsteeredRowsWarning
from tests.support import make_tiny

PROMPT = "The quick brown fox jumps over the lazy dog near the river bank."


class Edits:
    """A minimal intervention: the same fixed edits for any batch."""

    def __init__(self, *edits):
        self._edits = list(edits)

    def edits(self, model, enc):
        return self._edits


@pytest.fixture(scope="module")
def eager_llama(tokenizer):
    return make_tiny("llama", tokenizer, attn="eager")


def _attentions(hm, enc, edits=()):
    with torch.no_grad(), editing(hm, list(edits)):
        out = hm.model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, output_attentions=True)
    return out.attentions


# ---------------------------------------------------------------- 1. output_attentions


def test_output_attentions_inside_editing_are_the_edited_patterns(eager_llama, tokenizer):
    enc = encode_prompts(tokenizer, ["Hello **there**, how are you today?"], chat=False)
    plain = _attentions(eager_llama, enc)
    assert len(plain) == eager_llama.n_layers
    rec = Recorder(layer=1)
    read_only = _attentions(eager_llama, enc, [rec])
    assert len(read_only) == len(plain)
    for a, b in zip(read_only, plain, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    torch.testing.assert_close(read_only[1], rec.records[0], atol=0, rtol=0)

    # a logit bias (an SDPA-path edit) on layer 0: the returned pattern is the edited one
    cb = torch.where(enc.span_mask(), 0.0, math.log(0.01))
    rec0 = Recorder(layer=0)
    steered = _attentions(eager_llama, enc, [PastaBias(layer=0, heads=[1], column_bias=cb), rec0])
    assert len(steered) == eager_llama.n_layers
    torch.testing.assert_close(steered[0], rec0.records[0], atol=0, rtol=0)
    assert (steered[0][:, 1] - plain[0][:, 1]).abs().max() > 1e-2  # head 1 steered
    torch.testing.assert_close(steered[0][:, 0], plain[0][:, 0], atol=1e-6, rtol=0)  # head 0 not
    torch.testing.assert_close(steered[0].sum(-1), torch.ones_like(steered[0].sum(-1)))


def test_output_attentions_during_cached_generation(eager_llama, tokenizer):
    enc = encode_prompts(tokenizer, ["Hi **there**", "A longer second prompt here"], chat=False)
    gen_kw = dict(max_new_tokens=3, do_sample=False, output_attentions=True, return_dict_in_generate=True)
    with torch.no_grad():
        plain = eager_llama.model.generate(
            input_ids=enc.input_ids, attention_mask=enc.attention_mask, pad_token_id=2, **gen_kw
        )
        with editing(eager_llama, Recorder(layer=0)):
            inside = eager_llama.model.generate(
                input_ids=enc.input_ids, attention_mask=enc.attention_mask, pad_token_id=2, **gen_kw
            )
    assert len(inside.attentions) == len(plain.attentions) == 3  # one tuple per step
    for step_in, step_plain in zip(inside.attentions, plain.attentions, strict=True):
        assert len(step_in) == len(step_plain) == eager_llama.n_layers
        for a, b in zip(step_in, step_plain, strict=True):
            assert a.shape == b.shape
            real = enc.attention_mask.bool()[:, -a.shape[2] :] if a.shape[2] > 1 else None
            if real is None:  # decode rows: every row is a real token
                torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
            else:  # prefill: padding query rows are undefined in eager (all-masked softmax)
                torch.testing.assert_close(
                    a[real[:, None, :].expand(-1, a.shape[1], -1)],
                    b[real[:, None, :].expand(-1, b.shape[1], -1)],
                    atol=1e-6,
                    rtol=0,
                )


def test_output_attentions_inside_editing_on_sdpa_model(tiny_llama, tokenizer):
    enc = encode_prompts(tokenizer, ["Hello there, how are you today?"], chat=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        att = _attentions(tiny_llama, enc, [Recorder(layer=1)])
    assert len(att) == tiny_llama.n_layers
    for a in att:
        assert a.shape == (1, tiny_llama.n_heads, enc.length, enc.length)
        torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)))
        assert torch.equal(a, a.tril())  # future keys stay 0


# ---------------------------------------------------------------- 2. absolute positions


@pytest.mark.parametrize("where", ["prompt", "generated"])
def test_positioned_head_scale_same_with_and_without_cache(tiny_llama, where):
    sm = SteeredModel(tiny_llama)
    n_prompt = sm.encode(PROMPT, chat=False).length
    pos = 3 if where == "prompt" else n_prompt + 1  # an absolute position of a generated token
    edit = HeadScale(layer=0, heads=[0, 1, 2, 3], factor=8.0, positions=[pos])
    kw = dict(chat=False, max_new_tokens=6)
    cached = sm.generate(PROMPT, Edits(edit), **kw)
    uncached = sm.generate(PROMPT, Edits(edit), use_cache=False, **kw)
    assert cached.token_ids == uncached.token_ids
    base = sm.generate(PROMPT, **kw)
    assert cached.token_ids != base.token_ids  # the edit acts


def test_positions_are_absolute_in_the_forward(tiny_any, tokenizer):
    """Scaling the last position at a decode step of a cached forward equals scaling it in a full
    run, on every family (fused QKV included)."""
    hm = tiny_any
    enc = encode_prompts(tokenizer, PROMPT, chat=False)
    ids, n = enc.input_ids, enc.length
    with torch.no_grad():
        with editing(hm, HeadScale(layer=1, factor=0.0, positions=[n - 1])):
            full = hm.model(input_ids=ids).logits[:, -1]
        pre = hm.model(input_ids=ids[:, :-1], use_cache=True)
        with editing(hm, HeadScale(layer=1, factor=0.0, positions=[n - 1])):
            step = hm.model(input_ids=ids[:, -1:], past_key_values=pre.past_key_values).logits[:, -1]
        plain = hm.model(input_ids=ids).logits[:, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=0)
    assert (full - plain).abs().max() > 1e-3


def test_negative_positions_count_from_the_end_of_each_call(tiny_llama, tokenizer):
    enc = encode_prompts(tokenizer, PROMPT, chat=False)
    with torch.no_grad():
        with editing(tiny_llama, HeadScale(layer=1, heads=[2], factor=0.0, positions=[-1])):
            last = tiny_llama.model(input_ids=enc.input_ids).logits
        with editing(tiny_llama, HeadScale(layer=1, heads=[2], factor=0.0, positions=[enc.length - 1])):
            absolute = tiny_llama.model(input_ids=enc.input_ids).logits
    assert torch.equal(last, absolute)


def test_positions_never_reached_or_malformed(tiny_llama, tokenizer):
    enc = encode_prompts(tokenizer, "short prompt", chat=False)
    with pytest.raises(EditNeverFired), torch.no_grad():
        with editing(tiny_llama, HeadScale(layer=0, factor=0.0, positions=[500])):
            tiny_llama.model(input_ids=enc.input_ids)
    for bad in ("3", [1.5], [True], 3):
        with pytest.raises(TypeError, match="positions"):
            HeadScale(layer=0, positions=bad)
    with pytest.raises(ValueError, match="positions"):
        HeadScale(layer=0, positions=[])


# ---------------------------------------------------------------- 3. ACT without a cache


def test_act_generation_same_with_and_without_cache(tiny_llama):
    sm = SteeredModel(tiny_llama)
    prompts = [PROMPT, "A second, shorter prompt."]
    kw = dict(chat=False, max_new_tokens=8)
    base = sm.generate(prompts, **kw)
    got = {}
    for mode in ("frozen", "running"):
        act = Act(beta=0.0, decode_sinks=mode, rule=SinkRule(alpha_s=1.5))  # the tiny model has sinks
        cached = sm.generate(prompts, act, **kw)
        uncached = sm.generate(prompts, act, use_cache=False, **kw)
        assert cached.token_ids == uncached.token_ids
        assert cached.token_ids != base.token_ids  # ACT acts
        got[mode] = cached.token_ids
    assert got["frozen"] != got["running"]  # the running statistics are exercised


def test_act_refuses_a_prompt_longer_than_a_query_block_before_running(tiny_llama, monkeypatch):
    monkeypatch.setattr(engine_state, "QUERY_BLOCK", 8)
    runs = []
    handle = tiny_llama.model.register_forward_pre_hook(lambda m, a: runs.append(1))
    try:
        with pytest.raises(ValueError, match="whole prompt"):
            SteeredModel(tiny_llama).generate(PROMPT, Act(), chat=False, max_new_tokens=2)
    finally:
        handle.remove()
    assert runs == []


# ---------------------------------------------------------------- 4. rows without a span


@pytest.mark.parametrize(
    "method",
    [Pasta({"0": [1], "1": [0, 3]}), Spotlight(tau=0.5), InstaBoost(multiplier=20.0), Knockout(keys="span")],
    ids=["pasta", "spotlight", "instaboost", "knockout"],
)
def test_rows_without_a_span_are_reported(tiny_llama, method):
    sm = SteeredModel(tiny_llama)
    with pytest.warns(UnsteeredRowsWarning, match=r"prompt 1 .*unsteered"):
        mixed = sm.generate(["Hi **there**, you", "no span here"], method, chat=False, max_new_tokens=3)
    alone = sm.generate("no span here", chat=False, max_new_tokens=3)
    assert mixed.token_ids[1] == alone.token_ids[0]  # really unsteered, as the warning says
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsteeredRowsWarning)
        sm.generate(["Hi **there**, you", "a **span** too"], method, chat=False, max_new_tokens=1)
    with pytest.raises(ValueError, match="span"):
        sm.generate(["no span", "none here"], method, chat=False, max_new_tokens=1)
