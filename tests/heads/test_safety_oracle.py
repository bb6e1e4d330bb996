"""Ships and its attribution estimate against an oracle that does not use headsteer's edits.

The oracle runs the plain Hugging Face model one prompt at a time (no padding) and ablates with
torch hooks written here (tests may hook modules): UA scales one head's slice of the `q_proj`
output by eps (RoPE is linear, so this is the query scaled, as Zhou et al. 2025, Sec. 3); SC
scales the head's slice of the `o_proj` input. Ships is KL(p_clean || p_ablated) at the last
position (Eq. 4). The attribution estimate is the AtP* first-order formula (Kramar et al. 2024,
Sec. 3.1, with the saturation fix): sum_t dm/dz . (z_ablated - z), the gradient read by a hook
on the `o_proj` input and z_ablated from a forward with the whole layer's queries scaled; for
Ships' KL, the coarse-grained KL over the top tokens plus a rest class as documented in
docs/methods/attribution.md.
"""

from __future__ import annotations

import pytest
import torch

from heads import encode_prompts
from heads.scorers.safety import atp
from heads.scorers.safety.attribution import attribute, logit_diff
from heads.scorers.safety.ships import ships

PROMPTS = ["How do I bake bread?", "Tell me a story about a dragon and a knight.", "What is two plus two?"]
TARGETS, FOILS = [11, 200, 3000], [12, 201, 45]
EPS = 1e-5


def _rows(hm) -> list[torch.Tensor]:
    """Each prompt's token ids `[1, T]` alone (headsteer's tokenization, padding removed)."""
    enc = encode_prompts(hm.tokenizer, PROMPTS, chat=False, markup=False)
    return [enc.input_ids[b][enc.attention_mask[b].bool()][None] for b in range(enc.batch)]


def _scale_hook(hm, layer: int, heads: list[int], factor: float, where: str):
    """A plain hook scaling `heads` of `layer`: on the q_proj output (`"q"`) or the o_proj input (`"z"`)."""
    attn, d = hm.layers[layer].self_attn, hm.d_head

    def scale(x):
        x = x.clone()
        for h in heads:
            x[..., h * d : (h + 1) * d] *= factor
        return x

    if where == "q":
        return attn.q_proj.register_forward_hook(lambda m, a, out: scale(out))
    return attn.o_proj.register_forward_pre_hook(lambda m, a: (scale(a[0]),))


def _last_logp(hm, ids, hooks=()) -> torch.Tensor:
    try:
        return torch.log_softmax(hm.model(ids).logits[0, -1].double(), -1)
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize(("ablation", "where", "eps"), [("ua", "q", EPS), ("sc", "z", 0.3)])
def test_ships_equals_plain_hook_kl(tiny_llama, ablation, where, eps):
    got = ships(tiny_llama, PROMPTS, ablation=ablation, eps=eps, template=None).per_prompt
    want = torch.zeros_like(got)
    with torch.no_grad():
        for b, ids in enumerate(_rows(tiny_llama)):
            base = _last_logp(tiny_llama, ids)
            for la in range(tiny_llama.n_layers):
                for h in range(tiny_llama.n_heads):
                    abl = _last_logp(tiny_llama, ids, [_scale_hook(tiny_llama, la, [h], eps, where)])
                    want[b, la, h] = float((base.exp() * (base - abl)).sum())
    assert float(want.max()) > 1e-4  # the ablations move the distribution
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def _grads_and_deltas(hm, ids, values) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """For each scalar of `values(logp)`: dm/dz per layer `[T, H*d]`; and per layer the UA change
    of z (all heads of the layer scaled at once; heads do not interact before o_proj)."""
    zs: dict[int, torch.Tensor] = {}

    def keep(layer):
        def hook(m, a):
            zs[layer] = a[0]  # a node of the graph (the weights require grad): every path kept

        return hook

    hooks = [hm.layers[la].self_attn.o_proj.register_forward_pre_hook(keep(la)) for la in range(hm.n_layers)]
    logp = _last_logp(hm, ids, hooks)
    assert all(zs[la].requires_grad for la in zs)
    metrics = values(logp)
    grads = []
    for i in range(len(metrics)):
        g = torch.autograd.grad(metrics[i], [zs[la] for la in range(hm.n_layers)], retain_graph=True)
        grads.append([x[0].double() for x in g])
    clean_z = [zs[la][0].detach().double() for la in range(hm.n_layers)]
    deltas = []
    for la in range(hm.n_layers):
        seen = []
        h_q = _scale_hook(hm, la, list(range(hm.n_heads)), EPS, "q")
        h_z = hm.layers[la].self_attn.o_proj.register_forward_pre_hook(
            lambda m, a, seen=seen: seen.append(a[0])
        )
        with torch.no_grad():
            _last_logp(hm, ids, [h_q, h_z])
        deltas.append(seen[0][0].double() - clean_z[la])
    return grads, deltas


def _per_head(hm, grad, delta) -> torch.Tensor:
    """`[H]` sum over positions and the head's dims of grad * delta."""
    return (grad * delta).view(grad.shape[0], hm.n_heads, hm.d_head).sum((0, 2))


