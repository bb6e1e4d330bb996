"""Real effects on the embedded SmolLM2-135M-Instruct (30 layers x 9 heads, 3 KV heads)."""

import pytest
import torch

from heads import EMBEDDED_MODEL, Recorder, cache_dir, editing, encode_prompts, forward, span_attention
from steer import Pasta
from viz.cli.demo import DEMO_PROMPT
from viz.cli.jobs import compare

pytestmark = pytest.mark.real


def test_embedded_geometry_and_cache(smol):
    assert (smol.n_layers, smol.n_heads, smol.n_kv_heads, smol.d_head, smol.d_model) == (30, 9, 3, 64, 576)
    assert smol.name == EMBEDDED_MODEL
    assert smol.model.config._attn_implementation == "sdpa"
    assert any(p.name == "model.safetensors" for p in cache_dir().rglob("model.safetensors"))


def test_pasta_raises_span_share_by_the_formula(smol):
    """On the lowest steered layer, span share s -> s / (s + alpha (1 - s)) exactly (prefill, last row)."""
    alpha = 0.01
    heads = span_attention(smol, DEMO_PROMPT).top(20)
    first = min(la for la, _ in heads)
    hs = heads.by_layer()[first]
    enc = encode_prompts(smol.tokenizer, DEMO_PROMPT)
    g = enc.span_mask()[0]
    base, after = Recorder(layer=first), Recorder(layer=first)
    with editing(smol, [base]):
        forward(smol, enc)
    with editing(smol, Pasta(heads, alpha=alpha).edits(smol, enc) + [after]):
        forward(smol, enc)
    s = base.records[0][0, hs, -1][:, g].sum(-1)
    s_new = after.records[0][0, hs, -1][:, g].sum(-1)
    want = s / (s + alpha * (1 - s))
    torch.testing.assert_close(s_new, want, atol=1e-5, rtol=0)
    assert torch.all(s_new > s)
    others = [h for h in range(smol.n_heads) if h not in hs]
    assert torch.equal(base.records[0][:, others], after.records[0][:, others])


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
