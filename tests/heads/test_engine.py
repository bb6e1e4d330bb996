"""The edit engine: the invariants of docs/architecture.md on tiny random models."""

import pytest
import torch

import heads.engine.context as engine
import heads.engine.state as engine_state
from heads import (
    EditNeverFired,
    HeadScale,
    Recorder,
    editing,
    encode_prompts,
    forward,
)
from tests.support import Identity, ZeroRow, make_tiny
from tests.support.oracle import llama_forward

PROMPTS = ["The cat sat on the mat because it was warm.", "Paris is the capital of"]


@pytest.fixture()
def enc(tokenizer):
    return encode_prompts(tokenizer, PROMPTS, chat=False)


def test_identity_edits_are_bitwise_noops(tiny_llama, enc):
    base = forward(tiny_llama, enc)
    with editing(tiny_llama, [HeadScale(layer=1, heads=[0], factor=1.0)]) as active:
        assert active == []
        same = forward(tiny_llama, enc)
    assert torch.equal(base, same)


def test_unedited_layers_take_the_backend_path_bitwise(tiny_llama, enc):
    """With the engine switched on, layers without an edit run the SDPA path bitwise."""
    base = forward(tiny_llama, enc, output_hidden_states=True)
    edit = Identity(layer=2, heads=[0])
    with editing(tiny_llama, [edit]):
        assert tiny_llama.model.config._attn_implementation == "headsteer_sdpa"
        out = forward(tiny_llama, enc, output_hidden_states=True)
    assert edit.calls == 1
    for i in range(3):  # embeddings and the outputs of layers 0, 1: bitwise the same
        assert torch.equal(out.hidden_states[i], base.hidden_states[i])
    torch.testing.assert_close(out.logits, base.logits, atol=1e-5, rtol=0)


def test_eager_path_matches_independent_oracle_with_causal_mask(tiny_llama, tokenizer):
    """The registered mask function is in effect: edited layers see causal + padding masks."""
    enc = encode_prompts(tokenizer, PROMPTS, chat=False)
    want = llama_forward(tiny_llama.model, enc.input_ids, enc.attention_mask)
    edits = [Identity(layer=la) for la in range(tiny_llama.n_layers)]
    with editing(tiny_llama, edits):
        got = forward(tiny_llama, enc)
    real = enc.attention_mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)


def test_future_tokens_do_not_leak(tiny_llama, tokenizer):
    a = encode_prompts(tokenizer, "one two three four five six", chat=False)
    b = encode_prompts(tokenizer, "one two three nine nine nine", chat=False)
    n = 3
    outs = []
    for enc in (a, b):
        with editing(tiny_llama, [Identity(layer=la) for la in range(3)]):
            outs.append(forward(tiny_llama, enc)[:, :n])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)


def test_rows_sum_to_one_and_masked_keys_stay_zero(tiny_llama, enc):
    recs = [Recorder(layer=la) for la in range(tiny_llama.n_layers)]
    with editing(tiny_llama, recs):
        forward(tiny_llama, enc)
    real = enc.attention_mask.bool()
    T = enc.length
    future = ~torch.ones(T, T, dtype=torch.bool).tril()
    for rec in recs:
        (p,) = rec.records
        rows = p.sum(-1)[real[:, None, :].expand(-1, p.shape[1], -1)]
        torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-6, rtol=0)
        assert torch.isfinite(p).all()
        real_rows = real[:, None, :, None].expand_as(p)
        assert torch.all(p[real_rows & future[None, None]] == 0)
        pad_cols = ~real[:, None, None, :].expand_as(p)
        assert torch.all(p[pad_cols & real_rows] == 0)


