"""Path patching equals the three-run procedure of Wang et al. (2022, Sec. 3.1) written plainly:
whole-model forwards with forward hooks, one sender at a time, in fp32 on left-padded pairs."""

from __future__ import annotations

import pytest
import torch

from heads import SweepOptions
from heads.inputs.prompts import position_ids
from heads.scorers.patching import path_patch
from heads.scorers.patching.activation import _qkv_modules, _qkv_slices
from heads.scorers.patching.metrics import get_metric
from heads.scorers.patching.pairs import encode_pairs
from tests.support import make_tiny
from tests.support.patching import PAIRS, state_copy

OPTS = SweepOptions(max_rows=7, progress=False)


@torch.no_grad()
def _plain(model, pairs, ids, z_fn=None, mlp_fn=None, proj_fn=None):
    """One whole-model forward of `ids`; hooks: `z_fn(layer, z [N, T, H, d]) -> z`, `mlp_fn(layer, out)`,
    `proj_fn(layer, j, out)` (j = 0/1/2: q/k/v projection output, fused: the whole output).
    Returns (last logits [N, V], {layer: {j: projection output}}, {layer: z}, {layer: mlp out})."""
    H, d = model.n_heads, model.d_head
    seen_proj: dict = {}
    seen_z: dict = {}
    seen_mlp: dict = {}
    hs = []
    for la in range(model.n_layers):

        def zpre(mod, args, la=la):
            x = args[0].reshape(*args[0].shape[:-1], H, d)
            if z_fn is not None:
                x = z_fn(la, x.clone())
            seen_z[la] = x.clone()
            return (x.reshape(args[0].shape),)

        def mpost(mod, args, out, la=la):
            o = mlp_fn(la, out) if mlp_fn is not None else out
            seen_mlp[la] = o.clone()
            return o

        hs += [
            model.out_projs[la].register_forward_pre_hook(zpre),
            model.mlp(la).register_forward_hook(mpost),
        ]
        mods = _qkv_modules(model, la)
        for j, mod in enumerate(mods):
            if j and mod is mods[0]:
                continue

            def ppost(mod, args, out, la=la, j=j):
                o = proj_fn(la, j, out) if proj_fn is not None else out
                seen_proj.setdefault(la, {})[j] = o.clone()
                return o

            hs.append(mod.register_forward_hook(ppost))
    try:
        out = model.model(
            input_ids=ids,
            attention_mask=pairs.attention_mask,
            position_ids=position_ids(pairs.attention_mask),
        )
    finally:
        for h in hs:
            h.remove()
    return out.logits[:, -1].float(), seen_proj, seen_z, seen_mlp


_RUN1: dict = {}


def _three_run(model, pairs, sender, receivers, inputs, mlp, direction, positions):
    """The metric logits of the three-run procedure for one sender (plain hooks, whole model)."""
    base_ids, src_ids = (
        (pairs.clean_ids, pairs.corrupted_ids)
        if direction == "noising"
        else (pairs.corrupted_ids, pairs.clean_ids)
    )
    key = (id(model), id(pairs), direction)
    if key not in _RUN1:
        _RUN1.clear()
        _RUN1[key] = (_plain(model, pairs, base_ids), _plain(model, pairs, src_ids))  # run 1
    (_, _, z_base, mlp_base), (_, _, z_src, _) = _RUN1[key]
    ls, hs_ = sender
    cols = slice(None) if positions is None else positions

    def z2(la, z):  # every head frozen to the base run, the sender from the source run
        z = z_base[la].clone()
        if la == ls:
            z[:, cols, hs_] = z_src[la][:, cols, hs_]
        return z

    mlp2 = (lambda la, out: mlp_base[la]) if mlp == "frozen" else None
    logits2, proj2, _, _ = _plain(model, pairs, base_ids, z_fn=z2, mlp_fn=mlp2)  # run 2
    if receivers == "logits":
        return logits2
    d = model.d_head
    sls = _qkv_slices(model)

    def proj3(la, j, out):  # run 3: only the receivers' inputs from run 2
        o = out.clone()
        for lr, h in receivers:
            if lr != la:
                continue
            for c in inputs:
                jc = "qkv".index(c)
                if _qkv_modules(model, la)[jc] is not _qkv_modules(model, la)[j]:
                    continue
                a = sls[jc].start + h * d
                o[..., a : a + d] = proj2[la][j][..., a : a + d]
        return o

    return _plain(model, pairs, base_ids, proj_fn=proj3)[0]


