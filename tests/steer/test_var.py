"""VAR (the rules of docs/methods/var.md) on tiny random models: the update against the reference
formula, layers, samples and decoding, VLM batches, the engine reads and the fast paths.

Sink dims are tested in test_var_sink_dims.py, the reference code's pitfalls in
test_var_reference.py; the shared helpers are in tests/support/var.py."""

from __future__ import annotations

import pytest
import torch

from heads import encode_prompts, forward
from heads.engine.context import editing
from heads.engine.edits import Recorder
from heads.scorers.sink_dims import SinkTracker
from steer import SteeredModel
from steer.var import Var, VarEdit, var_redistribute
from tests.support import make_tiny
from tests.support.var import DIM, PROMPTS, TAU, _enc, _sink_positions, planted
from tests.support.vlm_models import image as tiny_image
from tests.support.vlm_models import make_tiny_vlm


@pytest.fixture(scope="module")
def llama(tokenizer):
    return make_tiny("llama", tokenizer, num_hidden_layers=4)


def test_config_validation():
    with pytest.raises(ValueError, match="unknown VAR config keys \\['beta'\\]"):
        Var.from_config({"beta": 0.6})
    v = Var.from_config({"p": 0.4, "rho": 0.8, "layers": [1, 2]})
    assert v.p == 0.4 and v.layers == (1, 2)
    for bad in ({"p": 1.5}, {"rho": -0.1}, {"tau": 0}, {"target": "audio"}, {"enabled": 1}):
        with pytest.raises(ValueError):
            Var.from_config(bad)
    r = Var.from_reference(rho_code=0.2, p_code=0.4)
    assert r.rho == pytest.approx(0.8) and r.p == pytest.approx(0.6)


# --------------------------------------------------------------------------- the update
def test_degenerate_rows_unchanged_no_nan():
    probs = torch.softmax(torch.randn(2, 3, 4, 6), -1)
    sink = torch.zeros(2, 6, dtype=torch.bool)
    sink[:, 0] = True
    region = torch.zeros(2, 6, dtype=torch.bool)
    region[0, 0] = True  # row 0: the only image key is a sink -> zero non-sink image mass
    eligible = torch.ones(2, 4, dtype=torch.bool)
    probs[1, :, :, 2:4] = 0.0  # row 1: m = 0 over keys 2..3
    region[1, 2:4] = True
    new, sel = var_redistribute(probs, sink, region, eligible, floor=0.0, rho=0.0)
    assert not sel.any() and torch.equal(new, probs) and not torch.isnan(new).any()


def _reference_oracle(a, sink, region, eligible, rho_code, p_code, floor=0.2):
    """The reference code's complement form, written as loops (VisAttnSink, issue #5)."""
    out = a.clone()
    n = int(region.sum(-1).max())
    bsz, nh, nq, _ = a.shape
    for b in range(bsz):
        img = region[b]
        vis_sink = img & sink[b]
        free = img & ~sink[b]
        for h in range(nh):
            for q in range(nq):
                if not eligible[b, q]:
                    continue
                row = a[b, h, q]
                summ = float(row[img].sum())
                if summ < floor:
                    continue
                if float(row[vis_sink].sum()) / (summ + n * 1e-6) > rho_code:
                    continue
                fm, sm = float(row[free].sum()), float(row[sink[b]].sum())
                if fm <= 0 or sm <= 0:
                    continue
                new = row.clone()
                new[sink[b]] = row[sink[b]] * p_code
                new[free] = row[free] + (1 - p_code) * sm * row[free] / fm
                out[b, h, q] = new
    return out


def _run_recorded(model, enc, var, layer, positions):
    pre = Recorder(layer=layer)
    post = Recorder(layer=layer)
    edits = var.edits(model, enc)
    with planted(model, positions), editing(model, [pre, *edits, post]):
        logits = forward(model, enc)
    return logits, pre.records[0], post.records[0], edits