def test_head_output_zero_equals_zeroed_pattern(tiny_llama, enc):
    """Oracle: zeroing a head's o_proj-input slice == zeroing its post-softmax rows."""
    with editing(tiny_llama, [HeadScale(layer=1, heads=[2], factor=0.0)]):
        a = forward(tiny_llama, enc)
    with editing(tiny_llama, [ZeroRow(layer=1, heads=[2])]):
        b = forward(tiny_llama, enc)
    base = forward(tiny_llama, enc)
    real = enc.attention_mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=0)
    assert (a - base).abs().max() > 1e-4  # the ablation did something


def test_gqa_query_head_edit_touches_one_head(tiny_llama, enc):
    """Heads 0 and 1 share KV head 0; editing head 0 leaves head 1's pattern bitwise unchanged."""
    plain, edited = Recorder(layer=1), Recorder(layer=1)
    with editing(tiny_llama, [plain]):
        forward(tiny_llama, enc)
    with editing(tiny_llama, [ZeroRow(layer=1, heads=[0]), edited]):
        forward(tiny_llama, enc)
    p0, p1 = plain.records[0], edited.records[0]
    assert tiny_llama.kv_head(0) == tiny_llama.kv_head(1)
    assert torch.equal(p0[:, 1:], p1[:, 1:])
    assert torch.all(p1[:, 0] == 0)


def test_per_row_head_masks_equal_separate_runs(tiny_llama, tokenizer):
    text = "A short sentence about heads and layers."
    enc1 = encode_prompts(tokenizer, text, chat=False)
    variants = [(0, 1), (1, 3), (2, 0)]  # (layer, head) ablated per batch row
    single = []
    for layer, head in variants:
        with editing(tiny_llama, [HeadScale(layer=layer, heads=[head], factor=0.0)]):
            single.append(forward(tiny_llama, enc1)[0])
    encK = encode_prompts(tokenizer, [text] * len(variants), chat=False)
    edits = []
    for layer in range(tiny_llama.n_layers):
        mask = torch.zeros(len(variants), tiny_llama.n_heads, dtype=torch.bool)
        for row, (la, h) in enumerate(variants):
            mask[row, h] = la == layer
        edits.append(HeadScale(layer=layer, row_heads=mask, factor=0.0))
    with editing(tiny_llama, edits):
        batched = forward(tiny_llama, encK)
    for row in range(len(variants)):
        torch.testing.assert_close(batched[row], single[row], atol=1e-5, rtol=0)


def test_query_blocks_equal_one_block(tiny_llama, enc, monkeypatch):
    recs = [Recorder(layer=1)]
    with editing(tiny_llama, [Identity(layer=la) for la in range(3)] + recs):
        full = forward(tiny_llama, enc)
    monkeypatch.setattr(engine_state, "QUERY_BLOCK", 3)
    recs2 = [Recorder(layer=1)]
    with editing(tiny_llama, [Identity(layer=la) for la in range(3)] + recs2):
        blocked = forward(tiny_llama, enc)
    torch.testing.assert_close(blocked, full, atol=1e-5, rtol=0)
    assert len(recs2[0].records) == -(-enc.length // 3)
    torch.testing.assert_close(torch.cat(recs2[0].records, dim=2), recs[0].records[0], atol=1e-6, rtol=0)


def test_restored_bitwise_after_exception(tiny_llama, enc):
    before = forward(tiny_llama, enc)
    impl = tiny_llama.model.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with editing(tiny_llama, [ZeroRow(layer=0, heads=[1]), HeadScale(layer=2, heads=[0])]):
            forward(tiny_llama, enc)
            raise RuntimeError("boom")
    assert tiny_llama.model.config._attn_implementation == impl
    assert all(not o._forward_pre_hooks for o in tiny_llama.out_projs)
    assert torch.equal(forward(tiny_llama, enc), before)


def test_nested_contexts_compose(tiny_llama, enc):
    with editing(tiny_llama, [HeadScale(layer=0, heads=[1]), ZeroRow(layer=2, heads=[3])]):
        both = forward(tiny_llama, enc)
    with editing(tiny_llama, [HeadScale(layer=0, heads=[1])]):
        with editing(tiny_llama, [ZeroRow(layer=2, heads=[3])]):
            nested = forward(tiny_llama, enc)
        with editing(tiny_llama, [], require_fired=False):
            outer_only = forward(tiny_llama, enc)
    torch.testing.assert_close(nested, both, atol=0, rtol=0)
    with editing(tiny_llama, [HeadScale(layer=0, heads=[1])]):
        want_outer = forward(tiny_llama, enc)
    assert torch.equal(outer_only, want_outer)


def test_never_fired_raises(tiny_llama):
    with pytest.raises(EditNeverFired, match="never ran"):
        with editing(tiny_llama, [ZeroRow(layer=1, heads=[0])]):
            pass
    with editing(tiny_llama, [ZeroRow(layer=1, heads=[0])], require_fired=False):
        pass


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda: HeadScale(layer=3, heads=[0]), "unknown layer 3"),
        (lambda: HeadScale(layer=0, heads=[7]), "unknown head 7"),
        (lambda: ZeroRow(layer=-1, heads=[0]), "unknown layer -1"),
        (lambda: HeadScale(layer=0, row_heads=torch.ones(2, 5, dtype=torch.bool)), "row_heads"),
        (lambda: HeadScale(layer=0, heads=[0], factor=float("nan")), "finite"),
    ],
)
def test_bad_edits_raise_and_leave_model_untouched(tiny_llama, enc, edit, match):
    before = forward(tiny_llama, enc)
    with pytest.raises(ValueError, match=match):
        with editing(tiny_llama, [edit()]):
            pass
    assert tiny_llama.model.config._attn_implementation == "sdpa"
    assert torch.equal(forward(tiny_llama, enc), before)


