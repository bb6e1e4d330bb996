"""ACT sink calibration and sink statistics (docs/methods/act.md) on tiny random models."""

import math

import pytest
import torch

from heads import Recorder, editing, encode_prompts, forward
from heads.engine.edits import AttentionCall
from heads.scorers.sinks import SinkRule, column_scores, find_sinks, massive_activations, sink_stats
from steer import SteeredModel
from steer.act.calibration import calibrate_act_heads
from steer.act.method import Act, ActEdit, calibrate_rows

PROMPTS = ["The quick brown fox jumps over the lazy dog again and again", "A short one"]


def _causal_probs(b, h, t, sink_col=None, seed=0, strength=6.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, h, t, t, generator=g)
    if sink_col is not None:
        logits[..., sink_col] += strength
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    return torch.softmax(logits.masked_fill(~mask, -torch.inf), -1)


def test_calibration_formula():
    # a moderate sink: with sigma near 1 the factor (1 - beta sigma) / (1 - sigma) amplifies fp32 rounding
    p = _causal_probs(2, 3, 12, sink_col=4, strength=2.0)
    sinks = torch.zeros(2, 3, 12, dtype=torch.bool)
    sinks[..., 4] = True
    sinks[0, 1, 7] = True
    new = calibrate_rows(p, sinks, 0.4)
    torch.testing.assert_close(new.sum(-1), torch.ones(2, 3, 12), atol=1e-6, rtol=0)
    s = sinks[:, :, None, :].expand_as(p)
    torch.testing.assert_close(new[s], 0.4 * p[s], rtol=1e-6, atol=0)
    assert torch.equal(new[p == 0], p[p == 0])  # future keys stay 0
    # equals softmax(S + b_i on sinks) with the row-dependent bias b_i
    pd = p.double()  # the oracle in float64
    sigma = (pd * s).sum(-1, keepdim=True)
    b = torch.log(0.4 * (1 - sigma) / (1 - 0.4 * sigma))
    want = torch.softmax(torch.log(pd) + b * s, -1).float()
    steered = (sigma > 0) & (sigma < 1)
    torch.testing.assert_close(torch.where(steered, new, p), torch.where(steered, want, p), atol=1e-6, rtol=0)
    # non-sink ratios preserved; not a plain renormalisation
    ratio = torch.where(~s & (p > 0), new / p.clamp(min=1e-30), torch.nan)  # one factor per row
    spread = ratio.nan_to_num(1.0).amax(-1) - torch.where(ratio.isnan(), torch.inf, ratio).amin(-1)
    assert spread[spread.isfinite()].abs().max() < 1e-5 and ratio.nan_to_num(1.0).min() >= 1.0 - 1e-6
    renorm = torch.where(s, 0.4 * p, p)
    renorm = renorm / renorm.sum(-1, keepdim=True)
    assert (renorm - new).abs().max() > 1e-3
    # a row that is all sink is left unchanged
    only = torch.zeros(1, 1, 1, 3)
    only[..., 0] = 1.0
    assert torch.equal(calibrate_rows(only, torch.tensor([[[True, False, False]]]), 0.4), only)


@pytest.mark.parametrize("rule", [SinkRule(), SinkRule(rule="absolute")])
def test_planted_sink_flagged_uniform_not(rule):
    t = 50
    real = torch.ones(1, t, dtype=torch.bool)
    p = _causal_probs(1, 2, t, sink_col=7)
    a, n = column_scores(p, real)
    s = find_sinks(a, n, real, rule)
    assert s[0, :, 7].all()
    uniform = torch.tril(torch.ones(t, t)) / torch.arange(1, t + 1)[:, None]
    a, n = column_scores(uniform[None, None], real)
    assert not find_sinks(a, n, real, rule).any()
    # exemption by position: column 0 is never flagged, even as a sink
    p0 = _causal_probs(1, 1, t, sink_col=0)
    a, n = column_scores(p0, real)
    assert not find_sinks(a, n, real, rule)[..., 0].any()
    assert find_sinks(a, n, real, SinkRule(rule=rule.rule, exempt="first_flagged"))[..., 0].sum() == 0


def test_column_scores_with_padding():
    real = torch.tensor([[False, False, True, True, True]])
    p = torch.zeros(1, 1, 5, 5)
    for i in range(2, 5):
        p[0, 0, i, 2 : i + 1] = 1.0 / (i - 1)
    a, n = column_scores(p, real)
    assert n.tolist() == [[0, 0, 3, 2, 1]]
    assert a[0, 0, 2].item() == pytest.approx((1 + 0.5 + 1 / 3) / 3)
    assert a[0, 0, :2].abs().sum() == 0


