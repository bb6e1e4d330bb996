"""Streamed DLA and chosen positions (issue 41 item 2).

`direct_logit_attribution` projects each layer's parts on the answer direction during one forward
(`heads.scorers.patching.dla_stream`) instead of recording the run's whole cache. The cache-based
computation it replaced is kept below as the oracle (`_cached_dla`: `record_run`'s cache of every
layer, then the decomposition) and the streamed result must equal it within 1e-6 (fp32) on
pre-norm, post-norm (Gemma 2 / 3), LayerNorm + bias (GPT-2), logit-scale and residual-multiplier
families, with prompts longer than the sliding window; `positions=` must give exactly the
every-position result's columns, and the lens at chosen positions the model's own output function
of the hidden states there (a plain forward with `output_hidden_states`, no engine).
"""

from __future__ import annotations

from typing import cast

import pytest
import torch

from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.scorers.patching import pairs_from_tokens
from heads.scorers.patching.logit import (
    _directions,
    _lm_bias,
    _logit_scale,
    _norm_parts,
    _o_matrices,
    _post_norms,
    _residual_scale,
    _tol,
    direct_logit_attribution,
    logit_lens,
)
from heads.scorers.patching.norms import frozen_scale, head_terms
from heads.scorers.patching.record import record_run
from heads.scorers.patching.request import DLARequest, LensRequest
from tests.support.families import N_VOCAB, WINDOW, tiny_family_model

FAMILIES = {
    "llama": {},  # pre-norm RMSNorm
    "mistral": {},  # sliding window shorter than the prompts
    "gemma2": {},  # post-attention norm, soft-capping, sliding window
    "gemma3_text": {},  # post-attention norm, local / global layers
    "gpt2": {},  # LayerNorm with bias, absolute positions, o_proj bias
    "cohere": {"logit_scale": 0.25},  # logit scale
    "granite": {"logits_scaling": 4.0, "residual_multiplier": 0.5, "embedding_multiplier": 2.0},
    "opt": {},  # the MLP is not one module: read as the block's output minus the rest
}
TERMS = ("heads", "mlp", "attn_bias", "embed", "bias", "rest", "logit_diff")


def _pairs():
    """Two pairs longer than the window (11 and 9 tokens); pair 1 left-padded by 2."""
    g = torch.Generator().manual_seed(5)
    a = torch.randint(10, N_VOCAB, (11,), generator=g).tolist()
    c = torch.randint(10, N_VOCAB, (9,), generator=g).tolist()
    b, d = list(a), list(c)
    b[3] = (b[3] + 7) % (N_VOCAB - 10) + 10
    d[2] = (d[2] + 9) % (N_VOCAB - 10) + 10
    assert len(a) > WINDOW
    return pairs_from_tokens([a, c], [b, d], [[20], [21]], [[30], [31]])


