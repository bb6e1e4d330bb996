"""Activation patching equals a plain per-site loop (one forward hook, whole model) in fp32."""

from __future__ import annotations

import pytest
import torch

from heads import SweepOptions
from heads.scorers.patching import lean
from heads.scorers.patching.activation import (
    PatchResult,
    _qkv_modules,
    _qkv_slices,
    patch,
    record_run,
    unembed_only,
)
from heads.scorers.patching.metrics import get_metric, token_columns
from heads.scorers.patching.pairs import PromptPair, encode_pairs
from tests.support import make_tiny
from tests.support.patching import PAIRS, state_copy

OPTS = SweepOptions(max_rows=16, progress=False)


@torch.no_grad()
def _oracle_run(model, pairs, ids, hooks):
    """The whole model, one forward, with `hooks` [(module, kind, fn)] installed."""
    hs = []
    for module, kind, fn in hooks:
        hs.append(module.register_forward_pre_hook(fn) if kind == "pre" else module.register_forward_hook(fn))
    try:
        from heads.inputs.prompts import position_ids

        out = model.model(
            input_ids=ids,
            attention_mask=pairs.attention_mask,
            position_ids=position_ids(pairs.attention_mask),
        )
    finally:
        for h in hs:
            h.remove()
    return out.logits[:, -1].float()


_RUNS: dict = {}


def _runs(model, pairs, pattern):
    key = (id(model), id(pairs), pattern)
    if key not in _RUNS:
        _RUNS.clear()
        _RUNS[key] = (
            record_run(model, pairs.clean_ids, pairs.attention_mask, pattern=pattern),
            record_run(model, pairs.corrupted_ids, pairs.attention_mask, pattern=pattern),
        )
    return _RUNS[key]


def _oracle(model, pairs, kind, layer, index, pos, direction="denoising"):
    clean, corrupt = _runs(model, pairs, kind == "pattern")
    base_ids = pairs.corrupted_ids if direction == "denoising" else pairs.clean_ids
    src = clean if direction == "denoising" else corrupt
    H, d = model.n_heads, model.d_head
    sel = slice(None) if pos < 0 else slice(pos, pos + 1)

    def z_pre(mod, args):
        x = args[0].clone().reshape(*args[0].shape[:-1], H, d)
        x[:, sel, index] = src.z[layer][:, sel, index]
        return (x.reshape(args[0].shape),)

    def out_fn(source):
        def hook(mod, args, out):
            o = (out[0] if isinstance(out, tuple) else out).clone()
            o[:, sel] = source[:, sel]
            return (o, *out[1:]) if isinstance(out, tuple) else o

        return hook

    def resid_pre(mod, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).clone()
        x[:, sel] = src.residuals[layer][:, sel]
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    if kind in ("head_out", "head_out_by_pos"):
        hooks = [(model.out_projs[layer], "pre", z_pre)]
    elif kind == "attn_out":
        hooks = [(model.attentions[layer], "post", out_fn(src.attn_out[layer]))]
    elif kind == "mlp_out":
        hooks = [(model.mlp(layer), "post", out_fn(src.mlp_out[layer]))]
    elif kind == "resid_pre":
        h = model.layers[layer].register_forward_pre_hook(resid_pre, with_kwargs=True)
        try:
            return _oracle_run(model, pairs, base_ids, [])
        finally:
            h.remove()
    elif kind in ("q", "k", "v"):
        j = "qkv".index(kind)
        sl = _qkv_slices(model)[j]
        cols = slice(sl.start + index * d, sl.start + (index + 1) * d)
        srcj = src.qkv[layer][j][..., index * d : (index + 1) * d]

        def proj(mod, args, out):
            o = out.clone()
            o[..., cols] = srcj
            return o

        hooks = [(_qkv_modules(model, layer)[j], "post", proj)]
    elif kind == "pattern":  # z_h = P_src[h] @ v (v of this run, recorded by a v-projection hook)
        seen = {}
        vj = _qkv_slices(model)[2]

        def keep_v(mod, args, out):
            seen["v"] = out[..., vj]

        def z_pattern(mod, args):
            x = args[0].clone().reshape(*args[0].shape[:-1], H, d)
            g = index // (model.n_heads // model.n_kv_heads)
            v = seen["v"][..., g * d : (g + 1) * d]  # [N, T, d]
            x[:, :, index] = torch.einsum("nqk,nkd->nqd", src.pattern[layer][:, index], v)
            return (x.reshape(args[0].shape),)

        hooks = [(_qkv_modules(model, layer)[2], "post", keep_v), (model.out_projs[layer], "pre", z_pattern)]
    return _oracle_run(model, pairs, base_ids, hooks)


