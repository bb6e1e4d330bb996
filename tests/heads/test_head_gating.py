"""Causal Head Gating: the gated forward against the reference's and a hand-written oracle, the
training direction, identity, bad input and the model left bitwise unchanged."""

from __future__ import annotations

import pytest
import torch

from heads import editing
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.scorers.gating import GateTask, GatingResult, gate_edits, gate_heads, gate_task, gated_nll
from steer import Ablate, HeadGates, SteeredModel
from tests.support import make_tiny
from tests.support.chg_reference import reference_forward, reference_logp
from tests.support.oracle import llama_forward
from tests.support.patching import state_copy

PROMPTS = [
    "When Mary and John went to the store, John gave a drink to",
    "Then Anna and Tom left. Tom thanked",
    "The cat sat on the",
    "One, two, three,",
]
TARGETS = [" Mary", " Anna", " mat", " four"]


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return make_tiny("llama", tokenizer, attn="eager")  # 3 layers, 4 query heads, 2 KV heads (GQA)


@pytest.fixture(scope="module")
def task(tiny):
    return gate_task(tiny, PROMPTS, TARGETS)


def _gates(tiny, seed=0):
    return torch.rand(tiny.n_layers, tiny.n_heads, generator=torch.Generator().manual_seed(seed))


def test_gated_forward_equals_the_reference(tiny, task):
    """The reference's gated forward and log-probability (tests/support/chg_reference.py)."""
    g = _gates(tiny)
    row = task.rows(torch.tensor([0]))  # one row, no padding (the reference runs without a mask)
    both = torch.stack([g, torch.ones_like(g)])  # M = 2 gate sets
    with torch.no_grad():
        want_logits = reference_forward(tiny.model, row.input_ids, g)
        want = -reference_logp(tiny.model, g, row.input_ids, row.loss_mask, agg="mean")
        ref_stacked = -reference_logp(tiny.model, both, row.input_ids, row.loss_mask, agg="mean")
        with editing(tiny, gate_edits(tiny, g)):
            got_logits = tiny.model(row.input_ids).logits
        got = gated_nll(tiny, row, g)
        stacked = gated_nll(tiny, row, both)
    assert not torch.allclose(want_logits, tiny.model(row.input_ids).logits, atol=1e-3)  # the gates act
    assert torch.allclose(got_logits, want_logits, atol=1e-5)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(stacked, ref_stacked, atol=1e-5)


def test_gated_forward_equals_a_hand_written_forward(tiny, task):
    g = _gates(tiny, 1)
    # z_h = A_h V_h, so scaling head h's pattern by g scales its output z_h by g exactly
    want = llama_forward(
        tiny.model,
        task.input_ids,
        task.attention_mask,
        transform=lambda li, p: p * g[li][None, :, None, None],
    )
    with torch.no_grad(), editing(tiny, gate_edits(tiny, g)):
        got = tiny.model(input_ids=task.input_ids, attention_mask=task.attention_mask).logits
    real = task.attention_mask.bool()
    assert (got - want)[real].abs().max() < 1e-5


def test_gates_of_one_reproduce_the_logits_exactly(tiny, task):
    with torch.no_grad():
        plain = tiny.model(input_ids=task.input_ids, attention_mask=task.attention_mask).logits
        ones = torch.ones(tiny.n_layers, tiny.n_heads, requires_grad=True)  # not skipped as identity
        with editing(tiny, gate_edits(tiny, ones)):
            gated = tiny.model(input_ids=task.input_ids, attention_mask=task.attention_mask).logits
        assert torch.equal(plain, gated)
        assert torch.equal(gated_nll(tiny, task, None), gated_nll(tiny, task, ones.detach()))


def test_one_update_moves_every_gate_against_its_gradient(tiny, task):
    a = torch.zeros(1, tiny.n_layers, tiny.n_heads, requires_grad=True)  # gates 0.5, as init=(0.5, 0.5)
    (grad,) = torch.autograd.grad(gated_nll(tiny, task, torch.sigmoid(a)).mean(), [a])
    r = gate_heads(tiny, task, steps=1, reg_steps=1, lr=0.01, init=(0.5, 0.5), batch_size=8, progress=False)
    moved = r.gates.scores - 0.5
    sure = grad[0].abs() > 1e-6
    assert sure.sum() >= 6
    assert torch.equal(
        torch.sign(moved[sure]), -torch.sign(grad[0][sure])
    )  # Adam's first step is -lr sign(g)
    worst = divmod(int(grad[0].argmax()), tiny.n_heads)  # the head whose removal helps the loss most
    assert r.gates.scores[worst] < 0.5


