"""The activation sites (`heads.engine.activations`) on the Hugging Face backend: every read
against an independent oracle (the model's hidden states, its weights), every replacement
against an equivalent edit elsewhere, per-row selection, gradients, refusals."""

from __future__ import annotations

import pytest
import torch

from heads import encode_prompts, forward
from heads.engine import state as engine_state
from heads.engine.activations import ActivationEdit, ActivationRecorder
from heads.engine.context import editing
from heads.engine.edits import Recorder
from tests.support import make_tiny
from tests.support.families import family_inputs, tiny_family_model

PROMPTS = ["The cat sat on the mat and", "Hello there, dear friend"]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request, tokenizer):
    return make_tiny(request.param, tokenizer)


@pytest.fixture(scope="module")
def enc(tokenizer):
    return encode_prompts(tokenizer, PROMPTS, chat=False, markup=False)


def _record(hm, enc, sites):
    recs = {(s, layer): ActivationRecorder(s, layer) for s, layer in sites}
    with editing(hm, list(recs.values())):
        logits = forward(hm, enc)
    return logits, {k: r.records[0] for k, r in recs.items()}


def _ln(hm, layer, x):
    return (
        hm.layers[layer].input_layernorm(x) if hm.family.model_type == "llama" else hm.layers[layer].ln_1(x)
    )


def test_every_read_equals_its_oracle(model, enc):
    hm = model
    L = hm.n_layers
    names = ["residual", "attn_out", "resid_mid", "mlp_out", "resid_post", "q", "k", "v", "head_output"]
    sites = [(s, la) for la in range(L) for s in names] + [("embed", 0), ("ln_final.scale", 0)]
    sites += [("ln_final.normalized", 0)] + ([("pos_embed", 0)] if hm.family.model_type == "gpt2" else [])
    logits, got = _record(hm, enc, sites)
    full = forward(hm, enc, output_hidden_states=True)
    assert torch.equal(logits, full.logits)  # reads change nothing
    hidden = full.hidden_states
    emb = hm.model.get_input_embeddings().weight[enc.input_ids]
    assert torch.equal(got["embed", 0], emb)
    if hm.family.model_type == "gpt2":
        pos = (enc.attention_mask.cumsum(-1) - 1).clamp(min=0)
        assert torch.equal(got["pos_embed", 0], hm.model.transformer.wpe.weight[pos])
    for la in range(L):
        pre, mid, post = got["residual", la], got["resid_mid", la], got["resid_post", la]
        assert torch.equal(pre, hidden[la])
        if la < L - 1:
            assert torch.equal(post, hidden[la + 1])
        assert torch.equal(mid, pre + got["attn_out", la])  # the two operands the block adds
        assert torch.equal(post, mid + got["mlp_out", la])
        w = hm.layer_weights(la)
        n = _ln(hm, la, pre)
        for s, key in (("q", "W_Q"), ("k", "W_K"), ("v", "W_V")):
            want = torch.einsum("btd,hde->bthe", n, w[key])
            if hm.family.model_type == "gpt2":  # c_attn's bias, Q | K | V blocks
                b = hm.layers[la].attn.c_attn.bias.reshape(3, hm.n_heads, hm.d_head)[["q", "k", "v"].index(s)]
                want = want + b
            assert got[s, la].shape == (2, enc.length, w[key].shape[0], hm.d_head)
            torch.testing.assert_close(got[s, la], want, atol=1e-5, rtol=0)
        z = got["head_output", la]
        attn = torch.einsum("bthd,hde->bte", z, w["W_O"])
        if hm.family.model_type == "gpt2":
            attn = attn + hm.layers[la].attn.c_proj.bias
        torch.testing.assert_close(got["attn_out", la], attn, atol=1e-5, rtol=0)
    # the final norm: hidden_states[-1] is its output, w * x / scale (+ b)
    x = got["resid_post", L - 1]
    norm = hm.final_norm
    scale = got["ln_final.scale", 0]
    assert scale.shape == (2, enc.length, 1)
    want = x.float() - (x.float().mean(-1, keepdim=True) if hm.family.model_type == "gpt2" else 0)
    torch.testing.assert_close(got["ln_final.normalized", 0], want / scale, atol=1e-6, rtol=0)
    out = got["ln_final.normalized", 0] * norm.weight + getattr(norm, "bias", 0)
    torch.testing.assert_close(out, hidden[L], atol=1e-5, rtol=0)


def _logits_with(hm, enc, edits):
    with editing(hm, edits) as active:
        out = forward(hm, enc)
    assert all(e.calls > 0 for e in active)
    return out