def _check(model, pairs, kind, direction="denoising", layers=None, positions=None, **kw):
    before = state_copy(model)
    res = patch(
        model, pairs, kind, direction=direction, layers=layers, positions=positions, options=OPTS, **kw
    )
    assert all(torch.equal(v, before[k]) for k, v in model.model.state_dict().items())
    met = get_metric(kw.get("metric", "logit_diff"))
    idx = torch.arange(pairs.n)
    lays = res.params["layers"]
    poss = res.params["positions"]
    grid = res.raw
    clean_logits = record_run(model, pairs.clean_ids, pairs.attention_mask).logits
    worst = 0.0
    for li, la in enumerate(lays):
        if res.grid == ("layer", "position"):
            cells = [((li, pi), (-1, p)) for pi, p in enumerate(poss)]
        elif res.grid == ("layer", "head", "position"):
            cells = [((li, h, pi), (h, p)) for h in range(grid.shape[1]) for pi, p in enumerate(poss)]
        else:
            cells = [((li, h), (h, -1)) for h in range(grid.shape[1])]
        for cell, (index, pos) in cells:
            want = met(_oracle(model, pairs, kind, la, index, pos, direction), pairs, idx, clean_logits)
            worst = max(worst, float((grid[cell] - want).abs().max()))
    assert worst < 1e-5, (kind, worst)
    return res


@pytest.mark.parametrize(
    "kind", ["head_out", "head_out_by_pos", "resid_pre", "attn_out", "q", "k", "pattern"]
)
@pytest.mark.parametrize("path", ["full", "lean"])
def test_llama_gqa_padded_equals_oracle(tokenizer, path, monkeypatch, kind):
    monkeypatch.setattr(lean, "MODE", path)
    model = make_tiny("llama", tokenizer)  # GQA 4:2, 3 layers
    pairs = encode_pairs(tokenizer, PAIRS)  # unequal lengths: left padding
    assert (pairs.attention_mask == 0).any()
    positions = [5, -1] if kind in ("head_out_by_pos", "resid_pre", "attn_out", "mlp_out") else None
    layers = [0, 2]
    if kind == "head_out_by_pos":  # column 0 is padding in one pair; layers below the last one
        positions, layers = [0, 5, -2, -1], [0, 1, 2]
    res = _check(model, pairs, kind, layers=layers, positions=positions)
    if kind in ("k", "v"):
        assert res.raw.shape[:2] == (2, model.n_kv_heads)


@pytest.mark.parametrize("kind", ["head_out_by_pos", "mlp_out", "v"])
@pytest.mark.parametrize("path", ["full", "lean"])
def test_gpt2_noising_equals_oracle(tokenizer, path, monkeypatch, kind):
    monkeypatch.setattr(lean, "MODE", path)
    model = make_tiny("gpt2", tokenizer)
    pairs = encode_pairs(tokenizer, PAIRS)
    _check(
        model, pairs, kind, direction="noising", positions=[1, -2, -1] if kind != "v" else None, metric="kl"
    )


@pytest.mark.parametrize("direction", ["denoising", "noising"])
@pytest.mark.parametrize("path", ["full", "lean"])
def test_gpt2_resid_pre_equals_oracle(tokenizer, path, monkeypatch, direction):
    """Was refused on GPT-2: its blocks get the KV cache positionally, so the residual edit read no
    cache, took the patched column as column 0 and wrote the wrong position after a reused prefix."""
    monkeypatch.setattr(lean, "MODE", path)
    model = make_tiny("gpt2", tokenizer)
    pairs = encode_pairs(tokenizer, PAIRS)
    _check(model, pairs, "resid_pre", direction=direction, positions=[1, 5, -2, -1])


