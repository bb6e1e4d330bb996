"""EAP / EAP-IG without held activation differences (`eap_chunk_lean`) equal `eap_chunk` and one
backward through the whole model: the oracle and the pairs are test_eap_layerwise's (the dense
product of every upstream difference with every input gradient of one `torch.autograd.grad`).
Checked with several block sizes on a 4-layer GQA model (EAP and EAP-IG), on a
post-norm family (Gemma-2) and on sliding-window families with prompts longer than the window."""

from __future__ import annotations

import pytest
import torch

from heads.scorers.circuits import graph_of
from heads.scorers.circuits.eap import eap_chunk
from heads.scorers.circuits.eap_lean import eap_chunk_lean
from tests.heads.circuits.test_eap_layerwise import _loss, _oracle, _pairs
from tests.support.families import WINDOW, tiny_family_model

torch.set_num_threads(1)


def _both(m, p, **kw):
    args = (m, graph_of(m), p.clean_ids, p.corrupted_ids, p.attention_mask, _loss(p))
    return eap_chunk_lean(*args, **kw)


@pytest.mark.parametrize("steps", [None, 2])
def test_lean_equals_one_backward_and_eap_chunk(steps):
    m = tiny_family_model("llama", num_hidden_layers=4)
    assert m.n_kv_heads < m.n_heads  # GQA
    p = _pairs(7)
    want = _oracle(m, p, steps)
    scale = float(want.abs().max())
    assert scale > 1e-3
    today = eap_chunk(m, graph_of(m), p.clean_ids, p.corrupted_ids, p.attention_mask, _loss(p), steps=steps)
    for block in (1, 3, 4):
        got = _both(m, p, steps=steps, block=block)
        assert float((got - want).abs().max()) <= 1e-5 * scale, block
        assert float((got - today).abs().max()) <= 1e-6 * scale, block


@pytest.mark.parametrize("kind", ["gemma2", "mistral", "gemma3_text"])
def test_lean_post_norm_and_sliding_window(kind):
    """Gemma-2 / 3: post-norm (the heads' differences scaled by the frozen norm scale); prompts
    of 3 x the window on the sliding-window families."""
    m = tiny_family_model(kind)
    p = _pairs(3 * WINDOW)
    want = _oracle(m, p, None)
    scale = float(want.abs().max())
    assert scale > 1e-3
    got = _both(m, p, block=1)
    assert float((got - want).abs().max()) <= 1e-5 * scale
    today = eap_chunk(m, graph_of(m), p.clean_ids, p.corrupted_ids, p.attention_mask, _loss(p), every=2)
    assert float((got - today).abs().max()) <= 1e-6 * scale


@pytest.mark.parametrize(("kind", "steps"), [("gpt2", None), ("olmo2", 2), ("qwen3", None), ("gemma2", 2)])
def test_lean_other_norms_and_ig_sweep(kind, steps):
    """LayerNorm and absolute positions (GPT-2), no attention norm (OLMo 2), q / k norms (Qwen 3),
    post-norm EAP-IG (Gemma-2: the interpolated run swept beside the clean and corrupted ones)."""
    m = tiny_family_model(kind)
    p = _pairs(9)
    want = _oracle(m, p, steps)
    scale = float(want.abs().max())
    assert scale > 1e-3
    got = _both(m, p, steps=steps, block=2)
    assert float((got - want).abs().max()) <= 1e-5 * scale
    today = eap_chunk(m, graph_of(m), p.clean_ids, p.corrupted_ids, p.attention_mask, _loss(p), steps=steps)
    assert float((got - today).abs().max()) <= 1e-6 * scale


def test_lean_sweep_mlp_in_position_chunks(monkeypatch):
    """The sweeps run each layer's MLP half in position chunks (forced here from one position
    on; by default from `SWEEP_MIN_ROWS`) and score the positions in chunks (`POSITION_MIN_ROWS`):
    the same scores, on a GQA model and a post-norm one."""
    from heads.scorers.circuits import eap_lean

    monkeypatch.setattr(eap_lean, "SWEEP_MIN_ROWS", 1)
    monkeypatch.setattr(eap_lean, "POSITION_MIN_ROWS", 1)  # the scoring too (3-row chunks here)
    for m, steps in (
        (tiny_family_model("llama", num_hidden_layers=3), 2),
        (tiny_family_model("qwen3"), None),
    ):
        p = _pairs(11)
        want = _oracle(m, p, steps)
        scale = float(want.abs().max())
        got = _both(m, p, steps=steps)
        assert float((got - want).abs().max()) <= 1e-5 * scale
        today = eap_chunk(
            m, graph_of(m), p.clean_ids, p.corrupted_ids, p.attention_mask, _loss(p), steps=steps
        )
        assert float((got - today).abs().max()) <= 1e-6 * scale


