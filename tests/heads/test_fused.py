"""The fused kernel (`heads.engine.kernels.fused`, `editing(kernel="fused")`) equals the blocked path.

Tiny random Llama with GQA 4:2, left-padded batches. The compiled kernels are shared by the
whole session (one compile per variant: padded / unpadded mask, batch 1 / > 1, prefill /
decode row, dtype), so these tests reuse few shapes. `HEADSTEER_TEST_DEVICE=cuda` runs them
on a GPU (`benchmarks/gpu_check.py`).
"""

import os

import pytest
import torch

import heads.engine.state as engine_state
from heads import HeadScale, QueryScale, Recorder, editing, encode_prompts, forward
from heads.engine.kernels.fused import bucket, fused_attention
from steer import Pasta
from steer.spotlight import Spotlight

PROMPTS = [
    "Context: the sky is green today. **Answer in one word.** What colour is the sky?",
    "Note: **the key is under the mat.** Where is the key?",
]
HEADS = {"0": [1], "1": [0, 3], "2": [2]}
DEVICE = os.environ.get("HEADSTEER_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def tiny_llama(tokenizer):
    """This module's own tiny GQA Llama on DEVICE (the session's stays on CPU)."""
    from tests.support import make_tiny

    hm = make_tiny("llama", tokenizer)
    hm.model.to(DEVICE)
    return hm


@pytest.fixture()
def enc(tokenizer):
    return encode_prompts(tokenizer, PROMPTS, chat=False)


def _logits(hm, enc, edits, kernel):
    with editing(hm, edits, kernel=kernel):
        return forward(hm, enc)


def _both(hm, enc, make):
    """Real-position logits of the blocked and the fused path, each with fresh edits."""
    real = enc.attention_mask.bool().to(DEVICE)
    return _logits(hm, enc, make(), "blocked")[real], _logits(hm, enc, make(), "fused")[real]


def test_kernel_matches_softmax_oracle_with_padding_gqa_and_buckets():
    torch.manual_seed(0)
    b, q_len, k_len = 2, 150, 170  # a decode-style offset; lengths not multiples of the block
    q = torch.randn(b, 4, q_len, 16)
    k, v = torch.randn(b, 2, k_len, 16), torch.randn(b, 2, k_len, 16)
    bias = torch.randn(b, 4, k_len)
    beta, span = torch.randn(b, 4, q_len), (torch.rand(b, k_len) < 0.3).float()
    q, k, v, bias, beta, span = (t.to(DEVICE) for t in (q, k, v, bias, beta, span))
    visible = torch.arange(k_len)[None, :] <= torch.arange(q_len)[:, None] + (k_len - q_len)
    visible = visible[None, None] & (torch.arange(k_len) >= 7)  # 7 left-padding keys
    visible = visible.expand(b, 1, q_len, k_len).clone()
    visible[1, :, :, :7] = True
    visible = visible.to(DEVICE)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, 1)) * 0.25
    scores = scores + bias[:, :, None] + beta[..., None] * span[:, None, None]
    want = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v.repeat_interleave(2, 1)
    got = fused_attention(q, k, v, scale=0.25, mask=visible, bias=bias, beta=beta, span=span)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert bucket(1) == 1 and bucket(150) == 256 and bucket(1024) == 1024 and bucket(8192) == 8192
    assert bucket(4100) == 5 * 1024  # at most a third of padding


@pytest.mark.parametrize("spec", [HEADS, [(1, 0)]])
def test_pasta_fused_equals_blocked(tiny_llama, enc, spec):
    blocked, fused = _both(tiny_llama, enc, lambda: Pasta(spec, alpha=0.01).edits(tiny_llama, enc))
    torch.testing.assert_close(fused, blocked, atol=1e-5, rtol=0)
    plain = forward(tiny_llama, enc)[enc.attention_mask.bool().to(DEVICE)]
    assert (fused - plain).abs().max() > 1e-2  # the steering shows


