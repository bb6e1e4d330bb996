"""The patching family matrix: on every family the product accepts, every activation-patching kind,
path patching to the logits, DLA and the logit lens either equal an independent one-hook loop
(`tests.support.patching_oracle`: one whole-model forward per site with one plain hook, no engine)
within 1e-5 in fp32, or are refused by name before any forward (`REFUSED` below says which and why).

Prompts are longer than the tiny sliding families' window (6 keys) and Llama 4's attention chunk,
and one pair is left-padded; the patched positions include one whose reused prefix is longer than
the window (the cached keys beyond it were dropped before: issue 41) and, on GPT-2, GPT-BigCode and
GPT-NeoX, positions after a reused prefix (their blocks get the KV cache positionally or as
`layer_past`, which the engine did not read: issue 39 item 2).
"""

from __future__ import annotations

import pytest
import torch

from heads import SweepOptions
from heads.errors import HeadsteerValueError
from heads.scorers.patching import direct_logit_attribution, lean, logit_lens, pairs_from_tokens, path_patch
from heads.scorers.patching.activation import KINDS, patch
from tests.heads.test_family_matrix import EXACT
from tests.support import patching_oracle as oracle
from tests.support.families import N_VOCAB, WINDOW, shared_family_model, tiny_family_model

OPTS = SweepOptions(max_rows=64, progress=False)
POSITIONS = [3, 9, -1]  # column 9 reuses a prefix of 9 keys, longer than the window (6)
ANSWERS, COUNTER = (20, 30), (21, 31)

_MLA = "latent attention: no per-KV-head key / value projection"
_ALL_HEADS = "the key norm spans all KV heads"
_NO_MLP = "the MLP is not one module"
_SCALED = "a residual multiplier other than 1 scales the MLP output (MiniCPM3: scale_depth / sqrt(L))"
REFUSED: dict[str, dict[str, str]] = {
    # model_type -> {kind: why}; every other (family, kind) must equal the loop
    **{t: {"k": _MLA, "v": _MLA} for t in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "youtu")},
    "minicpm3": {"k": _MLA, "v": _MLA, "mlp_out": _SCALED},
    **{t: {"k": _ALL_HEADS} for t in ("olmo2", "olmoe", "flex_olmo", "minimax_m2", "olmo3")},
    **{t: {"mlp_out": _NO_MLP} for t in ("opt", "biogpt")},
}
REFUSAL_TEXT = {
    _MLA: "multi-head latent attention",
    _ALL_HEADS: "spans all KV heads",
    _NO_MLP: "not one module",
    _SCALED: "residual multiplier other than 1",
}
# DLA decomposes the residual stream linearly; families that norm the attention output before it
# joins the stream (Gemma 2 / 3, OLMo 2 / 3, EXAONE 4, FlexOlmo, GLM-4, HyperCLOVA X) are
# decomposed with that norm's scale frozen (issue 40 item 2): on them too the terms must add up
POST_NORM = {"gemma2", "gemma3_text", "olmo2", "olmo3", "exaone4", "flex_olmo", "glm4", "hyperclovax"}


def _pairs():
    """Two pairs longer than the window; pair 1 left-padded by 2; the corruptions at columns 3, 8
    (pair 0) and 4 (pair 1)."""
    g = torch.Generator().manual_seed(3)
    a = torch.randint(10, N_VOCAB, (11,), generator=g).tolist()
    b = list(a)
    b[3], b[8] = (b[3] + 17) % (N_VOCAB - 10) + 10, (b[8] + 5) % (N_VOCAB - 10) + 10
    c = torch.randint(10, N_VOCAB, (9,), generator=g).tolist()
    d = list(c)
    d[2] = (d[2] + 9) % (N_VOCAB - 10) + 10
    assert len(a) > WINDOW
    return pairs_from_tokens([a, c], [b, d], [[ANSWERS[0]], [ANSWERS[1]]], [[COUNTER[0]], [COUNTER[1]]])


def _ld(logits: torch.Tensor) -> torch.Tensor:
    """`[..., N]` logit difference of each pair's answer and counterfactual from `[..., N, V]`."""
    idx = torch.arange(logits.shape[-2])
    a = logits[..., idx, torch.tensor(ANSWERS)]
    return a - logits[..., idx, torch.tensor(COUNTER)]


def _sites(kind: str, n_index: int, positions: list[int]) -> list[tuple[int, int]]:
    if kind in ("resid_pre", "attn_out", "mlp_out"):
        return [(-1, p) for p in positions]
    if kind == "head_out_by_pos":
        return [(h, p) for h in range(n_index) for p in positions]
    return [(h, -1) for h in range(n_index)]


# the lean path (only the patched sites recorded, no position-prefix reuse:
# `heads.scorers.patching.lean`) forced on the sliding-window / chunked / sink families and one of
# each family feature the sites depend on (latent attention, all-heads key norm, no one-module MLP,
# residual multiplier, Conv1D / fused / parallel blocks); `"auto"` takes the fast path on these prompts
LEAN_FAMILIES = [
    *("mistral", "qwen2", "gemma2", "gemma3_text", "cohere2", "gpt_oss", "llama4_text"),
    *("deepseek_v3", "olmo2", "opt", "granite", "gpt2", "gpt_bigcode", "phi"),
]