def test_update_rules_and_reference_equivalence(llama):
    enc = _enc(llama)
    pos = _sink_positions(enc)
    var = Var(sink_dims=(DIM,), tau=TAU, rho=0.5, p=0.6, layers=(1, 2))
    _, a, new, edits = _run_recorded(llama, enc, var, 1, pos)
    tracker = var.last["tracker"]
    sink = tracker.mask(1, enc.length)
    region = edits[0].region
    starts = edits[0].start
    eligible = torch.arange(enc.length)[None, :] >= starts[:, None]
    assert sink.any(-1).all()
    torch.testing.assert_close(
        new.sum(-1)[enc.attention_mask.bool()[:, None, :].expand(-1, 4, -1)],
        torch.ones(1).expand(int(enc.attention_mask.sum()) * 4),
        atol=1e-6,
        rtol=0,
    )
    _, sel = var_redistribute(a, sink, region, eligible)
    assert sel.any(), "the planted sinks should select some rows"
    s = sel[..., None]
    sk, img = sink[:, None, None, :], region[:, None, None, :]
    free = img & ~sk
    # sinks: exactly (1 - p) a; other text keys bitwise; non-sink image ratios preserved
    assert torch.equal(torch.where(s & sk, new, 0), torch.where(s & sk, a * (1 - 0.6), 0))
    other = s & ~sk & ~img
    assert torch.equal(torch.where(other, new, 0), torch.where(other, a, 0))
    ratio_new = torch.where(free, new, 0) / torch.where(free, new, 0).sum(-1, keepdim=True).clamp(min=1e-30)
    ratio_old = torch.where(free, a, 0) / torch.where(free, a, 0).sum(-1, keepdim=True).clamp(min=1e-30)
    torch.testing.assert_close(torch.where(s, ratio_new, 0), torch.where(s, ratio_old, 0), atol=1e-6, rtol=0)
    # unselected rows (m < floor, r < rho, before the span) bitwise unchanged
    assert torch.equal(torch.where(~s, new, 0), torch.where(~s, a, 0))
    # paper (rho, p) = reference (1 - rho, 1 - p)
    oracle = _reference_oracle(a, sink, region, eligible, rho_code=0.5, p_code=0.4)
    torch.testing.assert_close(new, oracle, atol=1e-6, rtol=0)


def test_p_also_at_04(llama):
    enc = _enc(llama)
    pos = _sink_positions(enc)
    var = Var(sink_dims=(DIM,), tau=TAU, p=0.4, layers=(1,), skip_last=True)
    _, a, new, edits = _run_recorded(llama, enc, var, 1, pos)
    sink = var.last["tracker"].mask(1, enc.length)
    eligible = torch.arange(enc.length)[None, :] >= edits[0].start[:, None]
    oracle = _reference_oracle(a, sink, edits[0].region, eligible, rho_code=0.5, p_code=0.6)
    torch.testing.assert_close(new, oracle, atol=1e-6, rtol=0)


def test_disabled_p0_and_no_sinks_are_baseline(llama):
    enc = _enc(llama)
    pos = _sink_positions(enc)
    with planted(llama, pos):
        base = forward(llama, enc)
        for v in (Var(sink_dims=(DIM,), tau=TAU, enabled=False), Var(sink_dims=(DIM,), tau=TAU, p=0.0)):
            with editing(llama, v.edits(llama, enc)):
                assert torch.equal(forward(llama, enc), base)
        # last layer only + skip_last: nothing to edit
        assert Var(sink_dims=(DIM,), tau=TAU, layers=(3,)).edits(llama, enc) == []
        # no sinks (tau beyond sqrt(D)): the pattern path with VAR = the same path without it
        idle = [Recorder(layer=la, fn=lambda p, c: None) for la in range(3)]
        with editing(llama, idle):
            eager = forward(llama, enc)
        nosink = Var(sink_dims=(DIM,), tau=20.0).edits(llama, enc)
        with editing(llama, [*idle, *nosink]):
            assert torch.equal(forward(llama, enc), eager)
        torch.testing.assert_close(eager, base, atol=1e-5, rtol=1e-5)
        # VAR with sinks does change the logits
        with editing(llama, Var(sink_dims=(DIM,), tau=TAU).edits(llama, enc)):
            assert not torch.allclose(forward(llama, enc), base, atol=1e-4)