def test_replacements_equal_the_same_change_elsewhere(model, enc):
    """Adding `delta` at one site equals adding it where the same value flows on."""
    hm = model
    delta = 0.3 * torch.randn(hm.d_model, generator=torch.Generator().manual_seed(1))
    base = forward(hm, enc)

    def add(site, layer):
        return ActivationEdit(site, layer, lambda x, call: x + delta)

    same = [  # (site, layer) pairs whose added delta reaches the stream the same way
        (("resid_post", 0), ("residual", 1)),
        (("resid_mid", 1), ("attn_out", 1)),
        (("mlp_out", 0), ("resid_post", 0)),
        (("embed", 0), ("residual", 0)),
    ]
    for a, b in same:
        got, want = _logits_with(hm, enc, [add(*a)]), _logits_with(hm, enc, [add(*b)])
        assert float((got - base).abs().max()) > 1e-3, a
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # a replacement by the value read is the identity, bit for bit
    for site in ("resid_mid", "q", "k", "v", "attn_out", "mlp_out", "resid_post", "ln_final.scale"):
        ident = ActivationEdit(site, 0, lambda x, call: x.clone())
        assert torch.equal(_logits_with(hm, enc, [ident]), base), site
    # the final norm's scale doubled halves every logit (no LM-head bias)
    half = _logits_with(hm, enc, [ActivationEdit("ln_final.scale", 0, lambda s, call: 2 * s)])
    if hm.family.model_type == "llama":
        torch.testing.assert_close(half, base / 2, atol=1e-5, rtol=0)
    assert not engine_state.INSTALLED  # every hook removed


def test_zero_q_or_k_makes_the_pattern_uniform_and_zero_v_zeroes_z(model, enc):
    hm = model
    g = hm.n_groups
    real = enc.attention_mask.bool()
    visible = torch.tril(torch.ones(enc.length, enc.length, dtype=torch.bool))[None] & real[:, None, :]
    uniform = visible / visible.sum(-1, keepdim=True).clamp(min=1)
    for site, head in (("q", 1), ("k", 0)):
        rec = Recorder(layer=1)
        zero = ActivationEdit(site, 1, lambda x, call: torch.zeros_like(x), heads=[head])
        _logits_with(hm, enc, [zero, rec])
        heads = [head] if site == "q" else list(range(head * g, (head + 1) * g))
        p = rec.records[0]
        for h in heads:
            torch.testing.assert_close(p[:, h][real], uniform[real], atol=1e-6, rtol=0)
        other = next(h for h in range(hm.n_heads) if h not in heads)
        assert float((p[:, other][real] - uniform[real]).abs().max()) > 1e-3
    z = ActivationRecorder("head_output", 1)
    _logits_with(hm, enc, [ActivationEdit("v", 1, lambda x, call: torch.zeros_like(x), heads=[0]), z])
    assert torch.all(z.records[0][:, :, :g] == 0) and torch.any(z.records[0][:, :, g:] != 0)


def test_rows_select_batch_rows(model, enc):
    hm = model
    base = forward(hm, enc)
    got = _logits_with(hm, enc, [ActivationEdit("resid_mid", 0, lambda x, call: x * 2, rows=[1])])
    assert torch.equal(got[0], base[0]) and not torch.equal(got[1], base[1])
    rec = ActivationRecorder("resid_post", 0, rows=torch.tensor([True, False]))
    _logits_with(hm, enc, [rec])
    assert rec.records[0].shape[0] == 1


