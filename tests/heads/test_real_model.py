"""Real effects on the embedded SmolLM2-135M-Instruct (30 layers x 9 heads, 3 KV heads), and
the checks both real families share (the `real_model` fixture: SmolLM2, then the base
Gemma-3-270m of tests/heads/test_real_gemma3.py; specs in tests/support/real_models.py)."""

import pytest
import torch

from heads import EMBEDDED_MODEL, Recorder, cache_dir, editing, encode_prompts, forward, span_attention
from steer import Pasta
from tests.support.real_models import SPECS
from viz.cli.demo import DEMO_PROMPT
from viz.cli.jobs import compare

pytestmark = pytest.mark.real


# ------------------------------------------------------------------- both real families
def test_geometry(real_model):
    spec = SPECS[real_model.name]
    hm = real_model
    assert (hm.n_layers, hm.n_heads, hm.n_kv_heads, hm.d_head, hm.d_model) == spec.geometry


@torch.no_grad()
def test_pasta_moves_span_share_by_the_formula(real_model):
    """On the lowest steered layer, each head's span share s becomes s / (s + alpha (1 - s))
    exactly, on every row that can see the span (prefill); the last row's share rises; the
    layer's other heads are bitwise unchanged."""
    hm, spec = real_model, SPECS[real_model.name]
    alpha = 0.01
    heads = span_attention(hm, spec.prompt).top(spec.top_k)
    first = min(la for la, _ in heads)
    hs = heads.by_layer()[first]
    enc = encode_prompts(hm.tokenizer, spec.prompt)
    g = enc.span_mask()[0]
    base, after = Recorder(layer=first), Recorder(layer=first)
    with editing(hm, [base]):
        forward(hm, enc)
    with editing(hm, Pasta(heads, alpha=alpha).edits(hm, enc) + [after]):
        forward(hm, enc)
    s = base.records[0][0, hs][..., g].sum(-1)  # [heads, T]
    s_new = after.records[0][0, hs][..., g].sum(-1)
    rows = g.cumsum(0).bool()  # rows that can see the span
    want = s / (s + alpha * (1 - s))
    torch.testing.assert_close(s_new[:, rows], want[:, rows], atol=1e-5, rtol=0)
    assert torch.all(s_new[:, -1] > s[:, -1])
    others = [h for h in range(hm.n_heads) if h not in hs]
    assert torch.equal(base.records[0][:, others], after.records[0][:, others])


# ------------------------------------------------------------------- the embedded model
def test_embedded_geometry_and_cache(smol):
    assert smol.name == EMBEDDED_MODEL
    assert smol.model.config._attn_implementation == "sdpa"
    assert any(p.name == "model.safetensors" for p in cache_dir().rglob("model.safetensors"))


def test_span_share_rises_in_every_steered_head(smol):
    heads = span_attention(smol, DEMO_PROMPT).top(20)
    enc = encode_prompts(smol.tokenizer, DEMO_PROMPT)
    g = enc.span_mask()[0]
    layers = sorted(heads.by_layer())
    plain = [Recorder(layer=la) for la in layers]
    steered = [Recorder(layer=la) for la in layers]
    with editing(smol, plain):
        forward(smol, enc)
    with editing(smol, Pasta(heads).edits(smol, enc) + steered):
        forward(smol, enc)
    for la, p, q in zip(layers, plain, steered, strict=True):
        for h in heads.by_layer()[la]:
            assert q.records[0][0, h, -1, g].sum() > p.records[0][0, h, -1, g].sum()


def test_demo_answer_changes_and_model_is_restored(smol):
    enc = encode_prompts(smol.tokenizer, DEMO_PROMPT)
    before = forward(smol, enc)
    heads = span_attention(smol, DEMO_PROMPT).top(20)
    res = compare(smol, DEMO_PROMPT, heads, max_new_tokens=24)
    assert res.steered != res.baseline
    assert res.steered.lstrip().startswith("{")  # the buried JSON instruction is followed
    assert torch.equal(forward(smol, enc), before)


def test_spotlight_lands_each_row_on_tau(smol):
    """SpotLight, row granularity, odds form: every steered row's span share becomes tau."""
    from steer import Spotlight

    enc = encode_prompts(smol.tokenizer, DEMO_PROMPT)
    g = enc.span_mask()[0]
    base, after = Recorder(layer=10), Recorder(layer=10)
    edits = [e for e in Spotlight(tau=0.3, granularity="row").edits(smol, enc) if e.layer == 10]
    with editing(smol, [base, *edits, after]):
        forward(smol, enc)
    w, w2 = base.records[0][0], after.records[0][0]
    psi, psi2 = w[..., g].sum(-1), w2[..., g].sum(-1)
    low = (psi > 0) & (psi < 0.3)
    assert low.sum() > 50  # the instruction gets little attention in most rows
    torch.testing.assert_close(psi2[low], torch.full_like(psi2[low], 0.3), atol=1e-5, rtol=0)
    assert torch.equal(w2[psi >= 0.3], w[psi >= 0.3])


def test_act_moves_sink_mass_by_beta(smol):
    """ACT on the real model: flagged sinks keep exactly beta of their attention, rows sum to 1."""
    from steer.act.method import Act

    enc = encode_prompts(smol.tokenizer, DEMO_PROMPT)
    edits = Act(heads={12: list(range(9))}).edits(smol, enc)
    base, after = Recorder(layer=12), Recorder(layer=12)
    with editing(smol, [base, *edits, after]):
        forward(smol, enc)
    s = edits[0].sinks[0]  # [H, T]
    assert s.any()
    w, w2 = base.records[0][0], after.records[0][0]
    mask = s[:, None, :].expand_as(w)
    torch.testing.assert_close(w2[mask], 0.4 * w[mask], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(w2.sum(-1), torch.ones_like(w2.sum(-1)), atol=1e-5, rtol=0)
    assert not s[:, 0].any()  # the first position is exempt, however much attention it gets


def test_shipped_profiles_load_on_the_embedded_model(smol):
    from heads import HeadSet
    from steer.profiles import shipped_profile

    for kind in ("pasta", "act"):
        heads = HeadSet.parse(shipped_profile(kind, smol.name), smol.n_layers, smol.n_heads)
        assert len(heads) >= 1
