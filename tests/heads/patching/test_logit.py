"""Direct logit attribution, the logit lens and per-head logits against plain hooked computations."""

from __future__ import annotations

import pytest
import torch

from heads.errors import HeadsteerValueError
from heads.inputs.prompts import position_ids
from heads.scorers.patching.logit import direct_logit_attribution, head_logits, logit_inspection, logit_lens
from heads.scorers.patching.pairs import PromptPair, encode_pairs
from tests.support import make_tiny

PAIRS = [
    PromptPair("Then, Mary and John walked to the park. John handed a ball to",
               "Then, Anna and Tom walked to the park. Paul handed a ball to", " Mary", " John"),
    PromptPair("After Anna and Tom left, Tom thanked",
               "After Kate and Ben left, Sam thanked", " Anna", " Tom"),
]  # fmt: skip


@torch.no_grad()
def _plain(model, pairs):
    """One hooked forward: last-position logits [N, V], the final norm's input [N, T, D] and
    every o_proj input [N, T, H*d]."""
    box, z = {}, {}
    hs = [model.final_norm.register_forward_pre_hook(lambda m, a: box.__setitem__("x", a[0].clone()))]
    for la, proj in enumerate(model.out_projs):
        hs.append(proj.register_forward_pre_hook(lambda m, a, la=la: z.__setitem__(la, a[0].clone())))
    try:
        out = model.model(
            input_ids=pairs.clean_ids,
            attention_mask=pairs.attention_mask,
            position_ids=position_ids(pairs.attention_mask),
        )
    finally:
        for h in hs:
            h.remove()
    return out.logits[:, -1].float(), box["x"], z


def _ld(logits, pairs):
    return logits.gather(1, pairs.answers[:, :1])[:, 0] - logits.gather(1, pairs.counterfactuals[:, :1])[:, 0]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_dla_sums_to_the_logit_difference_and_matches_a_hooked_oracle(tokenizer, kind):
    model = make_tiny(kind, tokenizer)
    pairs = encode_pairs(model, PAIRS)
    assert int(pairs.lengths.min()) < pairs.width  # a left-padded batch
    before = {k: v.clone() for k, v in model.model.state_dict().items()}
    res = direct_logit_attribution(model, pairs)
    assert all(torch.equal(v, before[k]) for k, v in model.model.state_dict().items())
    logits, x_final, z = _plain(model, pairs)
    ld = _ld(logits, pairs)
    torch.testing.assert_close(res.total()[:, -1], ld, atol=1e-5, rtol=0)
    torch.testing.assert_close(res.logit_diff[:, -1], ld, atol=1e-5, rtol=0)
    assert float(res.rest.abs().max()) < 1e-5  # heads + biases + MLPs + embeddings explain x_L
    # oracle for every head at the last position: the o_proj module applied to that head's
    # slice alone, then the final norm with its scale frozen from the run, then the unembedding
    norm, d = model.final_norm, model.d_head
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    x = x_final[:, -1]
    if kind == "gpt2":
        scale = (x.var(-1, unbiased=False) + eps).rsqrt()
    else:
        scale = (x.pow(2).mean(-1) + eps).rsqrt()
    du = model.W_U[:, pairs.answers[:, 0]].T - model.W_U[:, pairs.counterfactuals[:, 0]].T  # [N, D]
    proj_bias = lambda m: 0 if getattr(m, "bias", None) is None else m.bias  # noqa: E731
    for la in range(model.n_layers):
        for h in range(model.n_heads):
            zz = torch.zeros_like(z[la][:, -1])
            zz[:, h * d : (h + 1) * d] = z[la][:, -1, h * d : (h + 1) * d]
            o = model.out_projs[la](zz) - proj_bias(model.out_projs[la])
            if kind == "gpt2":
                o = o - o.mean(-1, keepdim=True)
            want = ((norm.weight * o * scale[:, None]) * du).sum(-1)
            torch.testing.assert_close(res.heads[:, la, h, -1], want, atol=1e-5, rtol=0)
    hs = res.head_scores()
    assert hs.scores.shape == (model.n_layers, model.n_heads) and len(res.labels) == pairs.width
    torch.testing.assert_close(hs.scores, res.heads[..., -1].mean(0))
    # padding columns carry nothing
    n_pad = pairs.width - int(pairs.lengths[1])
    assert float(res.heads[1, ..., :n_pad].abs().max()) == 0.0