def test_lean_whole_layer_gradients(monkeypatch):
    """Blocks without a `resid_mid` site (parallel attention and MLP) take each layer's gradients
    whole (`eap._layer_grads`) instead of in attention / MLP halves: forced here on a GQA model."""
    from heads.scorers.circuits import eap_lean

    m = tiny_family_model("llama", num_hidden_layers=3)
    p = _pairs(7)
    want = _oracle(m, p, 2)
    scale = float(want.abs().max())
    monkeypatch.setattr(eap_lean, "has_mid", lambda model: False)
    monkeypatch.setattr(eap_lean, "_split_grads", None)  # must not be called
    got = _both(m, p, steps=2)
    assert float((got - want).abs().max()) <= 1e-5 * scale


def test_memory_budget_takes_the_lean_path_only_when_the_default_does_not_fit(monkeypatch):
    """`max_memory` the default path's plan fits: `eap_chunk`; one pair over it but within the
    lean plan: `eap_chunk_lean` (the same scores); below the lean plan's one pair: refused before
    any forward, naming that minimum (the lean plan at block 1). (A budget used to send every run
    down the slower path.)"""
    import pytest

    from heads import SweepOptions
    from heads.errors import HeadsteerValueError
    from heads.planning import plan_memory
    from heads.scorers.circuits import edge_scores
    from heads.scorers.circuits import scores as scores_module

    m = tiny_family_model("llama", num_hidden_layers=2)
    p = _pairs(7)
    T = p.clean_ids.shape[1]
    calls: list[str] = []

    def spy(name, fn):
        def run(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(scores_module, "eap_chunk_lean", spy("lean", eap_chunk_lean))
    monkeypatch.setattr(scores_module, "eap_chunk", spy("default", eap_chunk))
    default_one = plan_memory(m, "eap", T, 1).peak
    lean_one = plan_memory(m, "eap_lean", T, 1).peak
    assert lean_one < default_one
    plain = edge_scores(m, p, method="eap", options=SweepOptions(progress=False))
    assert set(calls) == {"default"}
    calls.clear()
    roomy = edge_scores(m, p, method="eap", options=SweepOptions(progress=False, max_memory="4GB"))
    assert set(calls) == {"default"}
    assert torch.equal(roomy.scores.nan_to_num(), plain.scores.nan_to_num())
    calls.clear()
    tight = SweepOptions(progress=False, max_memory=(lean_one + default_one) // 2)
    lean = edge_scores(m, p, method="eap", options=tight)
    assert set(calls) == {"lean"} and len(calls) == p.n  # one pair per chunk within the budget
    ok = ~torch.isnan(plain.scores)
    scale = float(plain.scores[ok].abs().max())
    assert scale > 1e-3
    assert float((lean.scores[ok] - plain.scores[ok]).abs().max()) <= 1e-6 * scale
    calls.clear()
    from heads.planning import MemoryRequest

    least = plan_memory(m, MemoryRequest("eap_lean", {"block": 1}), T, 1).peak  # the smallest block
    assert least < lean_one
    with pytest.raises(HeadsteerValueError, match="max_memory"):
        edge_scores(m, p, method="eap", options=SweepOptions(progress=False, max_memory=least - 1))
    assert not calls


@pytest.mark.parametrize("kind", ["llama", "gemma", "gpt2", "cohere"])
def test_norm_vjp_closed_form_equals_autograd(kind):
    """The gradients' expansion through the attention norm in closed form (RMSNorm with gain w or
    1 + w, LayerNorm with and without bias) equals autograd's vector-Jacobian product; a
    module computing neither form gets None (autograd)."""
    from torch import nn

    from heads.scorers.circuits.eap import _norm_vjp
    from heads.scorers.circuits.nodes import layer_parts

    m = tiny_family_model(kind)
    norm = layer_parts(m, 0).norm1
    with torch.no_grad():
        if getattr(norm, "weight", None) is not None:
            norm.weight.normal_()  # a gain far from 1 (and from 0)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 5, m.d_model, generator=g) + 0.5).requires_grad_(True)
    normed = norm(x)
    a = torch.randn(3, 2, 5, m.d_model, generator=g)
    vjp = _norm_vjp(norm, x.detach(), normed.detach())
    assert vjp is not None, type(norm)
    (want,) = torch.autograd.grad(normed, x, a, is_grads_batched=True)
    assert torch.allclose(vjp(a), want, atol=1e-5 * float(want.abs().max()))
    assert _norm_vjp(nn.Tanh(), x.detach(), torch.tanh(x).detach()) is None