def test_result_views_and_roundtrip(tokenizer, tmp_path):
    model = make_tiny("llama", tokenizer)
    pairs = encode_pairs(tokenizer, PAIRS)
    res = patch(model, pairs, "head_out_by_pos", positions=[-2, -1], options=OPTS)
    hs = res.head_scores()
    assert tuple(hs.scores.shape) == (3, 4)
    fr = res.to_frame()
    assert len(fr) == 3 * 4 * 2 and set(fr.columns) >= {
        "layer",
        "head",
        "position",
        "score",
        "ci_low",
        "token",
    }
    p = res.save(tmp_path / "r.json")
    back = PatchResult.load(p)
    assert torch.allclose(back.raw, res.raw) and back.direction == "denoising" and back.labels == res.labels
    # the clean/corrupt endpoints: patching every position of resid_pre[0] restores the clean metric
    full = patch(model, pairs, "resid_pre", layers=[0], options=OPTS)
    assert torch.allclose(
        full.clean,
        get_metric()(record_run(model, pairs.clean_ids, pairs.attention_mask).logits, pairs, torch.arange(2)),
    )


def test_bad_input_before_forward(tokenizer):
    model = make_tiny("llama", tokenizer)
    pairs = encode_pairs(tokenizer, PAIRS)
    calls = []
    h = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match="unknown patching kind 'z'"):
            patch(model, pairs, "z")
        with pytest.raises(ValueError, match="position 99 is out of range"):
            patch(model, pairs, "resid_pre", positions=[99])
        with pytest.raises(ValueError, match="unknown layer 7"):
            patch(model, pairs, "head_out", layers=[7])
        with pytest.raises(ValueError, match="direction"):
            patch(model, pairs, direction="sideways")
        nocf = encode_pairs(tokenizer, [PromptPair(PAIRS[0].clean, PAIRS[0].corrupted, " Mary")])
        with pytest.raises(ValueError, match="needs a counterfactual"):
            patch(model, nocf)
    finally:
        h.remove()
    assert not calls


def test_unembed_only_computes_the_metric_columns_and_restores_the_head(tokenizer):
    model = make_tiny("llama", tokenizer)
    pairs = encode_pairs(tokenizer, PAIRS)
    cols = token_columns(pairs)
    want = {int(t) for p in PAIRS for t in tokenizer.encode(p.answer + p.counterfactual)}
    assert set(cols.tolist()) == want  # the answers and counterfactuals, once each
    assert get_metric("logit_diff").columns is token_columns and get_metric("kl").columns is None
    before = state_copy(model)
    full = record_run(model, pairs.clean_ids, pairs.attention_mask).logits
    with unembed_only(model, cols):
        part = record_run(model, pairs.clean_ids, pairs.attention_mask).logits
    others = torch.ones(full.shape[-1], dtype=torch.bool)
    others[cols] = False
    assert torch.allclose(part[:, cols], full[:, cols], atol=1e-5, rtol=0)
    assert torch.isnan(part[:, others]).all()  # never read, never computed
    assert "forward" not in model.unembed.__dict__  # the class method shows through again
    assert torch.equal(record_run(model, pairs.clean_ids, pairs.attention_mask).logits, full)
    assert all(torch.equal(v, before[k]) for k, v in model.model.state_dict().items())
    with unembed_only(model, torch.arange(full.shape[-1])):  # most of the vocabulary: no-op
        assert "forward" not in model.unembed.__dict__


@pytest.mark.parametrize("path", ["full", "lean"])
def test_sites_equal_in_both_runs_get_the_base_metric_without_a_forward(tokenizer, path, monkeypatch):
    monkeypatch.setattr(lean, "MODE", path)
    model = make_tiny("llama", tokenizer)
    pairs = encode_pairs(tokenizer, PAIRS)
    calls = []
    h = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:  # column 0 is padding or the shared first word: every head's output there is the same
        res = patch(model, pairs, "head_out_by_pos", positions=[0], options=OPTS)
        assert len(calls) == 2  # the clean and the corrupted run only
        assert torch.equal(res.raw[:, :, 0], res.corrupt.expand(3, 4, -1))
        calls.clear()
        res = patch(model, pairs, "head_out_by_pos", positions=[0, -1], direction="noising", options=OPTS)
        assert len(calls) > 2 and torch.equal(res.raw[:, :, 0], res.clean.expand(3, 4, -1))
        assert not torch.equal(res.raw[:, :, 1], res.clean.expand(3, 4, -1))  # the last column differs
    finally:
        h.remove()
