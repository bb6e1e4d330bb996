"""Every causal analysis on the TransformerLens and nnsight backends equals the Hugging Face backend
within 1e-5 in fp32, on a tiny GQA Llama and a tiny GPT-2 (absolute positions, fused QKV):
activation patching of every kind and path patching (GPT-2 here; the Llama in test_backends.py),
direct logit attribution, the logit lens and attention knockout (both models). The analyses read
and write activations only through the engine's sites, which every backend places."""

from __future__ import annotations

import pytest
import torch

from heads import HeadModel, editing
from heads.engine.forward import forward
from heads.scorers.patching import direct_logit_attribution, logit_lens, path_patch
from heads.scorers.patching.activation import KINDS, patch
from heads.scorers.patching.pairs import encode_pairs
from probes.datasets.pairs import load_task_pairs
from steer.knockout import Knockout
from tests.support import make_tiny
from tests.support.patching import state_copy

TOL = 1e-5
OTHERS = ("transformer_lens", "nnsight")


def _trio(kind: str, tokenizer) -> dict[str, HeadModel]:
    """Three copies of one tiny model (same seed): plain HF, a TransformerLens bridge, nnsight."""
    from nnsight.modeling.transformers import TransformersModel
    from transformer_lens.model_bridge import TransformerBridge

    tl = TransformerBridge.boot_transformers(
        "tiny", hf_model=make_tiny(kind, tokenizer).model, tokenizer=tokenizer
    )
    ns = TransformersModel(make_tiny(kind, tokenizer).model, tokenizer=tokenizer)
    return {
        "hf": make_tiny(kind, tokenizer),
        "transformer_lens": HeadModel.wrap(tl, tokenizer),
        "nnsight": HeadModel.wrap(ns, tokenizer),
    }


@pytest.fixture(scope="module")
def gpt2(tokenizer) -> dict[str, HeadModel]:
    return _trio("gpt2", tokenizer)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def trio(request, tokenizer, gpt2) -> dict[str, HeadModel]:
    return gpt2 if request.param == "gpt2" else _trio("llama", tokenizer)


@pytest.fixture(scope="module")
def pairs(tokenizer):
    return encode_pairs(tokenizer, load_task_pairs("ioi", n=2))


def _same(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    torch.testing.assert_close(got, want, atol=TOL, rtol=0, equal_nan=True, msg=lambda s: f"{name}: {s}")


@pytest.mark.parametrize("kind", KINDS)
def test_gpt2_every_patching_kind_same_on_three_backends(gpt2, pairs, kind):
    """(The Llama's kinds and path patching: test_backends.py.)"""
    before = {n: state_copy(m) for n, m in gpt2.items()}
    by_pos = kind in ("resid_pre", "attn_out", "mlp_out", "head_out_by_pos")
    positions = [2, -2, -1] if by_pos else None
    want = patch(gpt2["hf"], pairs, kind, positions=positions).raw
    for name in OTHERS:
        _same(patch(gpt2[name], pairs, kind, positions=positions).raw, want, name)
    for name, m in gpt2.items():
        after = state_copy(m)
        assert all(torch.equal(before[name][k], after[k]) for k in after), name


def test_gpt2_path_patching_same_on_three_backends(gpt2, pairs):
    for receivers, inputs in (("logits", "q"), ([(1, 0), (1, 2)], "v")):
        want = path_patch(gpt2["hf"], pairs, receivers=receivers, inputs=inputs).raw
        for name in OTHERS:
            _same(path_patch(gpt2[name], pairs, receivers=receivers, inputs=inputs).raw, want, name)


def test_dla_and_lens_same_on_three_backends(trio, pairs):
    models = trio
    dla, lens = direct_logit_attribution(models["hf"], pairs), logit_lens(models["hf"], pairs)
    for name in OTHERS:
        got = direct_logit_attribution(models[name], pairs)
        for field in ("heads", "mlp", "attn_bias", "embed", "rest", "logit_diff"):
            _same(getattr(got, field), getattr(dla, field), f"{name} DLA {field}")
        other = logit_lens(models[name], pairs)
        _same(other.logit_diff, lens.logit_diff, f"{name} lens")
        assert other.answer_rank.tolist() == lens.answer_rank.tolist()


def test_knockout_same_on_three_backends(trio, pairs):
    models = trio
    from heads.inputs.prompts import EncodedPrompts

    n = pairs.n
    enc = EncodedPrompts(pairs.clean_ids, pairs.attention_mask, [[]] * n, [""] * n, [[]] * n)
    ko = Knockout(keys=[-4, -3], queries=[-1], layers=[0, 1])
    out = {}
    for name, m in models.items():
        with editing(m, ko.edits(m, enc)):
            out[name] = forward(m, enc)[:, -1].float()
    plain = forward(models["hf"], enc)[:, -1].float()
    assert (out["hf"] - plain).abs().max() > 1e-4  # it acts
    for name in OTHERS:
        _same(out[name], out["hf"], name)


def test_post_norm_dla_same_on_nnsight_and_refused_by_name_on_transformer_lens(tokenizer):
    """Post-norm DLA (frozen post-attention scale) on tiny Gemma 2: nnsight gives the HF numbers;
    the TransformerLens backend does not place the post-norm's `attn_out` and says so."""
    from nnsight.modeling.transformers import TransformersModel
    from transformer_lens.model_bridge import TransformerBridge

    from heads.errors import HeadsteerValueError
    from heads.scorers.patching import pairs_from_tokens
    from tests.support.families import tiny_family_model

    p = pairs_from_tokens(
        [[40, 41, 42, 43, 44], [50, 51, 52, 53]], [[40, 47, 42, 43, 44], [50, 58, 52, 53]], [20, 30], [21, 31]
    )
    want = direct_logit_attribution(tiny_family_model("gemma2"), p)
    ns = HeadModel.wrap(TransformersModel(tiny_family_model("gemma2").model, tokenizer=tokenizer), tokenizer)
    got = direct_logit_attribution(ns, p)
    for field in ("heads", "mlp", "attn_bias", "embed", "rest", "logit_diff"):
        _same(getattr(got, field), getattr(want, field), f"nnsight post-norm DLA {field}")
    bridge = TransformerBridge.boot_transformers(
        "tiny", hf_model=tiny_family_model("gemma2").model, tokenizer=tokenizer
    )
    with pytest.raises(HeadsteerValueError, match="post-norm family .*transformer_lens"):
        direct_logit_attribution(HeadModel.wrap(bridge, tokenizer), p)
