"""PASTA (the rules of docs/methods/pasta.md) on a tiny random Llama with GQA 4:2."""

import math

import pytest
import torch

from heads import HeadSet, Recorder, editing, encode_prompts, forward
from steer import Pasta, pasta_column_bias
from tests.support.oracle import llama_forward, pasta_eq2

PROMPTS = [
    "Context: the sky is green today. **Answer in one word.** What colour is the sky?",
    "Note: **the key is under the mat.** Where is the key?",
]
HEADS = {"0": [1], "1": [0, 3], "2": [2]}


@pytest.fixture()
def enc(tokenizer):
    return encode_prompts(tokenizer, PROMPTS, chat=False)


def steered(hm, enc, pasta, *recorders, kernel="auto", **kw):
    with editing(hm, pasta.edits(hm, enc) + list(recorders), kernel=kernel):
        return forward(hm, enc, **kw)


@pytest.mark.parametrize("kernel", ["blocked", "fused"])
def test_matches_paper_eq2_against_independent_eager_oracle(tiny_llama, enc, kernel):
    alpha = 0.01
    hs = HeadSet.parse(HEADS).by_layer()
    g = enc.span_mask()
    seen = {}

    def transform(layer, probs):
        out = pasta_eq2(probs, hs.get(layer, []), g, alpha, enc.length)
        seen[layer] = out
        return out

    want = llama_forward(tiny_llama.model, enc.input_ids, enc.attention_mask, transform)
    recs = [Recorder(layer=la) for la in range(3)] if kernel == "blocked" else []  # fused: no pattern
    got = steered(tiny_llama, enc, Pasta(HEADS, alpha=alpha), *recs, kernel=kernel)
    real = enc.attention_mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
    rows = real[:, None, :, None]
    for la, rec in enumerate(recs):
        p = rec.records[0]
        diff = ((p - seen[la]).abs() * rows).max()
        assert diff <= 1e-6, (la, diff)


def test_rows_sum_to_one_and_unsteered_heads_bitwise(tiny_llama, enc):
    plain, edited = Recorder(layer=1), Recorder(layer=1)
    with editing(tiny_llama, [plain]):
        forward(tiny_llama, enc)
    steered(tiny_llama, enc, Pasta({"1": [0, 3]}), edited)
    p0, p1 = plain.records[0], edited.records[0]
    real = enc.attention_mask.bool()
    sums = p1.sum(-1).permute(0, 2, 1)[real]
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-6, rtol=0)
    assert torch.equal(p0[:, [1, 2]], p1[:, [1, 2]])  # head 1 shares KV head 0 with head 0
    assert not torch.allclose(p0[:, 0], p1[:, 0])


def test_alpha_one_and_empty_heads_are_bitwise_noops(tiny_llama, enc):
    base = forward(tiny_llama, enc)
    assert Pasta(HEADS, alpha=1.0).edits(tiny_llama, enc) == []
    assert torch.equal(steered(tiny_llama, enc, Pasta(HEADS, alpha=1.0)), base)
    assert torch.equal(steered(tiny_llama, enc, Pasta({})), base)


def test_include_inverse_equals_exclude(tiny_llama, enc):
    a = steered(tiny_llama, enc, Pasta(HEADS, alpha=0.05))
    b = steered(tiny_llama, enc, Pasta(HEADS, alpha=20.0, scale_position="include"))
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_include_with_small_alpha_warns():
    with pytest.warns(UserWarning, match="suppresses the span"):
        Pasta(HEADS, alpha=0.01, scale_position="include")


def test_rows_before_span_unchanged_and_mass_rises(tiny_llama, tokenizer):
    enc = encode_prompts(tokenizer, "Some words come first here, then **the span**, then more.", chat=False)
    t0, t1 = enc.spans[0][0]
    masses = []
    base = Recorder(layer=0)
    with editing(tiny_llama, [base]):
        forward(tiny_llama, enc)
    for alpha in (1.0, 0.1, 0.01):
        rec = Recorder(layer=0)
        steered(tiny_llama, enc, Pasta({"0": [0, 1, 2, 3]}, alpha=alpha), rec)
        p = rec.records[0]
        assert (p[:, :, :t0] - base.records[0][:, :, :t0]).abs().max() <= 1e-7
        masses.append(p[0, :, -1, t0:t1].sum(-1))
    assert torch.all(masses[0] < masses[1]) and torch.all(masses[1] < masses[2])