def _layer_probs(hm, enc, edits, layer=2):
    before, after = Recorder(layer=layer), Recorder(layer=layer)
    layer_edits = [e for e in edits if e.layer == layer]
    other = [e for e in edits if e.layer != layer]
    with editing(hm, [before, *layer_edits, after, *other]):
        logits = forward(hm, enc)
    return before.records[0], after.records[0], logits


def test_act_in_the_model(tiny_llama):
    enc = encode_prompts(tiny_llama.tokenizer, PROMPTS, chat=False)
    act = Act(heads={2: [1]}, rule=SinkRule(rule="absolute", theta=0.05))
    edits = act.edits(tiny_llama, enc)
    w, w2, logits = _layer_probs(tiny_llama, enc, edits)
    edit = edits[0]
    assert edit.calls > 0 and edit.sinks[:, 1].any()
    real = w.sum(-1) > 0
    torch.testing.assert_close(w2.sum(-1)[real], torch.ones(int(real.sum())), atol=1e-6, rtol=0)
    s = edit.sinks[:, 1][:, None, :].expand_as(w[:, 1])
    torch.testing.assert_close(w2[:, 1][s], 0.4 * w[:, 1][s], rtol=1e-6, atol=1e-9)
    for h in (0, 2, 3):  # other heads (including the KV sibling) untouched
        assert torch.equal(w2[:, h], w[:, h])
    _, _, base = _layer_probs(tiny_llama, enc, [])
    assert not torch.equal(logits, base)
    # beta = 1 and an empty head set are bitwise no-ops
    assert Act(heads={2: [1]}, beta=1.0).edits(tiny_llama, enc) == []
    assert Act(heads=[]).edits(tiny_llama, enc) == []
    # left-padded batch equals each prompt alone
    for b, p in enumerate(PROMPTS):
        one = encode_prompts(tiny_llama.tokenizer, [p], chat=False)
        _, _, alone = _layer_probs(tiny_llama, one, act.edits(tiny_llama, one))
        n = alone.shape[1]
        torch.testing.assert_close(logits[b, -n:], alone[0], atol=1e-5, rtol=0)


def test_frozen_and_running_decode():
    t = 10
    real = torch.ones(1, t, dtype=torch.bool)
    rule = SinkRule(rule="absolute", theta=0.15)
    prefill = _causal_probs(1, 2, t, sink_col=3)
    for mode in ("frozen", "running"):
        e = ActEdit(layer=0, key_real=real, rule=rule, decode_sinks=mode)
        e.apply(prefill, AttentionCall(0, 1, 2, t, t, 0, prefill.device))
        stored = e.sinks.clone()
        row = torch.softmax(torch.randn(1, 2, 1, t + 2), -1)
        out = e.apply(row, AttentionCall(0, 1, 2, 1, t + 2, t + 1, row.device))
        torch.testing.assert_close(out.sum(-1), torch.ones(1, 2, 1), atol=1e-6, rtol=0)
        if mode == "frozen":
            padded = torch.cat([stored, torch.zeros(1, 2, 2, dtype=torch.bool)], -1)
            torch.testing.assert_close(out, calibrate_rows(row, padded, 0.4), atol=1e-6, rtol=0)
            assert out[..., 3].sum() > 0 and (out[..., t:] >= row[..., t:]).all()
    with pytest.raises(ValueError, match="decode step before"):
        ActEdit(layer=0, key_real=real).apply(row, AttentionCall(0, 1, 2, 1, t + 2, t + 1, row.device))


def test_generate_with_act(tiny_llama):
    sm = SteeredModel(tiny_llama)
    out = sm.generate(PROMPTS, Act(rule=SinkRule(rule="absolute", theta=0.05)), max_new_tokens=4, chat=False)
    assert len(out.token_ids) == 2 and all(len(t) >= 1 for t in out.token_ids)


