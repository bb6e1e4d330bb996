"""Circuit graphs on the post-norm families (Gemma 2, Gemma 3, OLMo 2) under the frozen-scale
convention: a head's output is `gain * z_h W_O[h] / s` with `s` the post-attention norm's scale
in the run (per position), an MLP's output is its post-norm's output.

Oracles: the model's own forward (the shares add up to the residual stream, the decomposed
forward gives the model's logits, every edge corrupted gives the corrupted run) and plain hooks
on the Hugging Face modules for one edge (exact patching and its EAP score), written here
without headsteer's code.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from heads.errors import HeadsteerValueError
from heads.inputs.prompts import position_ids
from heads.scorers.circuits import edge_scores, exact_scores, graph_of
from heads.scorers.circuits.graph import run_graph
from heads.scorers.patching import pairs_from_tokens
from tests.support.families import WINDOW, tiny_family_model

torch.set_num_threads(1)
KINDS = ["gemma2", "gemma3_text", "olmo2"]


def _pairs(n: int = 2, t: int = WINDOW + 3, seed: int = 1):
    """Pairs longer than the tiny models' sliding window (one shorter: left padding)."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(3, 300, (n, t), generator=g).tolist()
    corr = [list(r) for r in clean]
    for r in corr:
        r[1] = int(torch.randint(3, 300, (1,), generator=g))
        r[-3] = int(torch.randint(3, 300, (1,), generator=g))
    clean[0], corr[0] = clean[0][1:], corr[0][1:]
    return pairs_from_tokens(clean, corr, list(range(5, 5 + n)), list(range(40, 40 + n)))


def _logits(m, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        out = m.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))
    return out.logits[:, -1].float()


@pytest.fixture(scope="module", params=KINDS)
def model(request):
    return tiny_family_model(request.param)


def test_shares_add_up_to_the_stream_and_the_logits(model):
    m = model
    g = graph_of(m)
    p = _pairs()
    ids, corr_ids, mask = p.clean_ids, p.corrupted_ids, p.attention_mask
    with torch.no_grad():
        _, rc = run_graph(m, g, ids, mask, record=True)
        _, rx = run_graph(m, g, corr_ids, mask, record=True)
    acts = rc.acts()
    w_o = [m.layer_weights(la)["W_O"] for la in range(g.n_layers)]
    up = acts.upstream(w_o)  # [U, R, T, D]
    real = mask.bool()
    total = acts.input.clone()
    for la in range(g.n_layers):
        a, b = g.head_node(la, 0), g.mlp_node(la) + 1
        total = total + up[a:b].sum(0)
        want = acts.resid[la]
        err = float((total - want)[real].abs().max())
        assert err <= 1e-5 * float(want[real].abs().max()), (la, err)
    everything = g.valid[None].expand(p.n, -1, -1)
    with torch.no_grad():
        same, _ = run_graph(m, g, ids, mask, patch=everything, corr=acts)
        allx, _ = run_graph(m, g, ids, mask, patch=everything, corr=rx.acts())
    ref, ref_corr = _logits(m, ids, mask), _logits(m, corr_ids, mask)
    assert float((ref - ref_corr).abs().max()) > 1e-3
    assert float((same - ref).abs().max()) < 1e-5
    assert float((allx - ref_corr).abs().max()) < 1e-5


def _gain(m, norm) -> torch.Tensor:
    w = norm.weight.detach().float()
    return 1.0 + w if "gemma" in m.family.model_type else w


def _oracle(m, p, head: int, target: str) -> tuple[float, float]:
    """`(exact, eap)` of edge head (0, head) -> `target` ("mlp1" or "logits") by plain hooks.

    The head's output is `gain * z_h W_O[h] / s` with `s = sqrt(mean(a^2) + eps)` of the
    post-attention norm's input `a` in the same run; the difference of the corrupted and the
    clean share is added to the target's input (the MLP's input in layer 1, the final norm's
    input), and the gradient of the metric at that input gives the EAP score."""
    block0 = m.model.model.layers[0]
    post = block0.post_attention_layernorm
    eps = post.variance_epsilon if hasattr(post, "variance_epsilon") else post.eps
    w_o = block0.self_attn.o_proj.weight.detach().T  # [H d, D]
    d = m.d_head
    share = {}
    box: dict = {}
    for name, ids in (("clean", p.clean_ids), ("corr", p.corrupted_ids)):
        h1 = block0.self_attn.o_proj.register_forward_pre_hook(lambda mod, a: box.update(z=a[0]))
        h2 = post.register_forward_pre_hook(lambda mod, a: box.update(a=a[0]))
        _logits(m, ids, p.attention_mask)
        h1.remove()
        h2.remove()
        s = (box["a"].float().pow(2).mean(-1, keepdim=True) + eps).sqrt()
        zh = box["z"][..., head * d : (head + 1) * d]
        share[name] = _gain(m, post) * (zh @ w_o[head * d : (head + 1) * d]) / s
    delta = share["corr"] - share["clean"]
    block1 = m.model.model.layers[1]
    where: nn.Module = (
        block1.pre_feedforward_layernorm if hasattr(block1, "pre_feedforward_layernorm") else block1.mlp
    )
    if target == "logits":
        where = m.model.model.norm
    idx = torch.arange(p.n)

    def metric(logits):
        return (logits[idx, p.answers[:, 0]] - logits[idx, p.counterfactuals[:, 0]]).mean()

    def run(add):
        h = where.register_forward_pre_hook(lambda mod, a: (a[0] + add, *a[1:]))
        try:
            mask = p.attention_mask
            out = m.model(input_ids=p.clean_ids, attention_mask=mask, position_ids=position_ids(mask))
        finally:
            h.remove()
        return metric(out.logits[:, -1].float())

    with torch.no_grad():
        exact = float(run(delta) - run(torch.zeros_like(delta)))
    zero = torch.zeros_like(delta, requires_grad=True)
    (grad,) = torch.autograd.grad(run(zero), zero)
    eap = float((grad * delta * p.attention_mask[..., None]).sum())  # the metric is the mean
    return exact, eap