def test_last_layer_skipped(llama):
    enc = _enc(llama)
    edits = Var(sink_dims=(DIM,), tau=TAU).edits(llama, enc)
    assert [e.layer for e in edits if isinstance(e, VarEdit)] == [0, 1, 2]
    edits = Var(sink_dims=(DIM,), tau=TAU, skip_last=False).edits(llama, enc)
    assert [e.layer for e in edits if isinstance(e, VarEdit)] == [0, 1, 2, 3]


def test_sample_isolation_and_cache(llama):
    sm = SteeredModel(llama)
    a_prompt, b_prompt = PROMPTS
    enc_b = _enc(llama, [b_prompt])
    pos_b = _sink_positions(enc_b)
    var = Var(sink_dims=(DIM,), tau=TAU)
    with planted(llama, pos_b):  # same absolute positions planted in A and B
        sm.generate([a_prompt], var, chat=False, max_new_tokens=5)
        after_a = sm.generate([b_prompt], var, chat=False, max_new_tokens=5)
        tracker = var.last["tracker"]
        fresh = sm.generate([b_prompt], Var(sink_dims=(DIM,), tau=TAU), chat=False, max_new_tokens=5)
        uncached = sm.generate(
            [b_prompt], Var(sink_dims=(DIM,), tau=TAU), chat=False, max_new_tokens=5, use_cache=False
        )
    assert after_a.token_ids == fresh.token_ids
    assert uncached.token_ids == fresh.token_ids
    # state is bounded: one flag per key column seen (prompt + generated - 1)
    assert tracker.flags[0].shape == (1, enc_b.length + 4)


def test_decode_edits_only_new_row(llama):
    enc = _enc(llama)
    pos = _sink_positions(enc)
    var = Var(sink_dims=(DIM,), tau=TAU, layers=(1,))
    edits = var.edits(llama, enc)
    shapes = []
    rec = Recorder(layer=1, fn=lambda p, c: shapes.append((c.q_len, c.k_len)))
    with planted(llama, pos), editing(llama, [*edits, rec]):
        llama.model.generate(
            input_ids=enc.input_ids,
            attention_mask=enc.attention_mask,
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=2,
        )
    assert shapes[0] == (enc.length, enc.length)
    assert shapes[1:] == [(1, enc.length + 1), (1, enc.length + 2)]
    assert edits[0].considered.sum() > 0


def test_generated_sinks_flagged_unless_prefill_only(llama):
    enc = _enc(llama, PROMPTS[:1])
    x = torch.zeros(1, 3, llama.d_model)
    x[..., DIM] = 1.0
    tr = SinkTracker([DIM], TAU, [0], prefill_only=False, prefill_len=enc.length)
    tr.observe(0, torch.randn(1, enc.length, llama.d_model), 0)
    tr.observe(0, x[:, :1], enc.length)
    assert bool(tr.mask(0, enc.length + 1)[0, -1])
    tr2 = SinkTracker([DIM], TAU, [0], prefill_only=True, prefill_len=enc.length)
    tr2.observe(0, torch.randn(1, enc.length, llama.d_model), 0)
    tr2.observe(0, x[:, :1], enc.length)
    assert not bool(tr2.mask(0, enc.length + 1)[0, -1])


