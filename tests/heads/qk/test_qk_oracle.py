"""QK attribution against an independent oracle, family by family.

The oracle never calls the product. It runs the model with plain torch hooks and its own
attention function (registered with transformers' `AttentionInterface`) that captures the query
and key the attention receives (after QK-norm and RoPE) and the scale; the model's pre-softmax
score is `q . k * scaling` from that capture.

Then it builds the residual entering the layer from components read with hooks (embeddings,
each head's slice of the `o_proj` input times its `o_proj` columns, the MLP outputs; a post-norm
family's head outputs through its post-attention norm with the run's scale), checks they add up
to the layer's input, and pushes every component (and a zero row: the constant) through the
layer's own modules in one batch, with each norm's scale frozen at its value in the run
(`norm(x) * s(x) / s_run`: the module's own gain and conventions, only the scale replaced). The
captured query / key rows, minus the zero row, are each component's share; their products are
the terms. Checks: the oracle's terms add up to the model's score (1e-5, fp32); the product's
terms equal the oracle's (1e-5); the product's logits and `max_error` agree with the model.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch

from heads.scorers.qk import qk_attribution
from tests.support.families import tiny_family_model
from tests.support.qk_oracle import NAME, STATE, Stop, frozen, sigma, switch

TOL = 1e-5


def _o_weight(hm, layer):
    w = hm.out_projs[layer].weight.detach().float()
    return w if hm.family.conv1d else w.T  # [H*d, D]


def _oracle(hm, ids: torch.Tensor, layer: int):
    """(component names, residual-space components [C, T, D], q rows [C+1, H, T, d],
    k rows [C+1, G, T, d], real q [H, T, d], real k [G, T, d], scaling)."""
    m, fam = hm.model, hm.family
    T = ids.shape[1]
    H, d = hm.n_heads, hm.d_head
    post = "post_norm" in fam.features
    rec: dict = {"x": {}, "z": {}, "mlp": {}, "attn_pre": {}, "qn": None, "kn": None}
    restore = switch(hm, NAME)
    with ExitStack() as st:
        st.callback(restore)
        for la in range(layer + 1):
            block = hm.layers[la]

            def pre(mod, args, kwargs, la=la):
                rec["x"][la] = (args[0] if args else kwargs["hidden_states"]).detach().float()[0]

            st.callback(block.register_forward_pre_hook(pre, with_kwargs=True).remove)
            if la == layer:
                break

            def zh(mod, args, la=la):
                rec["z"][la] = args[0].detach().float()[0].reshape(T, H, d)

            st.callback(hm.out_projs[la].register_forward_pre_hook(zh).remove)
            mlp_mod = block.post_feedforward_layernorm if post else hm.mlp(la)

            def mh(mod, args, out, la=la):
                o = out[0] if isinstance(out, tuple) else out
                rec["mlp"][la] = o.detach().float()[0]

            st.callback(mlp_mod.register_forward_hook(mh).remove)
            if post:

                def ah(mod, args, la=la):
                    rec["attn_pre"][la] = args[0].detach().float()[0]

                st.callback(block.post_attention_layernorm.register_forward_pre_hook(ah).remove)
        attn = hm.attentions[layer]
        for nm in ("q_norm", "k_norm"):
            mod = getattr(attn, nm, None)
            if mod is not None:

                def nh(mod, args, nm=nm):
                    rec[nm[:2]] = args[0].detach().float()

                st.callback(mod.register_forward_pre_hook(nh).remove)
        STATE.update(layer=layer, stop=False)
        with torch.no_grad():
            m(input_ids=ids, use_cache=False)
    q_real, k_real, scaling = STATE["q"][0].float(), STATE["k"][0].float(), STATE["scaling"]

    # components of the residual entering `layer`
    names, comps = [], []
    x0 = rec["x"][0]
    wpe = getattr(hm.decoder, "wpe", None)
    if wpe is not None:
        pos = wpe.weight.detach().float()[:T]
        names += ["embed", "pos_embed"]
        comps += [x0 - pos, pos]
    else:
        names.append("embed")
        comps.append(x0)
    for la in range(layer):
        block = hm.layers[la]
        w = _o_weight(hm, la).reshape(H, d, -1)
        sig = sigma(block.post_attention_layernorm, rec["attn_pre"][la]) if post else None
        for h in range(H):
            r = rec["z"][la][:, h] @ w[h]
            if post:
                with torch.no_grad():
                    r = frozen(block.post_attention_layernorm, sig)(r)
            names.append(f"L{la}H{h}")
            comps.append(r)
        b = getattr(hm.out_projs[la], "bias", None)
        if b is not None:
            names.append(f"{la}_attn_bias")
            comps.append(b.detach().float().expand(T, -1))
        names.append(f"{la}_mlp_out")
        comps.append(rec["mlp"][la])
    stack = torch.stack(comps)
    assert (stack.sum(0) - rec["x"][layer]).abs().max() < TOL  # the components add up to the input

    # every component (and a zero row) through the layer with frozen scales
    block = hm.layers[layer]
    rows = torch.cat([stack, torch.zeros(1, T, stack.shape[-1])])
    norm_in = getattr(block, "input_layernorm", None) or getattr(block, "ln_1", None)
    with ExitStack() as st, torch.no_grad():
        st.callback(switch(hm, NAME))
        if norm_in is not None:
            norm_in.forward = frozen(norm_in, sigma(norm_in, rec["x"][layer]))
            st.callback(norm_in.__dict__.pop, "forward")
        for nm in ("q_norm", "k_norm"):
            mod = getattr(attn, nm, None)
            if mod is not None:
                mod.forward = frozen(mod, sigma(mod, rec[nm[:2]]))
                st.callback(mod.__dict__.pop, "forward")

        def replace(mod, args, kwargs):
            if args:
                return (rows.to(args[0].dtype), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": rows.to(kwargs["hidden_states"].dtype)}

        st.callback(block.register_forward_pre_hook(replace, with_kwargs=True).remove)
        STATE.update(layer=layer, stop=True)
        n = rows.shape[0]
        try:
            m(input_ids=ids.expand(n, -1), position_ids=torch.arange(T).expand(n, -1), use_cache=False)
        except Stop:
            pass
    return names, STATE["q"].float(), STATE["k"].float(), q_real, k_real, scaling


FAMILIES = [
    ("llama", {}),  # GQA 4:2, RoPE
    ("gpt2", {}),  # absolute positions, LayerNorm with mean and bias, biases everywhere
    ("qwen3", {}),  # QK-norm per head
    ("olmo2", {}),  # QK-norm over all heads, post-norm, no input norm
    ("gemma2", {}),  # soft-capping (decomposed before the cap), post-norm, sliding window
    ("gemma3_text", {}),  # per-head QK-norm with Gemma's 1 + w, local / global rotary
    ("gpt_oss", {}),  # learned sinks, MoE MLP
    ("phi3", {}),  # fused QKV
]


@pytest.mark.parametrize(("kind", "extra"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_terms_match_an_independent_oracle(kind, extra):
    init = 0.3 if kind == "gemma2" else 0.15
    hm = tiny_family_model(kind, "eager", initializer_range=init, **extra)
    ids = torch.randint(10, 300, (1, 9), generator=torch.Generator().manual_seed(3))
    layer, head, query = 1, 3, 8
    names, qo, ko, q_real, k_real, scaling = _oracle(hm, ids, layer)
    g = head // (hm.n_heads // hm.n_kv_heads)
    a = qo[:-1, head, query] - qo[-1:, head, query]  # each component's query share
    a = torch.cat([a, qo[-1:, head, query]])  # the constant last
    b = ko[:-1, g] - ko[-1:, g]  # [C, T, d]
    b = torch.cat([b, ko[-1:, g]])
    oracle_terms = torch.einsum("id,jkd->kij", a.double(), b.double()) * scaling  # [T, C+1, C+1]
    real = (q_real[head, query] @ k_real[g].T).double() * scaling  # [T] the model's pre-softmax score
    assert (oracle_terms.sum((1, 2)) - real).abs().max() < TOL

    r = qk_attribution(hm, ids, (layer, head), query=query)
    assert r.names == [*names, "bias"]
    for k in range(query + 1):
        assert (r.terms(0, query, k) - oracle_terms[k]).abs().max() < TOL, (kind, k)
    assert (r.score()[0, 0] - real[: query + 1]).abs().max() < TOL
    cap = STATE["softcap"]
    model_logits = real if cap is None else cap * torch.tanh(real / cap)
    assert (r.logits[0, 0].double() - model_logits[: query + 1]).abs().max() < TOL
    assert r.max_error() < TOL
    if kind == "gemma2":  # the cap acts: the sum before it differs from the capped logit
        assert cap is not None and float((r.score() - r.logits).abs().nan_to_num().max()) > 1e-3
    if kind == "gpt_oss":
        assert r.sink == pytest.approx(float(hm.attentions[layer].sinks[head]))