def test_row_mask_batch_mismatch_raises(tiny_llama, enc):
    bad = HeadScale(layer=0, row_heads=torch.ones(5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="row_heads has shape"):
        with editing(tiny_llama, [bad]):
            forward(tiny_llama, enc)


def test_not_an_edit(tiny_llama):
    with pytest.raises(TypeError, match="not a headsteer edit"):
        with editing(tiny_llama, ["zero head 3"]):
            pass


def test_unsupported_backend_raises(tokenizer):
    hm = make_tiny("llama", tokenizer)
    hm.model.config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2"):
        with editing(hm, [ZeroRow(layer=0, heads=[0])]):
            pass
    assert hm.model.config._attn_implementation == "flash_attention_2"


def test_eager_backend_model(tokenizer, enc):
    """A model loaded with eager attention: unedited layers keep eager semantics."""
    eager = make_tiny("llama", tokenizer, attn="eager")
    base = forward(eager, enc)
    with editing(eager, [HeadScale(layer=1, heads=[0], factor=0.0)]):
        abl = forward(eager, enc)
    with editing(eager, [ZeroRow(layer=1, heads=[0])]):
        abl2 = forward(eager, enc)
    real = enc.attention_mask.bool()  # pad positions carry no meaning
    torch.testing.assert_close(abl[real], abl2[real], atol=1e-5, rtol=0)
    assert eager.model.config._attn_implementation == "eager"
    assert torch.equal(forward(eager, enc), base)


# --------------------------------------------------------------------------- edit sites
def test_every_edit_class_declares_a_registered_site(tiny_llama):
    from heads.engine.edits import (
        Edit,
        HeadOutputEdit,
        LogitBias,
        ProbEdit,
        QueryEdit,
        ResidualEdit,
        ResidualRecorder,
    )

    sites = {
        c: c.site for c in (QueryEdit, LogitBias, ProbEdit, HeadOutputEdit, ResidualEdit, ResidualRecorder)
    }
    assert sites[QueryEdit] == "query" and sites[ResidualRecorder] == "residual"
    assert set(sites.values()) <= set(engine.SITES)
    assert Edit.site is None  # the abstract base is not an edit of any site
    with pytest.raises(TypeError, match="not a headsteer edit"):
        with editing(tiny_llama, [Edit(layer=0)]):
            pass


def test_residual_recorder_reads_the_layer_input(tiny_llama, enc):
    base = forward(tiny_llama, enc, output_hidden_states=True)
    from heads.engine.edits import ResidualRecorder

    recs = [ResidualRecorder(layer=la) for la in range(tiny_llama.n_layers)]
    with editing(tiny_llama, recs):
        out = forward(tiny_llama, enc)
    assert torch.equal(out, base.logits)  # read-only: bitwise unchanged
    for la, rec in enumerate(recs):
        (x,) = rec.records
        assert torch.equal(x, base.hidden_states[la])  # hidden_states[l] enters layer l
    assert all(not b._forward_pre_hooks for b in tiny_llama.layers)


def test_residual_edit_replacing_the_input_equals_a_fed_residual(tiny_llama, enc):
    """Oracle: `heads.engine.prefix.starting_at` feeds a given residual into layer 1 another way."""
    from heads.engine.edits import ResidualEdit
    from heads.engine.prefix import starting_at

    base = forward(tiny_llama, enc, output_hidden_states=True)
    delta = torch.randn(tiny_llama.d_model, generator=torch.Generator().manual_seed(0))

    class Shift(ResidualEdit):
        def apply(self, x, call):
            return x + delta

    with editing(tiny_llama, [Shift(layer=1)]):
        got = forward(tiny_llama, enc)
    with starting_at(tiny_llama, 1, base.hidden_states[1] + delta):
        want = forward(tiny_llama, enc)
    assert torch.equal(got, want)
    assert (got - base.logits).abs().max() > 1e-3

    class Bad(ResidualEdit):
        def apply(self, x, call):
            return x[:, :1]

    with pytest.raises(ValueError, match="must return the shape it was given"):
        with editing(tiny_llama, [Bad(layer=0)]):
            forward(tiny_llama, enc)


def test_residual_edit_sees_absolute_positions_at_decode_steps(tiny_llama, tokenizer):
    from heads.engine.edits import ResidualRecorder

    enc1 = encode_prompts(tokenizer, "one two three four", chat=False)
    rec = ResidualRecorder(layer=2, fn=lambda x, call: (call.q_offset, call.q_len, x.shape[1]))
    with editing(tiny_llama, [rec]):
        tiny_llama.model.generate(
            input_ids=enc1.input_ids,
            attention_mask=enc1.attention_mask,
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=2,
        )
    n = enc1.length
    assert rec.records == [(0, n, n), (n, 1, 1), (n + 1, 1, 1)]


def test_a_site_without_a_placement_is_refused_before_any_change(tiny_llama, enc, monkeypatch):
    """A site is a table entry (`heads.engine.sites.SITES`) plus its placement in each backend: an
    entry no backend places is a ValueError at `editing()`, and nothing was installed."""
    from heads.engine.edits import Edit

    monkeypatch.setitem(
        engine.SITES, "mlp_input", engine.Site("mlp_input", "blocks.{l}.mlp.hook_in", "[B, T, D]")
    )

    class ZeroMlp(Edit):
        site = "mlp_input"

    base = forward(tiny_llama, enc)
    with pytest.raises(ValueError, match="no placement for site 'mlp_input'"):
        with editing(tiny_llama, [ZeroMlp(layer=1)]):
            pass
    assert not engine_state.INSTALLED
    assert torch.equal(forward(tiny_llama, enc), base)


def test_output_attentions_inside_editing_returns_every_layer(tokenizer, enc):
    eager = make_tiny("llama", tokenizer, attn="eager")
    rec = Recorder(layer=1)
    with editing(eager, [ZeroRow(layer=1, heads=[0]), rec]):
        out = eager.model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, output_attentions=True)
    assert len(out.attentions) == eager.n_layers
    assert torch.equal(out.attentions[1], rec.records[0])
    assert torch.all(out.attentions[1][:, 0] == 0)