@pytest.mark.parametrize("granularity", ["row", "head", "layer"])
@pytest.mark.parametrize("bias", ["odds", "solve"])
def test_spotlight_fused_equals_blocked(tiny_llama, enc, granularity, bias):
    sl = Spotlight(tau=0.5, granularity=granularity, bias=bias)
    edits: dict[str, list] = {}

    def make():
        edits["last"] = sl.edits(tiny_llama, enc)
        return edits["last"]

    blocked_l = _logits(tiny_llama, enc, make(), "blocked")
    psi_blocked = [e.last_psi for e in edits["last"]]
    fused_l = _logits(tiny_llama, enc, make(), "fused")
    psi_fused = [e.last_psi for e in edits["last"]]
    real = enc.attention_mask.bool().to(DEVICE)
    torch.testing.assert_close(fused_l[real], blocked_l[real], atol=1e-5, rtol=0)
    for a, b in zip(psi_fused, psi_blocked, strict=True):  # the shares the edits measured
        keep = real[:, None].expand_as(a) if a.shape[-1] == real.shape[-1] else torch.ones_like(a, dtype=bool)
        torch.testing.assert_close(a[keep], b[keep], atol=1e-5, rtol=0)


def test_spotlight_with_pasta_and_row_heads(tiny_llama, enc):
    """PASTA and SpotLight on one layer, per-row heads (the variant engine's batched rows) and a
    UA query ablation, all fused."""
    rows = torch.tensor([[True, False, True, False], [False, True, False, False]])

    def make():
        sl = Spotlight(tau=0.4, granularity="row", layers=(1,)).edits(tiny_llama, enc)
        pa = Pasta({"1": [0, 1, 2, 3]}, alpha=0.05).edits(tiny_llama, enc)
        pa[0].heads, pa[0].row_heads = None, rows
        ua = QueryScale(layer=2, row_heads=rows, factor=0.0)
        ablate = HeadScale(layer=0, row_heads=rows, factor=0.0)
        return [*sl, *pa, ua, ablate]

    blocked, fused = _both(tiny_llama, enc, make)
    torch.testing.assert_close(fused, blocked, atol=1e-5, rtol=0)


