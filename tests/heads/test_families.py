"""The family matrix (issue 16 part 1): headsteer's attention is the family's own, plus the edit.

Every family in `heads.model.families.FAMILIES` has a tiny random-weight model here (fp32, built from
a `transformers` config, no download), run on eager and SDPA where the family allows. While any
edit is active headsteer's attention function replaces the model's, so:

(a) a read-only `Recorder` on every layer leaves the logits within 1e-5 of the plain model;
(b) a UA ablation (`QueryScale(factor=0)` on one head) gives exactly uniform rows over the
    visible keys on that head, and its sibling heads' patterns are bitwise unchanged.

Adding a family: one entry in `heads/families.py` plus one config in `TINY` (`tests/support/families.py`).
"""

from __future__ import annotations

import pytest
import torch

from heads import HeadModel, LogitBias, QueryScale, Recorder, editing
from heads.model.families import family_of, supported_model_types
from tests.support.families import (
    CASES,
    TINY,
    _tiny_config,
    family_inputs,
    shared_family_model,
    tiny_family_model,
)

_inputs = family_inputs  # the same two rows as the family matrix (tests/support/families.py)


@torch.no_grad()
def _logits(hm: HeadModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return hm.model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def _visible(hm: HeadModel, layer: int, mask: torch.Tensor) -> torch.Tensor:
    """`[B, T, T]` bool: key j visible from query i (causal, not padding, within the window)."""
    seq = mask.shape[1]
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    allowed = j <= i
    window = hm.sliding_window(layer)
    if window is not None:
        allowed = allowed & (i - j < window)
    return allowed[None] & mask.bool()[:, None, :]


@pytest.fixture(scope="module", params=CASES, ids=[f"{k}-{a}" for k, a in CASES])
def case(request) -> HeadModel:
    kind, attn = request.param
    return shared_family_model(kind, attn)  # built once, shared with the family matrix


def test_recorder_on_every_layer_leaves_logits_unchanged(case):
    hm = case
    ids, mask = _inputs()
    plain = _logits(hm, ids, mask)
    recs = [Recorder(layer=la) for la in range(hm.n_layers)]
    with editing(hm, recs):
        got = _logits(hm, ids, mask)
    real = mask.bool()
    assert (got[real] - plain[real]).abs().max().item() <= 1e-5
    for rec in recs:
        (p,) = rec.records
        rows = p.sum(-1)[real[:, None, :].expand(-1, hm.n_heads, -1)]
        torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-6, rtol=0)
    assert torch.equal(_logits(hm, ids, mask), plain)  # restored bitwise on exit


def test_ua_ablation_is_exactly_uniform_and_spares_siblings(case):
    hm = case
    ids, mask = _inputs()
    layer, head = hm.n_layers - 1, 1  # head 1 shares its KV head with head 0 (GQA families)
    sliding = [la for la in range(hm.n_layers) if hm.sliding_window(la) is not None]
    if sliding:
        layer = sliding[0]  # exercise the window where the family has one
    plain, ablated = Recorder(layer=layer), Recorder(layer=layer)
    with editing(hm, [plain]):
        _logits(hm, ids, mask)
    with editing(hm, [QueryScale(layer=layer, heads=[head], factor=0.0), ablated]):
        _logits(hm, ids, mask)
    p0, p1 = plain.records[0], ablated.records[0]
    visible = _visible(hm, layer, mask)
    real = mask.bool()
    assert torch.equal(p0[:, 0] > 0, visible & real[:, :, None])  # the window/causal/pad rule holds
    want = visible.float() / visible.sum(-1, keepdim=True).clamp(min=1)
    got = p1[:, head]
    assert (got[real] - want[real]).abs().max().item() <= 1e-7
    siblings = [h for h in range(hm.n_heads) if h != head]
    assert torch.equal(p1[:, siblings], p0[:, siblings])
    assert not torch.equal(p1[:, head], p0[:, head])


class _ColumnBias(LogitBias):
    """Test edit: logit bias -3 on absolute key column 4 (a real token in both rows)."""

    def bias(self, call):
        b = torch.zeros(1, 1, call.q_len, call.k_len, device=call.device)
        b[..., 4] = -3.0
        return b