def test_batched_calibration_equals_one_head_at_a_time(tiny_llama):
    prompts = ["Review: great film\nSentiment:", "Review: awful food\nSentiment:", "Review: fine\nSentiment:"]
    choices = [["positive", "negative"]] * 3
    labels = [0, 1, 0]
    heads = [(1, 0), (2, 1), (2, 3)]
    rule = SinkRule(rule="absolute", theta=0.05)
    cal = calibrate_act_heads(tiny_llama, prompts, choices, labels, heads=heads, rule=rule, keep="margin")
    ids = torch.tensor(
        [
            [tiny_llama.tokenizer(" " + c, add_special_tokens=False)["input_ids"][0] for c in cs]
            for cs in choices
        ]
    )
    enc = encode_prompts(tiny_llama.tokenizer, prompts, chat=False, markup=False)

    def margin(edits):
        with editing(tiny_llama, edits):
            lp = torch.log_softmax(forward(tiny_llama, enc)[:, -1].float(), -1).gather(1, ids)
        lab = torch.tensor(labels)
        return (lp.gather(1, lab[:, None])[:, 0] - lp.gather(1, 1 - lab[:, None])[:, 0]).mean().item()

    base = margin([])
    assert cal.base_margin == pytest.approx(base, abs=1e-5)
    for la, h in heads:
        want = margin(Act(heads=[(la, h)], rule=rule).edits(tiny_llama, enc)) - base
        assert cal.margin.scores[la, h].item() == pytest.approx(want, abs=1e-5)
        assert (la, h) in cal.heads or want <= 0
    assert math.isnan(cal.margin.scores[0, 0].item())
    alone = calibrate_act_heads(tiny_llama, prompts, choices, labels, heads=heads, rule=rule, max_rows=1)
    torch.testing.assert_close(alone.margin.scores, cal.margin.scores, atol=1e-5, rtol=0, equal_nan=True)


def test_sink_stats_and_massive_activations(tiny_llama):
    stats = sink_stats(tiny_llama, PROMPTS, rule=SinkRule(rule="absolute", theta=0.05))
    assert stats.sink_mass.scores.shape == (tiny_llama.n_layers, tiny_llama.n_heads)
    assert ((stats.sink_mass.scores >= 0) & (stats.sink_mass.scores <= 1 + 1e-6)).all()
    # first-token mass against a direct recomputation from the recorded pattern, on the
    # token sequence `generate` uses (chat template and markup by default)
    enc = encode_prompts(tiny_llama.tokenizer, PROMPTS)
    rec = Recorder(layer=1)
    with editing(tiny_llama, rec):
        forward(tiny_llama, enc)
    p = rec.records[0]
    first = enc.attention_mask.float().argmax(-1)
    n = enc.attention_mask.sum(-1)
    want = torch.stack([p[b, :, :, first[b]].sum(-1) / n[b] for b in range(2)]).mean(0)
    torch.testing.assert_close(stats.first_mass.scores[1], want, atol=1e-5, rtol=0)
    assert len(stats.flagged) == int(stats.n_sinks.scores.sum().item() * 2 + 0.5)
    df = massive_activations(tiny_llama, PROMPTS, top=3)
    assert len(df) == 3 * (tiny_llama.n_layers + 1) and (df.ratio_to_median >= 1).all()


def test_bad_input(tiny_llama):
    for beta in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="beta"):
            Act(beta=beta)
    with pytest.raises(TypeError, match="beta"):
        Act(beta="0.4")
    with pytest.raises(ValueError, match="decode_sinks"):
        Act(decode_sinks="live")
    with pytest.raises(ValueError, match="sink rule"):
        SinkRule(rule="median")
    with pytest.raises(ValueError, match="alpha_s"):
        SinkRule(alpha_s=0)
    with pytest.raises(ValueError, match="min_support"):
        SinkRule(min_support=0)
    with pytest.raises(ValueError, match="unknown layer"):
        Act(heads={99: [0]}).edits(tiny_llama, encode_prompts(tiny_llama.tokenizer, PROMPTS, chat=False))
    with pytest.raises(ValueError, match="labels"):
        calibrate_act_heads(tiny_llama, ["a b"], [["yes", "no"]], [2])
    with pytest.raises(ValueError, match="share a first token"):
        calibrate_act_heads(tiny_llama, ["a b"], [["yes", "yes"]], [0])
    with pytest.raises(ValueError, match="prompts"):
        calibrate_act_heads(tiny_llama, ["a b", "c"], [["yes", "no"]], [0])


def test_noop_calibration_keeps_no_head(tiny_llama):
    """beta = 1 changes nothing: float noise from batch packing must not select heads."""
    prompts = ["Is the sky blue? Answer:", "Is grass red? Answer:"]
    for keep in ("margin", "accuracy"):
        cal = calibrate_act_heads(
            tiny_llama, prompts, [["yes", "no"]] * 2, [0, 1], beta=1.0, keep=keep, max_rows=3
        )
        assert len(cal.heads) == 0
        assert cal.margin.scores.nan_to_num().abs().max() < 1e-4


def test_empty_sink_set_is_bitwise_noop():
    p = _causal_probs(2, 3, 9)
    assert torch.equal(calibrate_rows(p, torch.zeros(2, 3, 9, dtype=torch.bool), 0.4), p)
