"""Patching on the TransformerLens and nnsight backends equals the Hugging Face backend.

Three copies of one tiny random GQA Llama (same seed, same weights): plain HF, booted into a
TransformerLens `TransformerBridge` (no weight processing) and wrapped in an nnsight
`TransformersModel`. Every activation-patching kind, path patching to the logits and the report
page behind `headsteer report patching` must give the same raw metric within 1e-5 (fp32), and
each backend's model must be bitwise unchanged afterwards.
"""

from __future__ import annotations

import pytest
import torch

from heads import HeadModel
from heads.errors import HeadsteerValueError
from heads.scorers.patching.activation import KINDS, patch
from heads.scorers.patching.pairs import encode_pairs
from heads.scorers.patching.path import path_patch
from probes.datasets.pairs import load_task_pairs
from tests.support import make_tiny
from tests.support.patching import state_copy
from viz.reports.patching import patching_report

TOL = 1e-5


@pytest.fixture(scope="module")
def models(tokenizer) -> dict[str, HeadModel]:
    from nnsight.modeling.transformers import TransformersModel
    from transformer_lens.model_bridge import TransformerBridge

    tl = TransformerBridge.boot_transformers(
        "tiny", hf_model=make_tiny("llama", tokenizer).model, tokenizer=tokenizer
    )
    ns = TransformersModel(make_tiny("llama", tokenizer).model, tokenizer=tokenizer)
    return {
        "hf": make_tiny("llama", tokenizer),
        "transformer_lens": HeadModel.wrap(tl, tokenizer),
        "nnsight": HeadModel.wrap(ns, tokenizer),
    }


@pytest.fixture(scope="module")
def pairs(models):
    return encode_pairs(models["hf"], load_task_pairs("ioi", n=3))


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_same_on_three_backends(models, pairs, kind):
    want = patch(models["hf"], pairs, kind).raw
    assert torch.isfinite(want).all()
    for name in ("transformer_lens", "nnsight"):
        m = models[name]
        before = state_copy(m)
        got = patch(m, pairs, kind).raw
        torch.testing.assert_close(got, want, atol=TOL, rtol=0, msg=lambda s, n=name: f"{n}: {s}")
        after = state_copy(m)
        assert all(torch.equal(before[k], after[k]) for k in before), name


def test_path_patching_same_on_three_backends(models, pairs):
    want = path_patch(models["hf"], pairs).raw
    for name in ("transformer_lens", "nnsight"):
        torch.testing.assert_close(path_patch(models[name], pairs).raw, want, atol=TOL, rtol=0)


def test_report_page_on_each_backend(models, tmp_path):
    pairs = load_task_pairs("ioi", n=2)
    tops = {}
    for name, m in models.items():
        out = tmp_path / f"{name}.html"
        _, summary = patching_report(m, out, pairs, site="head_out", progress=False, task="ioi")
        assert "direct logit attribution by layer" in out.read_text(encoding="utf-8")
        tops[name] = summary["top"]
    want = [r["score"] for r in tops["hf"]]
    assert len(want) == 5
    for name in ("transformer_lens", "nnsight"):  # the top-5 scores (ties may swap heads)
        assert [r["score"] for r in tops[name]] == pytest.approx(want, abs=1e-4), name


def test_nnsight_remote_refused_before_any_forward(tokenizer, pairs):
    from nnsight.modeling.transformers import TransformersModel

    m = HeadModel.wrap(TransformersModel(make_tiny("llama", tokenizer).model, tokenizer=tokenizer), tokenizer)
    m.backend.remote = True  # type: ignore[attr-defined]
    with pytest.raises(HeadsteerValueError, match="remote=True"):
        patch(m, pairs, "head_out")


def test_post_norm_family_on_the_bridge_takes_the_lean_path(tokenizer):
    """The fast path records `attn_out`, which the bridge does not place on a post-norm family
    (Gemma 2): every kind failed on short prompts naming a site the user never asked for
    (breaker). The lean path, which records only the patched sites, is taken there and equals
    the HF backend; the model is unchanged afterwards."""
    from transformer_lens.model_bridge import TransformerBridge

    from heads import SweepOptions
    from heads.scorers.patching import lean
    from heads.scorers.patching.pairs import pairs_from_tokens
    from tests.support.families import tiny_family_model

    hf = tiny_family_model("gemma2")
    bridge = TransformerBridge.boot_transformers(
        "tiny", hf_model=tiny_family_model("gemma2").model, tokenizer=tokenizer
    )
    tl = HeadModel.wrap(bridge, tokenizer)
    assert not lean.full_path_runs(tl) and lean.full_path_runs(hf)
    clean = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20]] * 2
    corrupt = [[11, 12, 99, 14, 15, 16, 17, 18, 19, 20], [11, 98, 13, 14, 15, 16, 17, 18, 19, 20]]
    p = pairs_from_tokens(clean, corrupt, [[3]] * 2, [[4]] * 2)
    opts = SweepOptions(progress=False)
    for kind in ("head_out", "pattern", "resid_pre"):
        before = state_copy(tl)
        got = patch(tl, p, kind, layers=[0, 1], options=opts).raw
        want = patch(hf, p, kind, layers=[0, 1], options=opts).raw
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
        after = state_copy(tl)
        assert all(torch.equal(before[k], after[k]) for k in before), kind