@pytest.mark.parametrize("kind", TINY)
def test_cached_generation_equals_uncached_under_edits(kind):
    """KV cache on and off, left-padded batch: the same greedy tokens under logit, query and
    pattern edits (windows longer than the run, so the cache keeps absolute positions)."""
    hm = shared_family_model(kind, "eager", long=True)  # windows of 64 keys (the matrix's model)
    ids, mask = _inputs(seq=8, pad=2)
    edits = lambda: [  # noqa: E731
        _ColumnBias(layer=0, heads=[0, 3]),
        QueryScale(layer=hm.n_layers - 1, heads=[1], factor=0.5),
        Recorder(layer=1),
    ]

    def run(cache: bool, edit: bool):
        with editing(hm, edits() if edit else []):
            out = hm.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=4,
                do_sample=False,
                use_cache=cache,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, 1)

    (tok_c, log_c), (tok_n, log_n) = run(True, True), run(False, True)
    assert torch.equal(tok_c, tok_n)
    torch.testing.assert_close(log_c, log_n, atol=1e-4, rtol=0)
    _, log_plain = run(True, False)
    assert (log_c - log_plain).abs().max() > 1e-4  # the edits act


def test_weight_views_reproduce_the_projections():
    """W_Q / W_K / W_V / W_O read from separate, fused-Linear (Phi-3) and Conv1D (GPT-2) weights."""
    for kind in ("phi3", "gpt2", "olmo2", "llava"):
        hm = shared_family_model(kind)
        fam = hm.family
        x = torch.randn(5, hm.d_model)
        attn = hm.attentions[0]
        with torch.no_grad():
            if fam.fused_qkv:
                proj = getattr(attn, fam.qkv_proj)
                out = proj(x) - (proj.bias if proj.bias is not None else 0)
                qw, kvw = hm.n_heads * hm.d_head, hm.n_kv_heads * hm.d_head
                q, k, v = out.split([qw, kvw, kvw], dim=-1)
            else:
                mods = [getattr(attn, n) for n in (fam.q_proj, fam.k_proj, fam.v_proj)]
                q, k, v = (m(x) - (m.bias if m.bias is not None else 0) for m in mods)
        heads_q = torch.einsum("nm,hmd->nhd", x, hm.W_Q[0]).reshape(5, -1)
        torch.testing.assert_close(heads_q, q, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            torch.einsum("nm,hmd->nhd", x, hm.W_K[0]).reshape(5, -1), k, atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            torch.einsum("nm,hmd->nhd", x, hm.W_V[0]).reshape(5, -1), v, atol=1e-5, rtol=0
        )


# ----------------------------------------------------------------- the examples
def test_gemma2_softcap_recorder_is_read_only():
    """Issue 16: a Recorder on layer 1 of Gemma 2 (cap 2.0, eager) changed the logits by 0.087."""
    hm = shared_family_model("gemma2", "eager")
    assert hm.family.softcap == "attn_logit_softcapping" and hm.model.config.attn_logit_softcapping == 2.0
    ids, mask = _inputs()
    plain = _logits(hm, ids, mask)
    with editing(hm, [Recorder(layer=1)]):
        got = _logits(hm, ids, mask)
    real = mask.bool()
    assert (got[real] - plain[real]).abs().max().item() <= 1e-5
    uncapped = tiny_family_model("gemma2", "eager", attn_logit_softcapping=None)
    assert (_logits(uncapped, ids, mask) - plain)[real].abs().max().item() > 1e-3  # the cap matters here


@pytest.mark.parametrize("kind", ["qwen3", "gemma3_text", "olmo2"])
def test_qk_norm_ua_acts_after_the_norm(kind):
    """Issue 16: on Qwen 3, QueryScale(1e-5) left the head 2.8e-3 from uniform (scaled before q_norm,
    which undoes it); on OLMo 2 (one norm over all heads) it also moved the sibling heads.

    With the scale before the norm this setup gives gaps of 8.9e-3 (Qwen 3) and 1.5e-3 (Gemma 3)
    and moves OLMo 2's siblings by 3.5e-2; after the norm: < 1e-4 and siblings bitwise equal.
    """
    hm = tiny_family_model(kind, "eager", seed=3)
    assert hm.family.qk_norm in ("per_head", "all_heads")
    attn = hm.attentions[1]
    with torch.no_grad():  # large norm weights (Gemma's RMSNorm scales by 1 + w)
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.fill_(3.0 if kind.startswith("gemma") else 4.0)
    ids, mask = _inputs()
    plain, rec = Recorder(layer=1), Recorder(layer=1)
    with editing(hm, [plain]):
        _logits(hm, ids, mask)
    with editing(hm, [QueryScale(layer=1, heads=[2], factor=1e-5), rec]):
        _logits(hm, ids, mask)
    visible = _visible(hm, 1, mask)
    want = visible.float() / visible.sum(-1, keepdim=True).clamp(min=1)
    real = mask.bool()
    assert (rec.records[0][:, 2][real] - want[real]).abs().max().item() < 2e-4
    assert torch.equal(rec.records[0][:, [0, 1, 3]], plain.records[0][:, [0, 1, 3]])