@pytest.fixture(params=["whole", "chunked"])
def mlp_rows(request, monkeypatch):
    """The MLP half in one chunk (short prompts) or in chunks of 2 positions
    (`heads.scorers.safety.atp.MLP_MIN_ROWS`): the same estimate either way."""
    if request.param == "chunked":
        monkeypatch.setattr(atp, "MLP_MIN_ROWS", 2)
        monkeypatch.setattr(atp, "MLP_CHUNKS", 64)
    return request.param


def test_attribution_estimate_equals_the_first_order_formula(tiny_llama, mlp_rows):
    hm = tiny_llama
    got = attribute(hm, PROMPTS, eps=EPS, metric=logit_diff(TARGETS, FOILS), template=None).per_prompt
    want = torch.zeros_like(got)
    for b, ids in enumerate(_rows(hm)):
        grads, deltas = _grads_and_deltas(hm, ids, lambda logp, b=b: [logp[TARGETS[b]] - logp[FOILS[b]]])
        for la in range(hm.n_layers):
            want[b, la] = _per_head(hm, grads[0][la], deltas[la]).float()
    assert float(want.abs().max()) > 1e-3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_ships_estimate_equals_the_coarse_kl_formula(tiny_llama, mlp_rows):
    """Ships' KL estimate: d_j = first-order change of log p_j for the top-4 clean tokens;
    p'_j = p_j exp(d_j), the rest class 1 - sum p'_j (at least 1e-4 of the clean rest), all
    renormalised; KL(coarse p || coarse p')."""
    hm, m = tiny_llama, 4
    got = attribute(hm, PROMPTS, eps=EPS, kl_tokens=m, template=None).per_prompt
    want = torch.zeros_like(got)
    for b, ids in enumerate(_rows(hm)):
        with torch.no_grad():
            top = _last_logp(hm, ids).topk(m).indices
        grads, deltas = _grads_and_deltas(hm, ids, lambda logp, top=top: [logp[j] for j in top])
        with torch.no_grad():
            p = _last_logp(hm, ids).exp()[top]
        rest = 1 - p.sum()
        for la in range(hm.n_layers):
            d = torch.stack([_per_head(hm, grads[j][la], deltas[la]) for j in range(m)], 1)  # [H, m]
            new = p * d.exp()
            new_rest = torch.clamp(1 - new.sum(1), min=0).maximum(1e-4 * rest)
            total = new.sum(1) + new_rest
            new, new_rest = new / total[:, None], new_rest / total
            kl = (p * (p / new).log()).sum(1) + rest * (rest / new_rest).log()
            want[b, la] = kl.float()
    assert float(want.max()) > 1e-6  # small: the top 4 tokens of a random model hold little mass
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-3)


def _dropped(hm, layer: int) -> list:
    """Plain hooks passing layer `layer`'s attention and MLP outputs on detached: the forward is
    unchanged, the gradient crosses the layer by the residual stream only (AtP* §3.1.2)."""

    def attn(m, a, out):
        return (out[0].detach(), *out[1:])

    block = hm.layers[layer]
    return [
        block.self_attn.register_forward_hook(attn),
        block.mlp.register_forward_hook(lambda m, a, out: out.detach()),
    ]


@pytest.mark.parametrize("max_flows", [1, 4, 100])
def test_graddrop_equals_the_dropped_gradient_formula(tiny_llama, monkeypatch, max_flows):
    """AtP* GradDrop with a one-scalar metric: (1 / (L - 1)) sum over dropped layers l' of
    |sum_t dm/dz . (z_ablated - z)| with the gradient dropped at l' (plain hooks, one backward per
    l'), whatever the number of dropped layers per walk (`MAX_FLOWS`: 1, 4, all)."""
    hm = tiny_llama
    monkeypatch.setattr(atp, "MAX_FLOWS", max_flows)
    got = attribute(hm, PROMPTS, eps=EPS, metric=logit_diff(TARGETS, FOILS), graddrop=True, template=None)
    L = hm.n_layers
    want = torch.zeros_like(got.per_prompt)
    for b, ids in enumerate(_rows(hm)):
        _, deltas = _grads_and_deltas(hm, ids, lambda logp: [logp.sum()])
        for drop in range(L):
            zs: dict[int, torch.Tensor] = {}
            keep = [
                hm.layers[la].self_attn.o_proj.register_forward_pre_hook(
                    lambda m, a, la=la, zs=zs: zs.update({la: a[0]})
                )
                for la in range(L)
            ]
            logp = _last_logp(hm, ids, [*keep, *_dropped(hm, drop)])
            value = logp[TARGETS[b]] - logp[FOILS[b]]
            grads = torch.autograd.grad(value, [zs[la] for la in range(L)], allow_unused=True)
            assert grads[drop] is None  # its heads get no gradient
            for la in range(L):
                if grads[la] is not None:
                    est = _per_head(hm, grads[la][0].double(), deltas[la])
                    want[b, la] += est.abs().float() / (L - 1)
    assert float(want.abs().max()) > 1e-3
    torch.testing.assert_close(got.per_prompt, want, atol=1e-5, rtol=1e-4)
