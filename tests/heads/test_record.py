"""`heads.record` and `heads.run_with_hooks` against TransformerLens' `run_with_cache` /
`run_with_hooks` on a `TransformerBridge` built on the same weights (tiny GQA Llama, tiny GPT-2),
and the same activations and replacements on the hf, transformer_lens and nnsight backends."""

from __future__ import annotations

import pytest
import torch

from heads import HeadModel, HeadScale, editing, encode_prompts, forward
from heads.engine import attention as engine_attention
from heads.engine.activations import ActivationEdit
from heads.engine.hooks import hook_names, record, run_with_hooks
from heads.inputs.prompts import EncodedPrompts
from tests.support import make_tiny

TOL = 1e-5
IDS = torch.tensor([[1, 504, 2644, 2643, 335, 260, 1171], [1, 19556, 66, 1023, 44, 8003, 7]])


def _bridge(model, tokenizer):
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers("tiny", hf_model=model, tokenizer=tokenizer)


def _enc(ids: torch.Tensor) -> EncodedPrompts:
    n = ids.shape[0]
    return EncodedPrompts(ids, torch.ones_like(ids), [[] for _ in range(n)], [""] * n, [[] for _ in range(n)])


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request, tokenizer):
    kind = request.param
    return make_tiny(kind, tokenizer), _bridge(make_tiny(kind, tokenizer).model, tokenizer)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, (what, tuple(a.shape), tuple(b.shape))
    assert float((a.float() - b.float()).abs().max()) <= TOL, (
        what,
        float((a.float() - b.float()).abs().max()),
    )


def test_record_equals_transformer_lens_cache(pair, monkeypatch):
    hm, bridge = pair
    runs = []
    inner = hm.backend.run
    monkeypatch.setattr(hm.backend, "run", lambda **kw: runs.append(1) or inner(**kw))
    cache = record(hm, _enc(IDS))
    assert runs == [1]  # the whole cache in one forward
    logits, tl = bridge.run_with_cache(IDS)
    _close(cache.logits, logits, "logits")
    assert set(cache) <= set(tl.keys()), set(cache) - set(tl.keys())
    assert len(cache) == len(hook_names(hm)) > 12 * hm.n_layers
    for name in cache:
        _close(cache[name], tl[name], name)
    if hm.family.model_type == "llama":  # GQA shapes as TransformerLens gives them
        assert cache["blocks.0.attn.hook_k"].shape == (2, IDS.shape[1], 2, 16)
        assert cache["blocks.0.attn.hook_pattern"].shape == (2, 4, IDS.shape[1], IDS.shape[1])
    # the decompositions, as TransformerLens' ActivationCache computes them
    L = hm.n_layers
    for apply_ln in (False, True):
        for fn, kw in (
            ("stack_head_results", {"layer": -1}),
            ("stack_head_results", {"layer": 2, "incl_remainder": True}),
            ("decompose_resid", {}),
            ("decompose_resid", {"layer": 1, "mlp_input": True, "mode": "attn"}),
            ("accumulated_resid", {"incl_mid": True}),
            ("accumulated_resid", {"layer": 1, "pos_slice": -1}),
        ):
            ours, ours_labels = getattr(cache, fn)(return_labels=True, apply_ln=apply_ln, **kw)
            theirs, labels = getattr(tl, fn)(return_labels=True, apply_ln=apply_ln, **kw)
            assert ours_labels == labels, (fn, kw)
            _close(ours, theirs, f"{fn}({kw}, apply_ln={apply_ln})")
    stack = cache.decompose_resid()
    _close(stack.sum(0), cache["resid_post", L - 1], "components add up to the stream")
    _close(cache.apply_ln_to_stack(stack).sum(0), cache["ln_final.hook_normalized"], "frozen final scale")
    mid = cache.decompose_resid(layer=1, mlp_input=True)  # the stream block 1's MLP norm reads
    ln2 = hm.mlp_norm(1)
    want = (ln2(cache["resid_mid", 1]) - getattr(ln2, "bias", 0)) / ln2.weight
    _close(cache.apply_ln_to_stack(mid, 1, mlp_input=True).sum(0), want, "block 1's ln2, frozen scale")