@torch.no_grad()
def _cached_dla(model, pairs) -> dict[str, torch.Tensor]:
    """The cache-based DLA that the streamed one replaced: `record_run` keeps every layer's
    residual, head outputs, attention and MLP outputs, then each part is projected (fp32)."""
    post, tol = _post_norms(model), _tol(model)
    kind, gain, nbias, eps = _norm_parts(model)
    ua, uw = _directions(model, pairs)
    scale, before = _logit_scale(model)
    du = (ua - uw) * scale
    u = gain * du
    if kind == "layer":
        u = u - u.mean(-1, keepdim=True)
    mask = pairs.attention_mask
    cache = record_run(model, pairs.clean_ids, mask, final=True, keys=False)
    x_final = cast(torch.Tensor, cache.final).float()
    s = frozen_scale(kind, x_final, eps)
    real = mask.float()

    def proj(v: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ntd,nd->nt", v.float(), u) * s * real

    L, H, N, T = model.n_layers, model.n_heads, pairs.n, pairs.width
    heads, mlp, attn_bias = torch.zeros(N, L, H, T), torch.zeros(N, L, T), torch.zeros(N, L, T)
    parts = cache.residuals[0].float().clone()
    embed = proj(cache.residuals[0])
    for la in range(L):
        wo, bo = _o_matrices(model, la)
        r = _residual_scale(model, la)
        raw = cache.attn_out[la].float()
        terms, head_sum = head_terms(cache.z[la].float(), wo, bo, u, post[la], raw, tol)
        heads[:, la] = terms * (s * real)[:, None, :] * r
        attn, mlp_out = raw * r, cache.mlp_out[la].float() * r
        parts += attn + mlp_out
        attn_bias[:, la] = proj(attn - cast(torch.Tensor, head_sum) * r)
        mlp[:, la] = proj(mlp_out)
    rest = proj(x_final - parts)
    bias = torch.zeros(N, T)
    if nbias is not None:
        bias = bias + (du @ nbias)[:, None]
    lb = _lm_bias(model)
    if lb is not None:
        diff = lb[pairs.answers[:, 0]] - lb[pairs.counterfactuals[:, 0]]  # one token each here
        bias += diff[:, None] * (1.0 if before else scale)
    bias = bias * real
    ld = torch.einsum("ntd,nd->nt", model.final_norm(x_final).float(), du)
    if lb is not None:
        ld = ld + bias
    return dict(
        heads=heads, mlp=mlp, attn_bias=attn_bias, embed=embed, bias=bias, rest=rest, logit_diff=ld * real
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_streamed_dla_equals_the_cached_decomposition(family):
    hm = tiny_family_model(family, **FAMILIES[family])
    pairs = _pairs()
    want = _cached_dla(hm, pairs)
    got = direct_logit_attribution(hm, pairs)
    for term in TERMS:
        err = float((getattr(got, term) - want[term]).abs().max())
        assert err <= 1e-6, (family, term, err)
    assert float(want["heads"][..., -1].abs().max()) > 1e-3  # the heads' terms are not all 0
    # chosen positions: exactly the every-position result's columns, in the given order
    cols = [9, 2, -1]
    part = direct_logit_attribution(hm, pairs, positions=cols)
    for term in TERMS:
        full = getattr(got, term)[..., [9, 2, pairs.width - 1]]
        assert float((getattr(part, term) - full).abs().max()) <= 1e-6, (family, term)
    assert part.heads.shape == (2, hm.n_layers, hm.n_heads, 3) and part.params["positions"] == cols


def test_lens_at_chosen_positions_is_the_output_function_of_the_hidden_states(tmp_path):
    hm = tiny_family_model("llama")
    pairs = _pairs()
    mask = pairs.attention_mask
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = hm.model(pairs.clean_ids, attention_mask=mask, position_ids=pos, output_hidden_states=True)
    hidden = out.hidden_states  # L + 1; the last already through the final norm
    cols = [4, -1, 7]
    lens = logit_lens(hm, pairs, positions=cols)
    assert lens.logit_diff.shape == (2, hm.n_layers + 1, 3)
    with torch.no_grad():
        for j, c in enumerate([4, pairs.width - 1, 7]):
            for la in range(hm.n_layers + 1):
                h = hidden[la][:, c]
                logits = hm.model.lm_head(h if la == hm.n_layers else hm.model.model.norm(h))
                want = logits[:, 20:22].diagonal() - logits[:, 30:32].diagonal()  # pair i: 20+i vs 30+i
                assert float((lens.logit_diff[:, la, j] - want).abs().max()) <= 1e-5, (c, la)
    default = logit_lens(hm, pairs)  # positions=None: the last position, [N, L + 1] as before
    assert default.logit_diff.shape == (2, hm.n_layers + 1)
    torch.testing.assert_close(default.logit_diff, lens.logit_diff[..., 1], rtol=0, atol=1e-6)
    torch.testing.assert_close(default.answer_rank, lens.answer_rank[..., 1], rtol=0, atol=0)
    frame = lens.to_frame()
    assert len(frame) == (hm.n_layers + 1) * 3 and list(frame["position"][:3]) == cols
    back = type(lens).load(lens.save(tmp_path / "lens.json"), hm)  # [N, L + 1, P] round trip
    torch.testing.assert_close(back.logit_diff, lens.logit_diff, rtol=0, atol=0)
    assert back.params["positions"] == cols


@pytest.mark.parametrize("request_cls", [DLARequest, LensRequest])
def test_positions_are_checked_before_any_forward(request_cls, monkeypatch):
    with pytest.raises(HeadsteerValueError, match="non-empty list"):
        request_cls(positions=[])
    with pytest.raises(HeadsteerTypeError, match="'x'"):
        request_cls(positions=[1, "x"])
    hm = tiny_family_model("llama")
    fn = direct_logit_attribution if request_cls is DLARequest else logit_lens
    calls = []
    monkeypatch.setattr(hm, "run", lambda *a, **k: calls.append(1))  # any forward would be counted
    for bad in (11, -12):  # the pairs are 11 columns wide
        with pytest.raises(HeadsteerValueError, match=f"positions: {bad} is outside"):
            fn(hm, _pairs(), positions=[0, bad])
    with pytest.raises(HeadsteerValueError, match="positions: 3 and -8 name the same column 3 of 11"):
        fn(hm, _pairs(), positions=[3, -8])  # it gave two identical columns
    if fn is logit_lens:  # column 0 is padding in pair 1: the lens read a pad token's residual
        with pytest.raises(HeadsteerValueError, match=r"positions: 0 \(column 0\) is padding in pair 1"):
            fn(hm, _pairs(), positions=[5, 0])
    assert not calls


def test_dla_gives_padding_columns_zeros():
    """DLA at a column that is padding in a pair: zeros there (as at every position), the real
    pair's column unchanged."""
    hm = tiny_family_model("llama")
    got = direct_logit_attribution(hm, _pairs(), positions=[0, -1])
    assert float(got.heads[1, ..., 0].abs().max()) == 0.0 and float(got.logit_diff[1, 0]) == 0.0
    assert float(got.heads[0, ..., 0].abs().max()) > 0.0