def test_gradients_flow_through_reads_and_replacements(tiny_llama, enc):
    hm = tiny_llama
    live = ActivationRecorder("resid_mid", 1, detach=False)
    leaf = {}

    def swap(x, call):
        leaf["x"] = x.detach().clone().requires_grad_(True)
        return leaf["x"]

    with editing(hm, [live, ActivationEdit("resid_post", 2, swap)]):
        out = hm.run(input_ids=enc.input_ids, attention_mask=enc.attention_mask)
    loss = out.logits[:, -1].logsumexp(-1).sum()
    (g_mid,) = torch.autograd.grad(loss, live.records[0], retain_graph=True, allow_unused=True)
    (g_leaf,) = torch.autograd.grad(loss, leaf["x"])
    # oracle for the replaced leaf: the same function written out (final norm, LM head)
    x = leaf["x"].detach().clone().requires_grad_(True)
    want = hm.unembed(hm.final_norm(x))[:, -1].logsumexp(-1).sum()
    (g_want,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(g_leaf, g_want, atol=1e-6, rtol=0)
    assert g_mid is None  # layer 2's output is replaced: nothing flows back to layer 1
    with editing(hm, [live2 := ActivationRecorder("resid_mid", 1, detach=False)]):
        out = hm.run(input_ids=enc.input_ids, attention_mask=enc.attention_mask)
    (g,) = torch.autograd.grad(out.logits[:, -1].sum(), live2.records[0])
    assert float(g.abs().max()) > 0


def test_sites_the_model_lacks_are_refused_before_any_change(tiny_llama, enc):
    for site, match in (("pos_embed", "no absolute position embedding"), ("attn_out_pre_norm", "no norm")):
        with pytest.raises(ValueError, match=match):
            with editing(tiny_llama, [ActivationRecorder(site, 0)]):
                pass
    with pytest.raises(ValueError, match="read only"):
        with editing(tiny_llama, [ActivationEdit("ln_final.normalized", 0, lambda x, c: x * 0)]):
            forward(tiny_llama, enc)
    with pytest.raises(ValueError, match="unknown activation site"):
        ActivationEdit("hook_resid_mid", 0)
    with pytest.raises(ValueError, match="no head axis"):
        ActivationEdit("resid_mid", 0, heads=[0])
    with pytest.raises(ValueError, match="unknown KV head"):
        with editing(tiny_llama, [ActivationRecorder("k", 0, rows=None), ActivationEdit("k", 0, heads=[3])]):
            pass
    assert not engine_state.INSTALLED


def test_parallel_block_has_no_resid_mid_and_post_norm_sites():
    phi = tiny_family_model("phi")
    with pytest.raises(ValueError, match="parallel"):
        with editing(phi, [ActivationRecorder("resid_mid", 0)]):
            pass
    # OLMo 2: attn_out is the post-norm's output (the value added), attn_out_pre_norm its input
    olmo = tiny_family_model("olmo2")
    ids, mask = family_inputs()
    sites = ("residual", "attn_out", "attn_out_pre_norm", "resid_mid", "ln1_post.scale")
    recs = [ActivationRecorder(s, 1) for s in sites]
    with editing(olmo, recs):
        olmo.model(input_ids=ids, attention_mask=mask)
    pre, out, raw, mid, scale = (r.records[0] for r in recs)
    assert torch.equal(mid, pre + out)
    norm = olmo.layers[1].post_attention_layernorm
    torch.testing.assert_close(out, norm(raw), atol=0, rtol=0)
    torch.testing.assert_close(out, norm.weight * raw / scale, atol=1e-5, rtol=0)  # the frozen scale
    with pytest.raises(ValueError, match="no ln1 norm"):  # OLMo 2's attention reads the raw stream
        with editing(olmo, [ActivationRecorder("ln1.scale", 0)]):
            pass


def test_forward_output_attentions_gives_the_patterns_in_and_out_of_editing(tokenizer, enc):
    """On an SDPA model (whose kernel returns no pattern) `output_attentions=True` gave an empty
    tuple outside `editing()` and the patterns inside; now both give them, equal to the eager
    model's own `attentions` (the same weights) on the real query rows."""
    from tests.support import ZeroRow

    sdpa, eager = make_tiny("llama", tokenizer), make_tiny("llama", tokenizer, attn="eager")
    real = enc.attention_mask.bool()
    with torch.no_grad():
        want = eager.model(
            input_ids=enc.input_ids,
            attention_mask=enc.attention_mask,
            position_ids=(enc.attention_mask.cumsum(-1) - 1).clamp(min=0),
            output_attentions=True,
        ).attentions
    outside = forward(sdpa, enc, output_attentions=True)
    with editing(sdpa, [Recorder(layer=0)]):
        inside = forward(sdpa, enc, output_attentions=True)
    assert torch.equal(outside.logits, forward(sdpa, enc))
    for out in (outside, inside):
        assert len(out.attentions) == sdpa.n_layers
        for got, ref in zip(out.attentions, want, strict=True):
            for b in range(len(PROMPTS)):  # padded query rows: zeros here, uniform in eager
                torch.testing.assert_close(got[b][:, real[b]], ref[b][:, real[b]], atol=1e-6, rtol=0)
    with editing(sdpa, [ZeroRow(layer=1, heads=[2])]):  # the edited pattern, as the model used it
        edited = forward(sdpa, enc, output_attentions=True).attentions
    assert torch.all(edited[1][:, 2] == 0) and torch.equal(edited[0], outside.attentions[0])