def test_names_limit_what_is_kept_and_computed(pair, monkeypatch):
    hm, _ = pair
    calls = []
    real = engine_attention.blocked_attention
    monkeypatch.setattr(
        engine_attention, "blocked_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    z = record(hm, _enc(IDS), names=lambda n: n.endswith("attn.hook_z"))
    assert sorted(z) == [f"blocks.{la}.attn.hook_z" for la in range(hm.n_layers)]
    assert calls == []  # no pattern was materialised
    one = record(hm, _enc(IDS), names=["blocks.1.attn.hook_pattern", "hook_embed"])
    assert sorted(one) == ["blocks.1.attn.hook_pattern", "hook_embed"] and calls
    assert torch.equal(one["hook_embed"], hm.model.get_input_embeddings().weight[IDS])
    with pytest.raises(ValueError, match="unknown hook name"):
        record(hm, _enc(IDS), names=["blocks.1.hook_nothing"])
    with pytest.raises(ValueError, match="unknown layer"):
        record(hm, _enc(IDS), names=[f"blocks.{hm.n_layers}.hook_resid_pre"])
    if hm.family.model_type == "llama":
        with pytest.raises(ValueError, match="has no hook_pos_embed"):
            record(hm, _enc(IDS), names="hook_pos_embed")


def test_run_with_hooks_equals_transformer_lens(pair):
    hm, bridge = pair

    def knock(z, hook):
        z = z.clone()
        z[:, :, 1] = 0
        return z

    def half_v(v, hook):
        return torch.cat([v[:, :, :1] * 0.5, v[:, :, 1:]], dim=2)

    def shift(x, hook):
        return x + 0.1 * hook.layer()

    seen = []
    hooks = [
        ("blocks.1.attn.hook_z", knock),
        ("blocks.2.attn.hook_v" if hm.n_layers > 2 else "blocks.1.attn.hook_v", half_v),
        (lambda n: n.endswith("hook_attn_out"), shift),
        ("blocks.0.hook_mlp_out", lambda x, hook: seen.append(hook.name)),
    ]
    got = run_with_hooks(hm, _enc(IDS), fwd_hooks=hooks)
    assert seen == ["blocks.0.hook_mlp_out"]  # a read: the name as asked for
    want = bridge.run_with_hooks(IDS, fwd_hooks=hooks)
    _close(got, want, "logits")
    assert float((got - forward(hm, _enc(IDS))).abs().max()) > 1e-3
    # composed with a steering edit, removed on exit
    with editing(hm, [HeadScale(layer=0, heads=[2], factor=0.0)]):
        both = run_with_hooks(hm, _enc(IDS), fwd_hooks=hooks[:1])

    def zero_l0h2(z, hook):
        z = z.clone()
        z[:, :, 2] = 0
        return z

    want = bridge.run_with_hooks(IDS, fwd_hooks=[hooks[0], ("blocks.0.attn.hook_z", zero_l0h2)])
    _close(both, want, "with a steering edit")
    with pytest.raises(ValueError, match="read only"):
        run_with_hooks(hm, _enc(IDS), fwd_hooks=[("blocks.0.attn.hook_attn_scores", lambda s, h: s * 0)])


# ------------------------------------------------------------------ the three backends
def _three(tokenizer, kind: str) -> dict[str, HeadModel]:
    from nnsight.modeling.transformers import TransformersModel

    tl = HeadModel.wrap(_bridge(make_tiny(kind, tokenizer).model, tokenizer), tokenizer)
    ns = HeadModel.wrap(TransformersModel(make_tiny(kind, tokenizer).model, tokenizer=tokenizer), tokenizer)
    return {"hf": make_tiny(kind, tokenizer), "transformer_lens": tl, "nnsight": ns}


def _change(x, call):
    if x.shape[-1] == 1:  # the final norm's scale
        return x * 1.25
    return x * 1.5 + torch.linspace(-0.5, 0.5, x.shape[-1])  # not a uniform shift: norms keep it


SITES = ["embed", "pos_embed", "residual", "q", "k", "v", "query", "head_output", "attn_out", "resid_mid"]
SITES += ["mlp_out", "resid_post", "ln_final.scale"]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_every_site_is_the_same_on_the_three_backends(tokenizer, kind):
    models = _three(tokenizer, kind)
    enc = encode_prompts(
        tokenizer, ["The cat sat on the mat and then", "Hello there, dear friend"], chat=False
    )
    real = enc.attention_mask.bool()
    names = hook_names(models["hf"])
    caches = {n: record(m, enc) for n, m in models.items()}
    for n in ("transformer_lens", "nnsight"):
        assert sorted(caches[n]) == sorted(names)
        for name in names:
            a, b = caches[n][name], caches["hf"][name]
            if name.endswith(("hook_pattern", "hook_attn_scores")):
                a, b = a.transpose(1, 2)[real], b.transpose(1, 2)[real]  # real query rows
            else:
                a, b = a[real], b[real]
            _close(a, b, f"{n} {name}")
    base = forward(models["hf"], enc)
    for site in SITES:
        if site == "pos_embed" and kind == "llama" or site == "query" and kind == "gpt2":
            continue
        layer = 0 if site in ("embed", "pos_embed", "ln_final.scale") else 1
        out = {}
        for n, m in models.items():
            edit = ActivationEdit(site, layer, _change, rows=[1])
            with editing(m, [edit]):
                out[n] = forward(m, enc)
            assert edit.calls > 0
        assert float((out["hf"] - base).abs()[1][real[1]].max()) > 1e-3, site
        assert torch.equal(out["hf"][0], base[0]), site  # rows= keeps row 0
        for n in ("transformer_lens", "nnsight"):
            _close(out[n][real], out["hf"][real], f"{n} replacement at {site}")


# ------------------------------------------------------------------ in-place edits, dtypes, re-entrance
def _one_per_site(hm: HeadModel) -> list[str]:
    """One name per hook template (layer 1 for the per-layer ones)."""
    out: dict[str, str] = {}
    for n in hook_names(hm):
        parts = n.split(".")
        template = ".".join("{l}" if p.isdigit() else p for p in parts)
        if template not in out or ".1." in n:
            out[template] = n
    return list(out.values())


def test_an_in_place_edit_applies_at_every_site_as_a_replacement(tokenizer):
    """TransformerLens' rule: a hook returning None after editing its tensor in place changes the
    forward exactly as returning the edited tensor does, at every site kind (the oracle: the
    replacement path, checked against TransformerLens above); a read-only site refuses both."""
    hm = make_tiny("llama", tokenizer)
    ref = forward(hm, _enc(IDS))
    names = _one_per_site(hm)
    assert any(n.endswith("hook_pattern") for n in names) and any(n.endswith("hook_z") for n in names)
    for name in names:

        def in_place(x, hook):
            x.mul_(0.5)

        if name.endswith(("hook_attn_scores", "hook_normalized", "hook_rot_k")):
            for fn in (in_place, lambda x, hook: x * 0.5):
                with pytest.raises(ValueError, match="read only"):
                    run_with_hooks(hm, _enc(IDS), fwd_hooks=[(name, fn)])
            continue
        got = run_with_hooks(hm, _enc(IDS), fwd_hooks=[(name, in_place)])
        want = run_with_hooks(hm, _enc(IDS), fwd_hooks=[(name, lambda x, hook: x * 0.5)])
        assert torch.equal(got, want), name
        # `x.mul_(...)` returns `x` itself: the same tensor returned is the same in-place edit
        same = run_with_hooks(hm, _enc(IDS), fwd_hooks=[(name, lambda x, hook: x.mul_(0.5))])
        assert torch.equal(same, want), name
        if not name.endswith("hook_scale"):
            assert float((got - ref).abs().max()) > 1e-4, name  # the edit did something


def test_a_replacement_of_another_dtype_or_a_reentrant_call_is_refused(tokenizer):
    hm = make_tiny("llama", tokenizer)
    ref = forward(hm, _enc(IDS))
    for name in ("blocks.1.attn.hook_z", "blocks.1.attn.hook_pattern"):
        for bad in (lambda x, hook: x > 0, lambda x, hook: x.long()):
            with pytest.raises(ValueError, match=rf"hook at {name} returned a torch\.(bool|int64) tensor"):
                run_with_hooks(hm, _enc(IDS), fwd_hooks=[(name, bad)])

    def again(x, hook):
        run_with_hooks(hm, "a b")

    with pytest.raises(ValueError, match=r"a hook called the model again \(blocks\.1\.attn\.hook_z\)"):
        run_with_hooks(hm, _enc(IDS), fwd_hooks=[("blocks.1.attn.hook_z", again)])
    assert torch.equal(forward(hm, _enc(IDS)), ref)  # the model is left as it was
    assert torch.equal(run_with_hooks(hm, _enc(IDS)), ref)


@pytest.mark.parametrize(
    "name", ["blocks.\u00b9.attn.hook_z", "blocks." + "9" * 5000 + ".attn.hook_z", "blocks.-1.hook_resid_pre"]
)
def test_odd_layer_digits_are_an_unknown_hook_name(tokenizer, name):
    hm = make_tiny("llama", tokenizer)
    with pytest.raises(ValueError, match=r"unknown hook name .*one of .*blocks\.\{l\}\.attn\.hook_z"):
        record(hm, "hi there", names=name)


def test_rot_k_is_read_only_even_in_place_and_reads_absolute_positions(tokenizer):
    """`rot_k` hands its functions a copy: an `ActivationEdit` / `ActivationRecorder` that edits it
    in place changed the attention (0.38 in the logits: breaker). During generation past a
    sliding window the `query` and `rot_k` calls give each step's absolute position
    (`call.q_offset`, as the residual and `k` sites do); they gave the window's length."""
    from heads.engine.activations import ActivationEdit, ActivationRecorder
    from tests.support.families import tiny_family_model

    hm = make_tiny("llama", tokenizer)
    enc = _enc(IDS)
    ref = forward(hm, enc)

    def in_place(x, call):
        x.mul_(0)

    zeroing = ActivationRecorder("rot_k", 1, lambda x, c: x.zero_())
    for edit in (ActivationEdit("rot_k", 1, in_place), zeroing):
        with editing(hm, [edit]):
            got = forward(hm, enc)
        assert edit.calls == 1 and torch.equal(got, ref)
    win = tiny_family_model("mistral")  # sliding window of 6 keys
    ids = torch.randint(10, 290, (1, 5), generator=torch.Generator().manual_seed(1))
    recs = {s: ActivationRecorder(s, 1, lambda x, c: c.q_offset) for s in ("rot_k", "query", "residual", "k")}
    with editing(win, list(recs.values())):
        win.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    got_offsets = {s: r.records for s, r in recs.items()}
    assert all(r == [0, 5, 6, 7, 8, 9] for r in got_offsets.values()), got_offsets