def test_training_lowers_the_loss_and_the_regulariser_pushes_both_ways(tiny, task):
    r = gate_heads(tiny, task, steps=25, reg_steps=25, lr=0.2, progress=False)
    h = r.history["none"]
    assert min(h[-5:]) < h[0]
    assert float(r.retain.scores.mean()) > float(r.gates.scores.mean()) > float(r.remove.scores.mean())
    for la in range(tiny.n_layers):
        for hd in range(tiny.n_heads):
            lab = r.labels[la][hd]
            gp, gm = float(r.retain.scores[la, hd]), float(r.remove.scores[la, hd])
            assert lab == ("interfering" if gp < 0.5 else "facilitating" if gm >= 0.5 else "irrelevant")
    df = r.to_frame()
    assert list(df.columns) == ["layer", "head", "kv_head", "gate", "retain", "remove", "label"]
    assert len(df) == tiny.n_layers * tiny.n_heads and df["kv_head"].max() == tiny.n_kv_heads - 1


def test_training_leaves_the_model_bitwise_unchanged(tiny, task):
    before = state_copy(tiny)
    flags = [p.requires_grad for p in tiny.model.parameters()]
    gate_heads(tiny, task, steps=2, reg_steps=1, progress=False)
    after = tiny.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert flags == [p.requires_grad for p in tiny.model.parameters()]
    assert all(p.grad is None for p in tiny.model.parameters())
    assert not tiny.model.training


def test_heads_restrict_the_gates(tiny, task):
    r = gate_heads(tiny, task, steps=2, reg_steps=1, heads=[(0, 1), (2, 3)], progress=False)
    gated = ~torch.isnan(r.gates.scores)
    assert gated.sum() == 2 and gated[0, 1] and gated[2, 3]
    assert r.counts()["ungated"] == tiny.n_layers * tiny.n_heads - 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(steps=0), "steps must be a positive int"),
        (dict(reg_steps=-1), "reg_steps must be a positive int"),
        (dict(lr=0.0), "lr must be"),
        (dict(lr=-1.0), "lr must be"),
        (dict(reg_weight=float("nan")), "reg_weight must be"),
        (dict(batch_size=0), "batch_size must be"),
        (dict(init=(0.8, 0.2)), "low <= high"),
        (dict(threshold=1.0), "threshold must be"),
        (dict(heads=[(9, 0)]), "unknown layer 9"),
        (dict(heads=[(0, 7)]), "unknown head 7"),
        (dict(heads=[]), "selects no head"),
    ],
)
def test_bad_input_is_one_line_before_any_forward(tiny, task, monkeypatch, kwargs, message):
    import heads.scorers.gating.chg as chg

    def boom(*a, **k):
        raise AssertionError("a forward ran")

    monkeypatch.setattr(chg, "gated_nll", boom)
    with pytest.raises(HeadsteerValueError, match=message) as err:
        gate_heads(tiny, task, progress=False, **kwargs)
    assert "\n" not in str(err.value)


def test_bad_task(tiny, task):
    bad = GateTask(task.input_ids, task.attention_mask, torch.zeros_like(task.loss_mask))
    with pytest.raises(HeadsteerValueError, match="no target token"):
        gate_heads(tiny, bad, progress=False)
    with pytest.raises(HeadsteerTypeError, match="GateTask"):
        gate_heads(tiny, [("a", "b")], progress=False)  # type: ignore[arg-type]
    with pytest.raises(HeadsteerValueError, match="2 prompts for 1 targets"):
        gate_task(tiny, ["a", "b"], ["c"])


def test_save_and_load(tiny, task, tmp_path):
    r = gate_heads(tiny, task, steps=2, reg_steps=1, heads=[(0, 0), (1, 2)], progress=False)
    p = r.save(tmp_path / "g.json")
    back = GatingResult.load(p, tiny)
    assert torch.allclose(back.remove.scores, r.remove.scores, equal_nan=True)
    assert back.labels == r.labels and back.history == r.history
    with pytest.raises(HeadsteerValueError, match="exists"):
        r.save(p)