def test_logit_lens_and_head_logits(tokenizer):
    model = make_tiny("llama", tokenizer)
    pairs = encode_pairs(model, PAIRS)
    lens = logit_lens(model, pairs, k=3)
    logits, x_final, _ = _plain(model, pairs)
    # the last lens layer is the model's own output
    torch.testing.assert_close(lens.logit_diff[:, -1], _ld(logits, pairs), atol=1e-5, rtol=0)
    assert lens.logit_diff.shape == (2, model.n_layers + 1) and len(lens.top_tokens) == model.n_layers + 1
    # layer 0's lens: final norm + unembedding of the embeddings
    emb = model.model.get_input_embeddings()(pairs.clean_ids[:, -1])
    l0 = model.unembed(model.final_norm(emb)).float()
    torch.testing.assert_close(
        lens.answer_logit[:, 0], l0.gather(1, pairs.answers[:, :1])[:, 0], atol=1e-5, rtol=0
    )
    ranks = (l0 > l0.gather(1, pairs.answers[:, :1])).sum(-1)
    assert lens.answer_rank[:, 0].tolist() == ranks.tolist()
    a, w = head_logits(model, pairs)
    dla = direct_logit_attribution(model, pairs)
    torch.testing.assert_close(a - w, dla.heads[..., -1], atol=1e-5, rtol=0)
    insp = logit_inspection(model, pairs)
    assert insp.head_answer is not None and insp.to_frame().shape[0] == model.n_layers + 1
    assert 0.0 <= float(insp.winner_share().min()) <= 1.0


def test_bad_input(tokenizer):
    model = make_tiny("llama", tokenizer)
    no_cf = encode_pairs(model, [PromptPair("Hello there my", "Hello where my", " friend")])
    with pytest.raises(HeadsteerValueError, match="counterfactual"):
        direct_logit_attribution(model, no_cf)
    pairs = encode_pairs(model, PAIRS)
    with pytest.raises(HeadsteerValueError, match="which"):
        direct_logit_attribution(model, pairs, which="dirty")
    with pytest.raises(HeadsteerValueError, match="position"):
        direct_logit_attribution(model, pairs).head_scores(position=99)


@pytest.mark.real
def test_dla_sums_to_the_logit_difference_on_the_embedded_model(smol):
    from probes.datasets.pairs import load_task_pairs

    pairs = encode_pairs(smol, load_task_pairs("ioi", n=4))
    res = direct_logit_attribution(smol, pairs)
    logits, _, _ = _plain(smol, pairs)
    torch.testing.assert_close(res.total()[:, -1], _ld(logits, pairs), atol=1e-4, rtol=0)


class _L1Norm(torch.nn.Module):
    """Divides by the mean absolute value: an eps attribute, but not an RMSNorm's function."""

    eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x.abs().mean(-1, keepdim=True) + self.eps)


class _Tanh(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


def test_norm_parts_reads_real_norms_and_refuses_other_functions(tokenizer):
    from heads.scorers.patching.logit import norm_parts

    model = make_tiny("llama", tokenizer)
    ln = torch.nn.LayerNorm(8, eps=1e-5)
    with torch.no_grad():
        ln.weight.copy_(torch.linspace(0.5, 2.0, 8))
        ln.bias.copy_(torch.linspace(-1.0, 1.0, 8))
    kind, gain, bias, eps = norm_parts(model, ln, 8)
    assert kind == "layer" and eps == 1e-5 and bias is not None
    torch.testing.assert_close(gain, ln.weight.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bias, ln.bias.detach(), atol=1e-6, rtol=0)
    for fake in (_L1Norm(), _Tanh()):  # both were read as an RMSNorm before the check
        with pytest.raises(HeadsteerValueError, match="cannot freeze its scale|cannot be frozen"):
            norm_parts(model, fake, 8)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "olmo2"])