def test_padded_vlm_batch_equals_single_runs():
    vlm = make_tiny_vlm("llava")
    sm = SteeredModel(vlm)
    prompts = ["Describe the image in a few words please.", "What?"]
    images = [tiny_image(1), tiny_image(2)]
    enc = sm.encode(prompts, images=images)
    assert enc.image_spans[0][0][0] != enc.image_spans[1][0][0]  # different image offsets

    def pos_of(e):
        first = e.attention_mask.float().argmax(-1).tolist()
        return [[first[b], e.image_spans[b][0][0] + 1] for b in range(e.batch)]

    var = Var(sink_dims=(DIM,), tau=TAU, skip_last=False)
    with planted(vlm, pos_of(enc)):
        base = forward(vlm, enc)[:, -1]
        edits = var.edits(vlm, enc)
        with editing(vlm, edits):
            both = forward(vlm, enc)[:, -1]
    assert sum(int(e.selected.sum()) for e in edits if isinstance(e, VarEdit)) > 0
    assert not torch.allclose(both, base, atol=1e-5)
    for i in range(2):
        one = sm.encode([prompts[i]], images=[images[i]])
        with planted(vlm, pos_of(one)), editing(vlm, var.edits(vlm, one)):
            alone = forward(vlm, one)[0, -1]
        torch.testing.assert_close(alone, both[i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["qwen2_vl", "idefics3"])
def test_other_vlm_families_move_attention_by_the_rule(kind):
    """On Qwen2-VL and Idefics3 (planted sinks on the image), the edited layer's pattern is the
    reference's update of the recorded one: the amount moved, not only that a token comes out."""
    vlm = make_tiny_vlm(kind)
    sm = SteeredModel(vlm)
    enc = sm.encode(["Describe the image in a few words please."], images=[tiny_image(3)])
    first = enc.attention_mask.float().argmax(-1).tolist()
    pos = [[first[b], enc.image_spans[b][0][0] + 1] for b in range(enc.batch)]
    # the tiny models' rows give the 4-token image 5-12 % of their attention: floor 0.05
    var = Var(sink_dims=(DIM,), tau=TAU, rho=0.5, p=0.6, floor=0.05, layers=(1,), skip_last=False)
    _, a, new, edits = _run_recorded(vlm, enc, var, 1, pos)
    sink = var.last["tracker"].mask(1, enc.length)
    eligible = torch.arange(enc.length)[None, :] >= edits[0].start[:, None]
    assert int(edits[0].selected.sum()) > 0
    assert float((new - a).abs().max()) > 1e-3  # attention moved
    oracle = _reference_oracle(a, sink, edits[0].region, eligible, rho_code=0.5, p_code=0.4, floor=0.05)
    torch.testing.assert_close(new, oracle, atol=1e-6, rtol=0)
    gen = sm.generate(["Describe."], Var(sink_dims=(DIM,), tau=1.0), images=[tiny_image(3)], max_new_tokens=3)
    assert len(gen.token_ids[0]) >= 1


@pytest.mark.real
def test_embedded_var_text_flags_first_token(smol):
    """On SmolLM2 the calibrated tau flags the first token in layers 2-9 and 12-28 (its massive
    value dips in layers 10-11) and few other tokens."""
    prompt = "Answer from the passage. Passage: **The capital of France is Lisbon.** The capital of France is"
    enc = encode_prompts(smol.tokenizer, [prompt], chat=False)
    var = Var()
    edits = var.edits(smol, enc)
    with editing(smol, edits):
        forward(smol, enc)
    flags = var.last["tracker"].flags
    assert [e.layer for e in edits if isinstance(e, VarEdit)] == list(range(smol.n_layers - 1))
    for la in [*range(2, 10), *range(12, smol.n_layers - 1)]:
        assert bool(flags[la][0, 0]), la
    assert float(torch.stack([flags[la][0, 1:].float().mean() for la in range(2, 29)]).mean()) < 0.1


def test_tracker_reads_through_the_engine_only_while_editing(llama):
    """The sink tracker installs nothing itself: its residual reads are engine edits, placed while
    the `editing()` context runs and gone after it (no hook left on the model)."""

    def hooks():
        return [len(layer._forward_pre_hooks) + len(layer._forward_hooks) for layer in llama.layers]

    before = hooks()
    var = Var(sink_dims=(DIM,), tau=TAU)
    enc = _enc(llama)
    edits = var.edits(llama, enc)
    assert hooks() == before
    reads = [e for e in edits if not isinstance(e, VarEdit)]
    assert [(e.site, e.layer) for e in reads] == [("residual", la) for la in range(llama.n_layers - 1)]
    with editing(llama, edits):
        assert hooks() != before
        forward(llama, enc)
    assert hooks() == before
    assert var.last["tracker"].observed == llama.n_layers - 1


@pytest.mark.real
def test_eval_harness_runs_var_and_vhr(smol):
    from probes.studies.evaluate import evaluate

    for method in ("var", "vhr"):
        res = evaluate(smol, "context_qa", method, limit=3, batch_size=3)
        row = res.table.iloc[0]
        assert row["metric"] == "context_accuracy" and row["n"] == 3 and 0 <= row["value"] <= 1


# --------------------------------------------------------------------------- fast paths = plain formula
def _plain_var(probs, sink, region, eligible, *, rho=0.5, p=0.6, floor=0.2, require_visual_sink=False):
    """docs/methods/var.md written plainly over every row (the formulation before the speed work)."""
    w = probs.float()
    sink_k, img_k = sink[:, None, None, :], region[:, None, None, :]
    free_k = img_k & ~sink_k
    m = torch.where(img_k, w, 0.0).sum(-1)
    free = torch.where(free_k, w, 0.0).sum(-1)
    sunk = torch.where(sink_k, w, 0.0).sum(-1)
    r = free / m.clamp(min=1e-30)
    sel = eligible[:, None, :] & (m >= floor) & (m > 0) & (r >= rho) & (free > 0) & (sunk > 0)
    if require_visual_sink:
        sel = sel & (sink & region).any(-1)[:, None, None]
    gain = (p * sunk / free.clamp(min=1e-30))[..., None]
    new = torch.where(sink_k, w * (1 - p), torch.where(free_k, w + gain * w, w))
    return torch.where(sel[..., None], new, probs), sel


@pytest.mark.parametrize("stack_limit", [0, 1 << 22])
def test_fast_var_update_is_bitwise_the_plain_formula(stack_limit, monkeypatch):
    import steer.var as var_module

    monkeypatch.setattr(var_module, "_STACK_LIMIT", stack_limit)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        b, h = int(torch.randint(1, 3, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        q = int(torch.randint(1, 12, (1,), generator=g))
        k = q + int(torch.randint(1, 60, (1,), generator=g))
        logits = torch.randn(b, h, q, k, generator=g) * 3
        logits[..., 0] += 3  # a strong first-token sink
        probs = torch.softmax(logits, -1)
        sink = torch.rand(b, k, generator=g) < 0.1
        sink[:, 0] = True
        region = torch.zeros(b, k, dtype=torch.bool)
        region[:, 1 : 1 + k // 2] = True
        start = torch.randint(0, k + 1, (b,), generator=g)
        eligible = torch.arange(k - q, k)[None] >= start[:, None]
        for kw in ({}, {"rho": 0.0, "floor": 0.0}, {"require_visual_sink": True}, {"p": 0.4, "rho": 0.8}):
            want, want_sel = _plain_var(probs, sink, region, eligible, **kw)
            got, got_sel = var_redistribute(probs, sink, region, eligible, **kw)
            assert torch.equal(got, want) and torch.equal(got_sel, want_sel), kw


def test_open_decode_row_needs_no_mask_bitwise():
    """The explicit attention path skips the mask work for one decode row that sees every key;
    the result equals the same call with an explicit all-visible mask, bit for bit."""
    from heads.engine.kernels.blocked import blocked_attention as _edited_attention
    from heads.engine.kernels.common import AttentionInputs
    from heads.engine.state import LayerEdits as _LayerEdits

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k, v = torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    rec = Recorder(layer=0)
    edits = _LayerEdits(0, 4, None, {"probs": [rec]})
    open_out, open_p = _edited_attention(None, AttentionInputs(q, k, v, None, 0.25), edits, want_probs=True)
    full = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    masked_out, masked_p = _edited_attention(
        None, AttentionInputs(q, k, v, full, 0.25), edits, want_probs=True
    )
    assert torch.equal(open_out, masked_out) and torch.equal(open_p, masked_p)
    assert torch.equal(rec.records[0], rec.records[1])