def test_phi3_fused_qkv_loads_and_edits():
    """Issue 16: Phi-3 failed with `'Phi3Attention' object has no attribute 'q_proj'`."""
    hm = shared_family_model("phi3", "sdpa")
    assert hm.family.fused_qkv and (hm.n_heads, hm.n_kv_heads) == (4, 2)
    assert hm.q_projs[0] is hm.attentions[0].qkv_proj
    ids, mask = _inputs()
    copy = tiny_family_model("phi3", "sdpa")
    with torch.no_grad():  # oracle: scaling query head 1's rows of the fused weight
        copy.attentions[0].qkv_proj.weight[16:32] *= 0.3
    with editing(hm, [QueryScale(layer=0, heads=[1], factor=0.3)]):
        got = _logits(hm, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], _logits(copy, ids, mask)[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "kind, flags",
    [
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True, "reorder_and_upcast_attn": True}),
        ("gpt2", {"scale_attn_weights": False}),
        ("gemma3_text", {"use_bidirectional_attention": True}),
    ],
)
def test_scaling_and_causality_flags_are_reproduced(kind, flags, attn):
    """GPT-2's per-layer scale and its own upcast eager path; Gemma 3's bidirectional mode."""
    hm = tiny_family_model(kind, attn, **flags)
    ids, mask = _inputs()
    plain = _logits(hm, ids, mask)
    with editing(hm, [Recorder(layer=la) for la in range(hm.n_layers)]):
        got = _logits(hm, ids, mask)
    real = mask.bool()
    assert (got[real] - plain[real]).abs().max().item() <= 1e-5
    reference = shared_family_model(kind, attn)  # the flags change the plain model itself
    assert (_logits(reference, ids, mask) - plain)[real].abs().max().item() > 1e-5


# ------------------------------------------------------------------------------ refusals
def test_unknown_family_is_refused_by_name():
    stand_in = type("Config", (), {"model_type": "made_up"})()
    with pytest.raises(ValueError, match=r"model_type 'made_up' is not supported.*llama.*qwen3"):
        family_of(stand_in)


def test_learned_sinks_family_is_supported():
    """gpt-oss passes learned sinks (`s_aux`) to its attention function: reproduced since issue 27."""
    from transformers import GptOssConfig

    assert "learned_sinks" in family_of(GptOssConfig()).features


def test_refused_config_feature_names_the_flag():
    from transformers import GPT2Config

    cfg = GPT2Config(n_embd=64, n_layer=1, n_head=4, add_cross_attention=True)
    with pytest.raises(ValueError, match="add_cross_attention=True is not supported.*cross-attention"):
        family_of(cfg)


def test_unreproduced_attention_kwarg_raises_never_dropped():
    from transformers import AttentionInterface

    hm = shared_family_model("llama", "sdpa")
    fn = AttentionInterface()["headsteer_sdpa"]
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    with editing(hm, [Recorder(layer=0)], require_fired=False):
        with pytest.raises(ValueError, match="made_up_kw"):
            fn(hm.attentions[0], q, k, v, None, scaling=0.25, made_up_kw=torch.zeros(4))
        with pytest.raises(ValueError, match="dropout"):
            fn(hm.attentions[0], q, k, v, None, scaling=0.25, dropout=0.1)
        out, _ = fn(hm.attentions[0], q, k, v, None, scaling=0.25, position_ids=torch.arange(3)[None])
    assert out.shape == (1, 3, 4, 16)


def test_vlm_resolves_to_its_text_family():
    hm = shared_family_model("llava")
    assert (hm.family.model_type, hm.family.vlm, hm.family.decoder) == (
        "llama",
        "llava",
        "model.language_model",
    )
    assert hm.layers[0] is hm.model.model.language_model.layers[0]
    assert family_of(_tiny_config("qwen2_vl")).model_type == "qwen2_vl_text"
    assert family_of(_tiny_config("idefics3")).decoder == "model.text_model"
    assert family_of(_tiny_config("gemma3")).bidirectional_images
    assert {"llama", "phi3", "gemma2", "olmo2", "qwen3", "llava", "qwen2_vl", "idefics3"} <= set(
        supported_model_types()
    )