def test_head_gates_steer_equals_zero_ablation_when_binary(tiny):
    g = torch.ones(tiny.n_layers, tiny.n_heads)
    g[0, 1] = g[2, 3] = 0.2  # below 0.5: rounded to 0
    sm = SteeredModel(tiny)
    prompts = ["Hello there", "The capital of France is"]
    kw = dict(max_new_tokens=5, chat=False, progress=False)
    got = sm.generate(prompts, steer=HeadGates(g, binary=True), **kw)
    want = sm.generate(prompts, steer=Ablate([(0, 1), (2, 3)], method="sc"), **kw)
    assert got.token_ids == want.token_ids
    soft = sm.generate(prompts, steer=[HeadGates(g), Ablate([(1, 0)])], **kw)  # in a list with others
    assert len(soft.texts) == 2
    with pytest.raises(HeadsteerValueError, match="gates are"):
        sm.generate(prompts, steer=HeadGates(torch.ones(2, 2) * 0.5), **kw)


def test_head_gates_steer_equals_the_gated_forward_chg_trains(tiny):
    """Soft gates through `SteeredModel.generate` give the first-token logits of the forward CHG
    trains through (`gate_edits`, right-padded rows), so a gate's effect on a logit difference
    measured in training is the effect of steering with it."""
    g = _gates(tiny, seed=3)
    t = gate_task(tiny, PROMPTS, TARGETS)
    last = t.attention_mask.sum(-1) - 1 - t.loss_mask.sum(-1)  # the position before each target
    with torch.no_grad(), editing(tiny, gate_edits(tiny, g)):
        full = tiny.model(input_ids=t.input_ids, attention_mask=t.attention_mask).logits
    want = full[torch.arange(len(PROMPTS)), last]
    kw = dict(max_new_tokens=1, chat=False, markup=False, progress=False)
    kw |= dict(return_dict_in_generate=True, output_logits=True)
    out = SteeredModel(tiny).generate(PROMPTS, steer=HeadGates(g), **kw)  # type: ignore[arg-type]
    got = out.outputs.logits[0]  # type: ignore[attr-defined]
    plain = SteeredModel(tiny).generate(PROMPTS, **kw)  # type: ignore[arg-type]
    base = plain.outputs.logits[0]  # type: ignore[attr-defined]
    assert torch.allclose(got, want, atol=1e-5)
    assert float((got - base).abs().max()) > 1e-3  # the gates changed the logits


@pytest.mark.real
def test_real_model_gates_on_ioi(smol):
    from probes.datasets.pairs import load_task_pairs

    pairs = load_task_pairs("ioi", n=8)
    t = gate_task(
        smol,
        [p.clean for p in pairs],
        [p.answer if isinstance(p.answer, str) else str(p.answer[0]) for p in pairs],
    )
    r = gate_heads(smol, t, steps=3, reg_steps=1, batch_size=8, progress=False)
    assert r.gates.scores.shape == (30, 9) and r.history["none"][-1] < r.history["none"][0] + 1.0
    assert torch.allclose(gated_nll(smol, t, torch.ones(30, 9)), gated_nll(smol, t, None))


def test_breaker_bounds_and_malformed_files(tmp_path):
    """Unbounded sizes, a bad threshold and malformed gating files are one-line errors."""
    import json

    from heads.scorers.gating import chg

    for bad in (float("nan"), 0.0, 1.0, 5):
        with pytest.raises(HeadsteerValueError, match="threshold"):
            HeadGates(torch.rand(3, 4), binary=True, threshold=bad)
    with pytest.raises(HeadsteerTypeError, match="threshold"):
        HeadGates(torch.rand(3, 4), threshold="x")  # type: ignore[arg-type]
    g = [[0.5, 0.5], [0.5, 0.5]]
    labels = [["irrelevant", "irrelevant"], ["irrelevant", "irrelevant"]]
    good = {"schema": chg.SCHEMA, "schema_version": chg.SCHEMA_VERSION, "gates": g, "retain": g}
    good |= {"remove": g, "labels": labels, "history": {"loss": [1.0]}, "params": {}}
    (tmp_path / "good.json").write_text(json.dumps(good))
    assert GatingResult.load(tmp_path / "good.json").counts()["irrelevant"] == 4  # the base file loads
    bads = (("history", [1, 2]), ("history", {"a": 5}), ("params", "ab"), ("gates", [[10**400, 1], [1, 1]]))
    for field, value in bads:
        p = tmp_path / f"{field}.json"
        p.write_text(json.dumps({**good, field: value}))
        with pytest.raises(HeadsteerValueError, match=field):  # gates 10**400: "not a number"
            GatingResult.load(p)