@pytest.mark.parametrize(
    ("family", "path"), [(f, "auto") for f in EXACT] + [(f, "lean") for f in LEAN_FAMILIES]
)
def test_every_kind_equals_the_one_hook_loop_or_is_refused(family, path, monkeypatch):
    monkeypatch.setattr(lean, "MODE", path)
    hm = shared_family_model(family)
    pairs = _pairs()
    mask = pairs.attention_mask
    refused = REFUSED.get(family, {})
    for kind in KINDS:
        by_pos = kind in ("resid_pre", "attn_out", "mlp_out", "head_out_by_pos")
        positions = POSITIONS if by_pos else None
        if kind in refused:
            with pytest.raises(HeadsteerValueError, match=REFUSAL_TEXT[refused[kind]]):
                patch(hm, pairs, kind, positions=positions, options=OPTS)
            continue
        res = patch(hm, pairs, kind, positions=positions, options=OPTS)
        cols = res.params["positions"]
        for li, layer in enumerate(res.params["layers"]):
            sites = _sites(kind, res.raw.shape[1], cols or [])
            logits = oracle.patch_loop(hm, pairs.corrupted_ids, pairs.clean_ids, mask, kind, layer, sites)
            got = res.raw[li].reshape(len(sites), -1)
            err = float((got - _ld(logits)).abs().max())
            assert err <= 1e-5, (family, kind, layer, err)


@pytest.mark.parametrize("family", EXACT)
def test_path_patching_dla_and_lens_equal_the_loop(family):
    hm = shared_family_model(family)
    pairs = _pairs()
    mask = pairs.attention_mask
    senders = [(la, h) for la in range(hm.n_layers) for h in range(hm.n_heads)]
    for positions in (None, [9, -1]):
        res = path_patch(hm, pairs, positions=positions, options=OPTS)
        logits = oracle.path_to_logits_loop(
            hm, pairs.clean_ids, pairs.corrupted_ids, mask, senders, positions
        )
        err = float((res.raw.reshape(len(senders), -1) - _ld(logits)).abs().max())
        assert err <= 1e-5, (family, positions, err)
    model_ld = _ld(oracle.forward(hm, pairs.clean_ids, mask))  # the model's own output
    lens = logit_lens(hm, pairs)
    assert float((lens.logit_diff[:, -1] - model_ld).abs().max()) <= 1e-5
    dla = direct_logit_attribution(hm, pairs)
    uncapped = _ld(oracle.forward(hm, pairs.clean_ids, mask, uncapped=True))  # DLA is before any cap
    assert float((dla.logit_diff[:, -1] - uncapped).abs().max()) <= 1e-5
    assert float(dla.rest[:, -1].abs().max()) <= 1e-5  # the parts explain the residual
    assert float((dla.total()[:, -1] - dla.logit_diff[:, -1]).abs().max()) <= 1e-5
    if family in POST_NORM and getattr(hm.out_projs[0], "bias", None) is None:
        # no o_proj bias: the frozen-scale head shares are the whole attention output
        assert float(dla.attn_bias[..., -1].abs().max()) <= 1e-5, family


# every feature on the unembedding path, switched on with values that show (tiny models' logits
# are small: a cap of 2 bends them; a scale of 4 or 0.25 is far from 1)
UNEMBED_FEATURES = {
    "gemma2": dict(final_logit_softcapping=2.0),
    "gemma3_text": dict(final_logit_softcapping=2.0),
    "vaultgemma": dict(final_logit_softcapping=2.0),
    "nanochat": dict(final_logit_softcapping=0.05),  # its tiny logits are ~0.1
    "cohere": dict(logit_scale=0.25),
    "granite": dict(logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=2.0),
    "granitemoe": dict(logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=2.0),
    "hyperclovax": dict(logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=2.0),
    "minicpm3": dict(dim_model_base=16, scale_depth=3.0),  # logits_scaling = 64 / 16
}


@pytest.mark.parametrize("family", sorted(UNEMBED_FEATURES))
def test_lens_ends_at_the_output_and_dla_sums_before_the_cap(family):
    """The lens' last entry is the model's output logit difference (soft-cap and logit scale
    included: the Gemma 2 lens omitted the cap, issue 39 item 3); DLA's terms sum to the logit
    difference before any soft-cap, the logit scale and residual multipliers included."""
    hm = tiny_family_model(family, **UNEMBED_FEATURES[family])
    pairs = _pairs()
    mask = pairs.attention_mask
    model_ld = _ld(oracle.forward(hm, pairs.clean_ids, mask))
    lens = logit_lens(hm, pairs)
    assert float((lens.logit_diff[:, -1] - model_ld).abs().max()) <= 1e-5, family
    dla = direct_logit_attribution(hm, pairs)
    cap = getattr(hm.model.config, "final_logit_softcapping", None)
    uncapped = oracle.forward(hm, pairs.clean_ids, mask, uncapped=True)
    assert float((dla.logit_diff[:, -1] - _ld(uncapped)).abs().max()) <= 1e-5, family
    assert float(dla.rest[:, -1].abs().max()) <= 1e-5, family
    assert float((dla.total()[:, -1] - dla.logit_diff[:, -1]).abs().max()) <= 1e-5, family
    if cap:  # the cap acts on these logits: DLA's sum is not the capped output
        assert float((dla.logit_diff[:, -1] - model_ld).abs().max()) > 1e-3