def test_post_norm_dla_and_head_logits_equal_a_frozen_scale_oracle(family):
    """Post-norm families (issue 40 item 2): with the post-attention norm's and the final norm's
    scales frozen at their values in the run, head h's term is
    `g_f * (g_p * z_h W_O^h / sqrt(mean(y^2) + eps)) / sqrt(mean(x_L^2) + eps) . (W_U[a] - W_U[c])`
    (`y` the attention output, Gemma's gains `1 + weight`, OLMo 2's `weight`): computed here from
    plain hooks and the weights, not through the product."""
    from heads.scorers.patching import pairs_from_tokens
    from tests.support.families import tiny_family_model

    hm = tiny_family_model(family)
    m = hm.model
    cfg = m.config
    pairs = pairs_from_tokens(
        [[40, 41, 42, 43, 44, 45], [50, 51, 52, 53]],
        [[40, 47, 42, 43, 44, 45], [50, 58, 52, 53]],
        [20, 30],
        [21, 31],
    )

    def gain(norm):
        return norm.weight.detach() + (1.0 if "gemma" in family else 0.0)

    zs, box, hs = {}, {}, []
    blocks = m.model.layers
    for la, blk in enumerate(blocks):
        hs.append(
            blk.self_attn.o_proj.register_forward_pre_hook(lambda mod, a, la=la: zs.__setitem__(la, a[0]))
        )
    hs.append(m.model.norm.register_forward_pre_hook(lambda mod, a: box.__setitem__("x", a[0])))
    try:
        with torch.no_grad():
            m(input_ids=pairs.clean_ids, attention_mask=pairs.attention_mask,
              position_ids=position_ids(pairs.attention_mask))  # fmt: skip
    finally:
        for h in hs:
            h.remove()
    eps = cfg.rms_norm_eps
    x = box["x"][:, -1]  # [N, D]
    wu = m.lm_head.weight.detach()  # [V, D]
    direction = (wu[pairs.answers[:, 0]] - wu[pairs.counterfactuals[:, 0]]) * gain(m.model.norm)
    s_f = (x.pow(2).mean(-1) + eps).rsqrt()  # [N]
    H, d = hm.n_heads, hm.d_head
    want = torch.zeros(pairs.n, len(blocks), H)
    for la, blk in enumerate(blocks):
        w_o = blk.self_attn.o_proj.weight.detach()  # [D, H*d]
        z = zs[la][:, -1]  # [N, H*d]
        y = z @ w_o.T
        s_p = (y.pow(2).mean(-1) + eps).rsqrt()  # [N]
        for h in range(H):
            share = (z[:, h * d : (h + 1) * d] @ w_o[:, h * d : (h + 1) * d].T) * gain(
                blk.post_attention_layernorm
            )
            want[:, la, h] = (share * direction).sum(-1) * s_p * s_f
    dla = direct_logit_attribution(hm, pairs)
    torch.testing.assert_close(dla.heads[..., -1], want, atol=1e-5, rtol=0)
    a, w = head_logits(hm, pairs)
    torch.testing.assert_close(a - w, want, atol=1e-5, rtol=0)
    assert float(dla.attn_bias[..., -1].abs().max()) <= 1e-5  # no o_proj bias: the shares are all
    insp = logit_inspection(hm, pairs)  # no longer refused on post-norm families
    assert insp.head_answer is not None


@pytest.mark.real
def test_post_norm_dla_sums_to_the_logit_difference_on_gemma3(gemma3):
    """The second real model (Gemma 3 normalises its sub-layer outputs): DLA under the frozen
    post-norm scale adds up to the model's own logit difference; the heads' shares are the whole
    attention output (no o_proj bias)."""
    from probes.datasets.pairs import load_task_pairs

    pairs = encode_pairs(gemma3, load_task_pairs("ioi", n=2))
    assert bool(pairs.answer_mask.sum(-1).eq(1).all()) and bool(pairs.counterfactual_mask.sum(-1).eq(1).all())
    res = direct_logit_attribution(gemma3, pairs)
    with torch.no_grad():
        out = gemma3.model(
            input_ids=pairs.clean_ids,
            attention_mask=pairs.attention_mask,
            position_ids=position_ids(pairs.attention_mask),
        )
    want = _ld(out.logits[:, -1].float(), pairs)
    tol = 1e-3 * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(res.total()[:, -1], want, atol=tol, rtol=0)
    assert float(res.attn_bias[..., -1].abs().max()) <= tol