def test_steered_share_follows_formula(tiny_llama, tokenizer):
    """Span share s' = s / (s + alpha (1 - s)) at prefill on the steered layer."""
    enc = encode_prompts(tokenizer, "Some words come first here, then **the span**, then more.", chat=False)
    g = enc.span_mask()[0]
    base, after = Recorder(layer=0), Recorder(layer=0)
    with editing(tiny_llama, [base]):
        forward(tiny_llama, enc)
    steered(tiny_llama, enc, Pasta({"0": [2]}, alpha=0.01), after)
    s = base.records[0][0, 2, -1, g].sum()
    want = s / (s + 0.01 * (1 - s))
    torch.testing.assert_close(after.records[0][0, 2, -1, g].sum(), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kernel", ["blocked", "fused"])
def test_kv_cache_matches_uncached_recomputation(tiny_llama, enc, kernel):
    pasta = Pasta(HEADS)
    edits = pasta.edits(tiny_llama, enc)
    n_new = 6
    common = dict(
        input_ids=enc.input_ids,
        attention_mask=enc.attention_mask,
        max_new_tokens=n_new,
        do_sample=False,
        pad_token_id=2,
        eos_token_id=None,
    )
    with editing(tiny_llama, edits, kernel=kernel):
        out = tiny_llama.model.generate(**common, output_logits=True, return_dict_in_generate=True)
        nocache = tiny_llama.model.generate(**common, use_cache=False)
    assert torch.equal(out.sequences, nocache)
    seq = out.sequences
    mask = torch.cat([enc.attention_mask, torch.ones(seq.shape[0], n_new, dtype=torch.long)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    # bias built for the prompt columns only
    with editing(tiny_llama, pasta.edits(tiny_llama, enc), kernel=kernel), torch.no_grad():
        full = tiny_llama.model(input_ids=seq, attention_mask=mask, position_ids=pos).logits
    cached = torch.stack(out.logits, dim=1)
    torch.testing.assert_close(cached, full[:, enc.length - 1 : -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kernel", ["blocked", "fused"])
def test_left_padding_and_batch_order_invariance(tiny_llama, tokenizer, kernel):
    pasta = Pasta(HEADS)
    batch = encode_prompts(tokenizer, PROMPTS, chat=False)
    rev = encode_prompts(tokenizer, PROMPTS[::-1], chat=False)
    lb, lr = steered(tiny_llama, batch, pasta, kernel=kernel), steered(tiny_llama, rev, pasta, kernel=kernel)
    for i, p in enumerate(PROMPTS):
        alone = encode_prompts(tokenizer, p, chat=False)
        la = steered(tiny_llama, alone, pasta, kernel=kernel)[0, -1]
        torch.testing.assert_close(lb[i, -1], la, atol=1e-4, rtol=0)
        torch.testing.assert_close(lr[len(PROMPTS) - 1 - i, -1], la, atol=1e-4, rtol=0)


def test_union_of_spans_equals_one_span(tiny_llama, tokenizer):
    text = "Please read alpha beta and reply."
    one = encode_prompts(tokenizer, text, emphasize="alpha beta", chat=False)
    two = encode_prompts(tokenizer, text, emphasize=["alpha", " beta"], chat=False)
    assert len(two.spans[0]) == 2
    assert torch.equal(steered(tiny_llama, one, Pasta(HEADS)), steered(tiny_llama, two, Pasta(HEADS)))


def test_compound_column_factors(tokenizer):
    enc = encode_prompts(tokenizer, "x **alpha** y **gamma** z", chat=False)
    a = 0.01
    cb = pasta_column_bias(enc, a, "exclude", "compound")[0]
    in_any = enc.span_mask()[0]
    torch.testing.assert_close(cb[~in_any], torch.full_like(cb[~in_any], 2 * math.log(a)))
    torch.testing.assert_close(cb[in_any], torch.full_like(cb[in_any], math.log(a)))
    union = pasta_column_bias(enc, a, "exclude", "union")[0]
    assert torch.all(union[in_any] == 0) and torch.allclose(union[~in_any], torch.tensor(math.log(a)))


def test_generation_mode_scales_every_prompt_column(tokenizer):
    enc = encode_prompts(tokenizer, ["short one", "a longer prompt here"], chat=False)
    cb = pasta_column_bias(enc, 0.5, "generation")
    real = enc.attention_mask.bool()
    assert torch.allclose(cb[real], torch.tensor(math.log(0.5))) and torch.all(cb[~real] == 0)


@pytest.mark.parametrize("alpha", [0, -0.5, float("nan"), float("inf")])
def test_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        Pasta(HEADS, alpha=alpha)


@pytest.mark.parametrize("alpha", ["0.01", True, None])
def test_alpha_type(alpha):
    with pytest.raises(TypeError, match="alpha"):
        Pasta(HEADS, alpha=alpha)


def test_bad_mode_and_heads(tiny_llama, enc):
    with pytest.raises(ValueError, match="scale_position"):
        Pasta(HEADS, scale_position="both")
    with pytest.raises(ValueError, match="multi_span"):
        Pasta(HEADS, multi_span="sum")
    with pytest.raises(ValueError, match="unknown head 9 in layer 1"):
        Pasta({"1": [9]}).edits(tiny_llama, enc)
    with pytest.raises(ValueError, match="unknown layer 30"):
        Pasta([30]).edits(tiny_llama, enc)


def test_no_span_raises(tiny_llama, tokenizer):
    enc = encode_prompts(tokenizer, "no emphasis here", chat=False)
    with pytest.raises(ValueError, match="emphasized span"):
        Pasta(HEADS).edits(tiny_llama, enc)
    assert Pasta(HEADS, scale_position="generation").edits(tiny_llama, enc)


def test_head_selection_shapes(tiny_llama):
    assert Pasta([1]).head_set(tiny_llama) == HeadSet([(1, h) for h in range(4)])
    assert Pasta([(0, 1), (2, 3)]).head_set(tiny_llama) == HeadSet([(0, 1), (2, 3)])
    assert Pasta({0: [1]}).head_set(tiny_llama) == Pasta({"0": [1]}).head_set(tiny_llama)


def test_pasta_heads_auto_and_missing_file(tiny_llama, tmp_path):
    """`heads="auto"` is the shipped profile (the CLI's and server's word): on a model without one
    it is a ValueError naming the model; a missing head file fails when Pasta is built."""
    with pytest.raises(ValueError, match="no shipped pasta head profile"):
        Pasta("auto").head_set(tiny_llama)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        Pasta(str(tmp_path / "nope.json"))
    for bad in (5, None, 1.5):
        with pytest.raises(TypeError, match="heads must be a head spec"):
            Pasta(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="use 'exclude', 'include' or 'generation'"):
        Pasta({"0": [0]}, scale_position="exlude")  # type: ignore[arg-type]
