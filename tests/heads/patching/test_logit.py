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