def test_cached_decoding_fused_equals_blocked_and_uncached(tiny_llama, enc):
    common = dict(
        input_ids=enc.input_ids.to(DEVICE),
        attention_mask=enc.attention_mask.to(DEVICE),
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=2,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    outs = {}
    for kernel in ("blocked", "fused"):
        with editing(tiny_llama, Pasta(HEADS).edits(tiny_llama, enc), kernel=kernel):
            outs[kernel] = tiny_llama.model.generate(**common)
    assert torch.equal(outs["fused"].sequences, outs["blocked"].sequences)
    got, want = torch.stack(outs["fused"].logits, 1), torch.stack(outs["blocked"].logits, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_bf16_fused_equals_blocked(tokenizer, enc):
    from tests.support import make_tiny

    hm = make_tiny("llama", tokenizer)
    hm.model.to(device=DEVICE, dtype=torch.bfloat16)
    blocked, fused = _both(hm, enc, lambda: Pasta(HEADS, alpha=0.01).edits(hm, enc))
    plain = forward(hm, enc)[enc.attention_mask.bool().to(DEVICE)]
    err = (fused.float() - blocked.float()).abs().max()
    effect = (blocked.float() - plain.float()).abs().max()
    assert err <= 0.05 * effect, (err, effect)  # bf16: within rounding of the steering effect


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU threshold of kernel='auto'")
def test_auto_runs_fused_above_the_threshold(tiny_llama, enc, monkeypatch):
    fused = _logits(tiny_llama, enc, Pasta(HEADS).edits(tiny_llama, enc), "fused")
    blocked = _logits(tiny_llama, enc, Pasta(HEADS).edits(tiny_llama, enc), "blocked")
    assert torch.equal(_logits(tiny_llama, enc, Pasta(HEADS).edits(tiny_llama, enc), "auto"), blocked)
    monkeypatch.setattr(engine_state, "FUSED_MIN_ROWS_CPU", 2)
    assert torch.equal(_logits(tiny_llama, enc, Pasta(HEADS).edits(tiny_llama, enc), "auto"), fused)
    # a layer with a recorder stays blocked under auto, and the pattern is still recorded
    rec = Recorder(layer=1)
    with editing(tiny_llama, [*Pasta(HEADS).edits(tiny_llama, enc), rec]):
        forward(tiny_llama, enc)
    assert rec.records[0].shape[-1] == enc.length


def test_bad_kernel_values(tiny_llama, enc):
    before = forward(tiny_llama, enc)
    for bad in ("flex", "", None, 1):
        with pytest.raises(ValueError if isinstance(bad, str) else TypeError, match="kernel must be one of"):
            with editing(tiny_llama, HeadScale(layer=0, heads=[0]), kernel=bad):  # type: ignore[arg-type]
                pass
    with pytest.raises(ValueError, match="kernel='fused' cannot run"):
        with editing(tiny_llama, [Recorder(layer=1)], kernel="fused"):
            pass
    two = Spotlight(tau=0.5, granularity="row", layers=(1,))
    with pytest.raises(ValueError, match="span-share edits in layer 1"):
        with editing(tiny_llama, [*two.edits(tiny_llama, enc), *two.edits(tiny_llama, enc)], kernel="fused"):
            pass
    with editing(tiny_llama, Pasta(HEADS).edits(tiny_llama, enc), kernel="fused", require_fired=False):
        if DEVICE != "cpu":
            pytest.skip("flex_attention has a backward pass on CUDA")
        with pytest.raises(ValueError, match="no backward pass"):  # CPU flex_attention: inference only
            tiny_llama.model(input_ids=enc.input_ids.to(DEVICE), attention_mask=enc.attention_mask.to(DEVICE))
    # nested contexts: the inner kernel='fused' sees the outer context's edits too
    with editing(tiny_llama, two.edits(tiny_llama, enc), require_fired=False):
        with pytest.raises(ValueError, match="span-share edits in layer 1"):
            with editing(tiny_llama, two.edits(tiny_llama, enc), kernel="fused"):
                pass
    with editing(tiny_llama, [Recorder(layer=0)], require_fired=False):
        with pytest.raises(ValueError, match="kernel='fused' cannot run"):
            with editing(tiny_llama, Pasta(HEADS).edits(tiny_llama, enc), kernel="fused"):
                pass
    with pytest.raises(ValueError, match="output_attentions"):  # fused never builds the pattern
        with torch.no_grad(), editing(tiny_llama, Pasta(HEADS).edits(tiny_llama, enc), kernel="fused"):
            forward(tiny_llama, enc, output_attentions=True)
    assert torch.equal(forward(tiny_llama, enc), before)  # the model is left as it was


def test_only_the_edited_heads_run_fused(tiny_llama, enc, monkeypatch):
    """The fused kernel sees the edited heads only (bucketed head count); the other heads run
    the model's own SDPA, and the logits still equal the blocked path's."""
    import heads.engine.kernels.fused as fz

    assert [fz.head_bucket(n, 32) for n in (0, 1, 3, 7, 9, 17, 40)] == [1, 1, 3, 8, 10, 20, 32]
    assert fz.head_bucket(3, 4) == 3 and fz.head_bucket(4, 4) == 4
    seen: list[int] = []
    real = fz.fused_attention

    def spy(query, *a, **kw):
        seen.append(query.shape[1])
        return real(query, *a, **kw)

    monkeypatch.setattr(fz, "fused_attention", spy)
    blocked, fused = _both(tiny_llama, enc, lambda: Pasta(HEADS, alpha=0.01).edits(tiny_llama, enc))
    assert seen == [1, 2, 1]  # layers 0, 1, 2 edit heads [1], [0, 3], [2] of 4
    torch.testing.assert_close(fused, blocked, atol=1e-5, rtol=0)


def test_pooled_spotlight_on_a_long_prompt_runs_fused(tiny_llama, tokenizer, monkeypatch):
    """SpotLight at layer granularity pools the whole prefill: a prompt longer than a query
    block is accepted (auto runs it fused, unsplit) and equals the one-block blocked result;
    kernel='blocked' would split it and refuses; without flex_attention `edits` refuses."""
    from steer.spotlight import Spotlight as SL

    long_enc = encode_prompts(
        tokenizer, ["Context: **the key is under the mat.** Where is the key? " * 3], chat=False
    )
    sl = SL(tau=0.5, granularity="layer")
    one_block = _logits(tiny_llama, long_enc, sl.edits(tiny_llama, long_enc), "blocked")
    monkeypatch.setattr(engine_state, "QUERY_BLOCK", 8)
    assert long_enc.length > 8
    auto = _logits(tiny_llama, long_enc, sl.edits(tiny_llama, long_enc), "auto")
    torch.testing.assert_close(auto, one_block, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="query blocks"):
        _logits(tiny_llama, long_enc, sl.edits(tiny_llama, long_enc), "blocked")
    monkeypatch.setattr("heads.engine.kernels.fused.available", lambda: False)
    with pytest.raises(ValueError, match="no flex_attention"):
        sl.edits(tiny_llama, long_enc)