@pytest.mark.parametrize("target", ["mlp1", "logits"])
def test_one_edge_equals_plain_hooks(model, target):
    m = model
    g = graph_of(m)
    p = _pairs()
    head = 1
    v = g.mlp_input(1) if target == "mlp1" else g.logits_input
    edges = torch.tensor([[g.head_node(0, head), v]])
    ex = exact_scores(m, p, edges=edges, progress=False).scores[edges[0, 0], edges[0, 1]].item()
    eap = edge_scores(m, p, method="eap", progress=False).scores[edges[0, 0], edges[0, 1]].item()
    want_exact, want_eap = _oracle(m, p, head, target)
    assert abs(want_exact) > 1e-5 and abs(want_eap) > 1e-5
    assert ex == pytest.approx(want_exact, abs=1e-5, rel=1e-4)
    assert eap == pytest.approx(want_eap, abs=1e-5, rel=1e-4)


def test_post_norm_on_the_transformer_lens_backend_is_refused_by_name(monkeypatch):
    m = tiny_family_model("gemma2")
    monkeypatch.setattr(m.backend, "kind", "transformer_lens")
    with pytest.raises(HeadsteerValueError, match="model_type 'gemma2'.*transformer_lens"):
        graph_of(m)


@pytest.mark.real
def test_real_gemma3_shares_add_up_and_one_edge_is_exact(gemma3):
    """On the real Gemma-3-270m (post-norms, QK-norm, sliding windows): the shares add up to the
    stream, the decomposed forward gives the model's logits, and one edge's exact and EAP scores
    equal the plain-hook computation."""
    from tests.support.real_models import GEMMA3_PROMPT

    ids = gemma3.tokenizer(GEMMA3_PROMPT, return_tensors="pt").input_ids[0, :12].tolist()
    corr = list(ids)
    corr[3] = gemma3.tokenizer(" banana", add_special_tokens=False).input_ids[0]
    with torch.no_grad():
        top = gemma3.model(input_ids=torch.tensor([ids])).logits[0, -1].topk(2).indices.tolist()
    p = pairs_from_tokens([ids], [corr], [top[0]], [top[1]])
    g = graph_of(gemma3)
    mask = p.attention_mask
    with torch.no_grad():
        _, rc = run_graph(gemma3, g, p.clean_ids, mask, record=True)
    acts = rc.acts()
    w_o = [gemma3.layer_weights(la)["W_O"] for la in range(g.n_layers)]
    total = acts.input.float() + sum(
        acts.head_out(la, w_o[la]).sum(0).float() + acts.mlp[la].float() for la in range(g.n_layers)
    )
    final = acts.resid[-1].float()
    assert float((total - final).abs().max()) <= 1e-4 * float(final.abs().max())
    everything = g.valid[None]
    with torch.no_grad():
        same, _ = run_graph(gemma3, g, p.clean_ids, mask, patch=everything, corr=acts)
    ref = _logits(gemma3, p.clean_ids, mask)
    assert float((same - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
    sc = edge_scores(gemma3, p, method="eap", progress=False).scores
    v = g.mlp_input(1)
    head = int(sc[g.head_node(0, 0) : g.head_node(0, g.n_heads), v].abs().argmax())  # the strongest
    edges = torch.tensor([[g.head_node(0, head), v]])
    ex = exact_scores(gemma3, p, edges=edges, progress=False).scores[edges[0, 0], edges[0, 1]].item()
    want_exact, want_eap = _oracle(gemma3, p, head, "mlp1")
    assert abs(want_eap) > 1e-3
    assert sc[edges[0, 0], edges[0, 1]].item() == pytest.approx(want_eap, rel=1e-3)
    # the exact effect is a difference of large logits: within a few of their float32 steps
    ulp = float(torch.finfo(torch.float32).eps * ref.abs().max())
    assert ex == pytest.approx(want_exact, abs=4 * ulp)