def _check(
    model,
    pairs,
    senders=None,
    receivers="logits",
    inputs="q",
    mlp="recompute",
    direction="noising",
    positions=None,
):
    before = state_copy(model)
    res = path_patch(
        model,
        pairs,
        senders,
        receivers,
        inputs=inputs,
        mlp=mlp,
        direction=direction,
        positions=positions,
        options=OPTS,
    )
    assert all(torch.equal(v, before[k]) for k, v in model.model.state_dict().items())
    met = get_metric()
    idx = torch.arange(pairs.n)
    clean_logits = _plain(model, pairs, pairs.clean_ids)[0]
    comps = (inputs,) if isinstance(inputs, str) else tuple(inputs)
    poss = res.params["positions"]
    worst = 0.0
    for la, h in [tuple(s) for s in res.params["senders"]]:
        want = met(
            _three_run(model, pairs, (la, h), receivers, comps, mlp, direction, poss),
            pairs,
            idx,
            clean_logits,
        )
        worst = max(worst, float((res.raw[la, h] - want).abs().max()))
    assert worst < 1e-5, worst
    return res


def test_llama_gqa_logits_all_senders(tokenizer):
    model = make_tiny("llama", tokenizer)  # GQA 4:2, 3 layers
    pairs = encode_pairs(tokenizer, PAIRS)
    assert (pairs.attention_mask == 0).any()  # left padding
    res = _check(model, pairs)
    assert not torch.isnan(res.raw).any() and res.raw.shape == (3, 4, 2)
    hs = res.head_scores()
    assert hs.method == "patching.path" and hs.params["receivers"] == "logits"


@pytest.mark.parametrize(
    ("receivers", "inputs", "mlp", "positions"),
    [
        ([(2, 0), (2, 3)], "q", "recompute", None),
        ([(1, 1), (2, 0)], "k", "frozen", None),  # KV heads under GQA
        ([(2, 1)], ["k", "v"], "recompute", [-3, -1]),
    ],
)
def test_llama_gqa_head_receivers(tokenizer, receivers, inputs, mlp, positions):
    model = make_tiny("llama", tokenizer)
    pairs = encode_pairs(tokenizer, PAIRS)
    res = _check(
        model,
        pairs,
        senders=[(0, 1), (0, 2), (1, 3), (2, 0)],
        receivers=receivers,
        inputs=inputs,
        mlp=mlp,
        positions=positions,
    )
    assert torch.isnan(res.raw[0, 0]).all()  # not a sender
    # a sender in the last receiver layer has no path: the base (clean) metric
    assert torch.equal(res.raw[2, 0], res.clean)


@pytest.mark.parametrize("receivers", ["logits", [(1, 1), (1, 3)]])
def test_gpt2_denoising_frozen(tokenizer, receivers):
    model = make_tiny("gpt2", tokenizer)  # absolute positions, fused QKV
    pairs = encode_pairs(tokenizer, PAIRS)
    _check(
        model,
        pairs,
        senders=[0] if receivers != "logits" else None,
        receivers=receivers,
        inputs="v" if receivers != "logits" else "q",  # the logits take no inputs
        mlp="frozen",
        direction="denoising",
    )


def test_bad_input_before_forward(tokenizer):
    model = make_tiny("llama", tokenizer)
    pairs = encode_pairs(tokenizer, PAIRS)
    calls = []
    h = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match="unknown layer 7"):
            path_patch(model, pairs, senders=[(7, 0)])
        with pytest.raises(ValueError, match="head 5"):
            path_patch(model, pairs, receivers=[(2, 5)])
        with pytest.raises(ValueError, match="head 3"):
            path_patch(model, pairs, receivers=[(2, 3)], inputs="k")  # only 2 KV heads
        with pytest.raises(ValueError, match="position 99 is out of range"):
            path_patch(model, pairs, positions=[99])
        with pytest.raises(ValueError, match="unknown receiver input 'z'"):
            path_patch(model, pairs, receivers=[(2, 0)], inputs="z")
        with pytest.raises(ValueError, match="receivers must be 'logits'"):
            path_patch(model, pairs, receivers="resid")
        with pytest.raises(ValueError, match="mlp must be"):
            path_patch(model, pairs, mlp="skip")
        with pytest.raises(ValueError, match="mix q"):
            path_patch(model, pairs, receivers=[(2, 0)], inputs=["q", "k"])
    finally:
        h.remove()
    assert not calls
