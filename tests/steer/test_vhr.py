"""VHD / VHR (the rules of docs/methods/vhr.md) on tiny random models."""

from __future__ import annotations

import warnings

import pytest
import torch

from heads import encode_prompts, forward
from heads.engine.context import editing
from heads.engine.edits import HeadScale, Recorder
from heads.inputs.tokens import readable_tokens
from steer import SteeredModel
from steer.vhr.method import VhdProbe, Vhr, default_vhr_layers, probe_inputs, select_heads_vhd, t_vhd
from tests.support import make_tiny
from tests.support.vlm_models import image as tiny_image
from tests.support.vlm_models import make_tiny_vlm

PROMPTS = [
    "Read this. **The capital of Freedonia is Zork and it is large.** What is the capital?",
    "Note: **Bob works as a baker in town.** So Bob is a",
]


@pytest.fixture(scope="module")
def llama(tokenizer):
    return make_tiny("llama", tokenizer, num_hidden_layers=4)


def _enc(model, prompts=PROMPTS):
    return encode_prompts(model.tokenizer, prompts, chat=False)


def test_default_layers():
    assert default_vhr_layers(32) == [1, *range(18, 32)]
    assert default_vhr_layers(30) == [1, *range(17, 30)]
    assert default_vhr_layers(2) == [1]


def test_alpha_one_is_bitwise_baseline(llama):
    enc = _enc(llama)
    base = forward(llama, enc)
    v = Vhr(alpha=1.0, layers=(1, 3))
    assert v.edits(llama, enc) == []
    with editing(llama, v.edits(llama, enc)):
        assert torch.equal(forward(llama, enc), base)


def test_alpha_validation():
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="alpha"):
            Vhr(alpha=bad)
    with pytest.warns(UserWarning, match="suppresses"):
        Vhr(alpha=0.5)
    with pytest.raises(ValueError, match="target"):
        Vhr(target="audio")


def test_selection_rule_strict_median_and_outliers():
    vhd = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]])
    ta = torch.ones(1, 9)
    sel, _ = select_heads_vhd(vhd, ta)
    assert sel.sum() == 4 and sel[0, 5:].all()  # 9 heads: strictly above the 5th value
    # planted outlier: huge VHD and huge TA -> zeroed, not selected
    vhd2 = vhd.clone()
    vhd2[0, 0] = 100.0
    ta2 = ta.clone()
    ta2[0, 0] = 50.0
    sel2, z = select_heads_vhd(vhd2, ta2)
    assert z[0, 0] == 0 and not sel2[0, 0]
    # only one condition: not zeroed
    sel3, z3 = select_heads_vhd(vhd2, ta)
    assert z3[0, 0] == 100.0 and sel3[0, 0]
    # ties at the median: strict >
    sel4, _ = select_heads_vhd(torch.ones(1, 4), torch.ones(1, 4))
    assert not sel4.any()
    # 32 heads, no ties: 16
    sel5, _ = select_heads_vhd(torch.randperm(32).float()[None], torch.zeros(1, 32), outliers=False)
    assert sel5.sum() == 16


def test_t_vhd():
    v = torch.tensor([[[1.0, 3.0, 2.0], [5.0, 4.0, 0.0]]])
    assert float(t_vhd(v, k=2)) == pytest.approx(3 + 2 + 5 + 4)
    assert float(t_vhd(v, k=2, reduce="mean")) == pytest.approx(2.5 + 4.5)


def test_probe_rows_aligned_and_without_span(llama):
    enc = _enc(llama)
    inp = probe_inputs(llama, enc, enc.spans)
    b = enc.batch
    for r in range(b):
        t0, t1 = enc.spans[r][0]
        span_ids = enc.input_ids[r, t0:t1]
        kept = inp["input_ids"][b + r][inp["attention_mask"][b + r].bool()]
        assert len(kept) == int(enc.attention_mask[r].sum()) - (t1 - t0)
        assert kept[-1] == enc.input_ids[r, -1]  # same last query token
        assert inp["position_ids"][b + r, -1] == len(kept) - 1
        # the no-span row alone gives the same last logits as inside the probe batch
        alone = llama.model(input_ids=kept[None]).logits[0, -1]
        both = llama.model(**inp).logits[b + r, -1]
        torch.testing.assert_close(alone, both, atol=1e-5, rtol=1e-5)
        assert len(span_ids) > 0


def test_vhd_equals_independent_oracle_in_first_layer(llama):
    """VHD in the first layer = distance of head outputs from two separate runs (oracle)."""
    enc = _enc(llama, PROMPTS[:1])
    v = Vhr(layers=(3,))
    sel = v.select(llama, enc)
    t0, t1 = enc.spans[0][0]
    ids = enc.input_ids[0]
    without = torch.cat([ids[:t0], ids[t1:]])[None]
    outs = []
    for x in (ids[None], without):
        rec: list = []
        h = llama.out_projs[0].register_forward_pre_hook(lambda m, a, rec=rec: rec.append(a[0][0, -1]))
        llama.model(input_ids=x)
        h.remove()
        outs.append(rec[0].reshape(llama.n_heads, llama.d_head))
    oracle = (outs[0] - outs[1]).norm(dim=-1)
    torch.testing.assert_close(sel.vhd[0, 0], oracle, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sel.ta[0, 0], outs[1].pow(2).sum(-1), atol=1e-5, rtol=1e-5)
    assert torch.isnan(sel.vhd).sum() == 0  # every layer measured


def test_probe_row0_equals_standalone_reinforced_prefill(llama):
    enc = _enc(llama)
    v = Vhr(layers=(1, 2, 3))
    sel = v.select(llama, enc)
    edits = [HeadScale(layer=la, row_heads=sel.heads[la], factor=2.0) for la in sel.layers]
    with editing(llama, edits):
        logits = forward(llama, enc)[:, -1]
    torch.testing.assert_close(sel.probe_logits[: enc.batch], logits, atol=1e-5, rtol=1e-5)
    # selected count per layer = heads strictly above the median after zeroing
    for la in sel.layers:
        chosen, _ = select_heads_vhd(sel.vhd[:, la], sel.ta[:, la])
        assert torch.equal(chosen, sel.heads[la])
    assert sel.counts().shape == (enc.batch, 3)


def test_layer_by_layer_order(llama):
    """VHD at a later layer is measured after earlier layers are reinforced (not a 2-pass scheme)."""
    enc = _enc(llama, PROMPTS[:1])
    plain = Vhr(layers=(3,)).select(llama, enc)
    reinf = Vhr(layers=(1, 3), alpha=3.0).select(llama, enc)
    assert torch.equal(plain.vhd[:, :2], reinf.vhd[:, :2])  # up to layer 1: same
    assert not torch.allclose(plain.vhd[:, 2:], reinf.vhd[:, 2:])  # after layer 1's scaling: differs
    # the with-only option changes the without-row (hence VHD later on)
    with_only = Vhr(layers=(1, 3), alpha=3.0, reinforce_without=False).select(llama, enc)
    assert torch.equal(with_only.vhd[:, 1], reinf.vhd[:, 1])
    assert not torch.allclose(with_only.vhd[:, 2], reinf.vhd[:, 2])


def test_scaled_slices_exact(llama):
    enc = _enc(llama)
    v = Vhr(layers=(1, 2))
    edits = v.edits(llama, enc)
    sel = v.last["selection"]
    raw, got = [], []
    h0 = llama.out_projs[2].register_forward_pre_hook(lambda m, a: raw.append(a[0].clone()))
    with editing(llama, edits):
        h1 = llama.out_projs[2].register_forward_pre_hook(lambda m, a: got.append(a[0].clone()))
        # scaling at layer 1 changes layer 2's input: record layer 2's z before and after its own edit
        forward(llama, enc)
        h1.remove()
    h0.remove()
    z0 = raw[0].reshape(*raw[0].shape[:2], llama.n_heads, llama.d_head)
    z1 = got[0].reshape(*got[0].shape[:2], llama.n_heads, llama.d_head)
    mask = sel.heads[2]
    for b in range(enc.batch):
        for h in range(llama.n_heads):
            if mask[b, h]:
                assert torch.equal(z1[b, :, h], z0[b, :, h] * 2.0)
            else:
                assert torch.equal(z1[b, :, h], z0[b, :, h])


def test_batch_equals_single_and_heads_per_sample(llama):
    enc = _enc(llama)
    v = Vhr(layers=(1, 2, 3))
    sel = v.select(llama, enc)
    differ = any(not torch.equal(sel.heads[la][0], sel.heads[la][1]) for la in sel.layers)
    assert differ, "the two samples should choose different heads"
    sm = SteeredModel(llama)
    both = sm.generate(PROMPTS, Vhr(layers=(1, 2, 3)), chat=False, max_new_tokens=6)
    for i, p in enumerate(PROMPTS):
        one = Vhr(layers=(1, 2, 3))
        alone = sm.generate([p], one, chat=False, max_new_tokens=6)
        assert alone.token_ids[0] == both.token_ids[i]
        for la in sel.layers:
            assert torch.equal(one.last["selection"].heads[la][0], sel.heads[la][i])


def test_selected_once_and_cache_invariant(llama):
    sm = SteeredModel(llama)
    calls = []
    orig = VhdProbe.apply

    def counting(self, z, call):
        calls.append((self.layer, z.shape[0]))
        return orig(self, z, call)

    VhdProbe.apply = counting
    try:
        v = Vhr(layers=(1, 3))
        cached = sm.generate(PROMPTS, v, chat=False, max_new_tokens=8)
        sel = v.last["selection"]
    finally:
        VhdProbe.apply = orig
    assert len(calls) == llama.n_layers  # one probe forward per batch: selection runs once
    assert sel.selections == 1
    v2 = Vhr(layers=(1, 3))
    uncached = sm.generate(PROMPTS, v2, chat=False, max_new_tokens=8, use_cache=False)
    assert cached.token_ids == uncached.token_ids
    for la in (1, 3):
        assert torch.equal(v2.last["selection"].heads[la], sel.heads[la])
    # heads constant across decode steps: record the edit's row mask at every step
    seen = []
    edits = Vhr(layers=(1,)).edits(llama, _enc(llama))
    masks = edits[0].row_heads.clone()
    rec = Recorder(layer=1, fn=lambda p, c: seen.append(c.q_len))
    enc = _enc(llama)
    with editing(llama, [*edits, rec]):
        llama.model.generate(
            input_ids=enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=4, do_sample=False
        )
    assert torch.equal(edits[0].row_heads, masks) and edits[0].calls == 4
    assert seen[1:] == [1, 1, 1]


def test_sdpa_and_eager_agree(tokenizer):
    a = make_tiny("llama", tokenizer, attn="sdpa", num_hidden_layers=4)
    b = make_tiny("llama", tokenizer, attn="eager", num_hidden_layers=4)
    ea, eb = _enc(a), _enc(b)
    sa, sb = Vhr(layers=(1, 3)).select(a, ea), Vhr(layers=(1, 3)).select(b, eb)
    torch.testing.assert_close(sa.probe_logits, sb.probe_logits, atol=1e-5, rtol=1e-5)
    for la in (1, 3):
        assert torch.equal(sa.heads[la], sb.heads[la])


def test_no_span_is_an_error_and_partial_rows_warn(llama):
    with pytest.raises(ValueError, match="VHR needs"):
        Vhr(layers=(1,)).edits(llama, _enc(llama, ["no markup here"]))
    enc = _enc(llama, [PROMPTS[0], "no markup here"])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        edits = Vhr(layers=(1,)).edits(llama, enc)
    assert any("VHR" in str(x.message) for x in w)
    assert not edits[0].row_heads[1].any()


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl", "idefics3"])
def test_vlm_probe_and_generate(kind):
    vlm = make_tiny_vlm(kind)
    sm = SteeredModel(vlm)
    prompts = ["Describe the image.", "What is in this picture?"]
    images = [tiny_image(1), tiny_image(2)]
    enc = sm.encode(prompts, images=images)
    inp = probe_inputs(vlm, enc, enc.image_spans)
    b = enc.batch
    img_id = vlm.model.config.image_token_id
    assert not (inp["input_ids"][b:] == img_id).any()
    v = Vhr(layers=(1,))
    sel = v.select(vlm, enc)
    assert sel.heads[1].shape == (b, vlm.n_heads)
    # probe row 0 = standalone reinforced prefill
    with editing(vlm, [HeadScale(layer=1, row_heads=sel.heads[1], factor=2.0)]):
        logits = forward(vlm, enc)[:, -1].float()
    torch.testing.assert_close(sel.probe_logits[:b], logits, atol=1e-4, rtol=1e-4)
    gen = sm.generate(prompts, Vhr(layers=(1,)), images=images, max_new_tokens=3)
    assert len(gen.token_ids) == 2


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl", "idefics3"])
def test_cli_vision_generate_and_report(kind, tmp_path):
    """`headsteer vision generate --image --steer var|vhr` and `report vision` on a tiny VLM folder."""
    import json

    from typer.testing import CliRunner

    from tests.support.vlm_models import save_tiny_vlm
    from viz.cli.main import app

    folder = save_tiny_vlm(make_tiny_vlm(kind), tmp_path / kind)
    img = tmp_path / "img.png"
    tiny_image(4).save(img)
    runner = CliRunner()
    common = ["--model", str(folder), "--image", str(img), "--max-new-tokens", "3", "--json"]
    r = runner.invoke(app, ["vision", "generate", "Describe the image.", "--steer", "vhr", *common])
    assert r.exit_code == 0, r.output
    assert set(json.loads(r.stdout)) == {"baseline", "steered", "steer"}
    masked = [*common, "--without-image", "mask"]
    r = runner.invoke(app, ["vision", "generate", "Describe the image.", "--steer", "vhr", *masked])
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        app, ["vision", "generate", "Describe.", "--steer", "vhr", *common, "--without-image", "drop"]
    )
    assert r.exit_code == 2 and "'drop'" in r.output  # one line naming the bad value
    r = runner.invoke(app, ["generate", "Describe the image.", "--steer", "vhr", *common])  # same command
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["steer"] == "vhr"
    r = runner.invoke(app, ["vision", "generate", "Describe.", "--steer", "var", *common])
    assert r.exit_code == 2 and "no known sink dims" in r.output  # unknown backbone: one line, exit 2
    r = runner.invoke(app, ["vision", "generate", "Describe.", "--steer", "var", "--sink-dims", "5", *common])
    assert r.exit_code == 0, r.output
    out = tmp_path / "vision.html"
    args = ["report", "vision", "--prompt", "Describe the image.", "--model", str(folder)]
    args += ["--image", str(img)]
    r = runner.invoke(
        app, [*args, "--sink-dims", "5", "--tau", "2", "--trace-tokens", "3", "--out", str(out), "--json"]
    )
    assert r.exit_code == 0, r.output
    html = out.read_text()
    assert "VHD per head" in html and "Image-centric heads" in html and "image grid" in html
    assert "T-VHD per generated token" in html
    per_token = json.loads(r.stdout)["t_vhd_per_token"]
    assert 1 <= len(per_token) <= 3 and all(x["t_vhd"] > 0 for x in per_token)
    r = runner.invoke(app, [*args, "--trace-tokens", "-1", "--out", str(tmp_path / "x.html")])
    assert r.exit_code == 2 and "--trace-tokens" in r.output
    r = runner.invoke(app, [*args, "--sink-dims", "5", "--out", str(out)])
    assert r.exit_code == 2  # refuses to overwrite without --force


def test_probe_cache_reused_one_extra_row(llama):
    """Generation reuses the probe pass's cache: the prompt is not prefilled again (only its last
    token re-runs), and the tokens equal those of a run without reuse."""
    sm = SteeredModel(llama)
    lens: list[int] = []
    h = llama.layers[0].register_forward_pre_hook(lambda m, a: lens.append(a[0].shape[1]))
    try:
        reused = sm.generate(PROMPTS, Vhr(layers=(1, 3)), chat=False, max_new_tokens=6)
        probe_and_steps = list(lens)
        lens.clear()
        plain = sm.generate(PROMPTS, Vhr(layers=(1, 3), reuse_cache=False), chat=False, max_new_tokens=6)
    finally:
        h.remove()
    p = _enc(llama).length
    assert probe_and_steps == [p, 1, 1, 1, 1, 1, 1]  # probe (2B rows), then one row per step
    assert lens == [p, p, 1, 1, 1, 1, 1]  # without reuse the prompt is prefilled twice
    assert reused.token_ids == plain.token_ids


# --------------------------------------------------------------------------- without_image="mask"
def _oracle_masked(model, inputs: dict, keep: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Independent oracle of the masked branch: the plain HF forward of one row with a custom 4D
    mask (causal, and False on the removed keys for every query) and its own positions; returns the
    last-position head outputs `[H, d]` per layer and the last logits."""
    p = inputs["input_ids"].shape[-1]
    causal = torch.ones(p, p, dtype=torch.bool).tril()
    mask4 = (causal & keep[None, :])[None, None]
    zs: list[torch.Tensor] = []
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, a: zs.append(a[0][0, -1].reshape(model.n_heads, model.d_head))
        )
        for m in model.out_projs
    ]
    try:
        out = model.model(**{**inputs, "attention_mask": mask4})
    finally:
        for h in hooks:
            h.remove()
    return zs, out.logits[0, -1]


def _plain_heads(model, inputs: dict) -> list[torch.Tensor]:
    zs: list[torch.Tensor] = []
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, a: zs.append(a[0][0, -1].reshape(model.n_heads, model.d_head))
        )
        for m in model.out_projs
    ]
    try:
        model.model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return zs


def _check_masked_branch(model, enc, spans, text_inputs: dict):
    """VHD / TA of the masked branch (alpha = 1: nothing reinforced) against the 4D-mask oracle."""
    from steer.vhr.method import no_span_rows

    v = Vhr(alpha=1.0, layers=(model.n_layers - 1,), without_image="mask", target="auto")
    sel = v.select(model, enc)
    keep = no_span_rows(model, enc, spans)[0]
    assert not keep.all()
    with_z = _plain_heads(model, text_inputs)
    masked_z, masked_logits = _oracle_masked(model, text_inputs, keep)
    for la in range(model.n_layers):
        torch.testing.assert_close(
            sel.vhd[0, la], (with_z[la] - masked_z[la]).norm(dim=-1), atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(sel.ta[0, la], masked_z[la].pow(2).sum(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sel.probe_logits[1], masked_logits.float(), atol=1e-4, rtol=1e-4)
    return sel


def test_mask_branch_equals_4d_mask_oracle_text(llama):
    enc = _enc(llama, PROMPTS[:1])
    inputs = {"input_ids": enc.input_ids, "position_ids": torch.arange(enc.length)[None]}
    sel = _check_masked_branch(llama, enc, enc.spans, inputs)
    # positions are kept: the masked branch differs from the delete branch (renumbered positions)
    deleted = Vhr(alpha=1.0, layers=(3,)).select(llama, enc)
    assert not torch.allclose(sel.vhd, deleted.vhd, atol=1e-4)
    # the probe inputs of the masked branch: same ids and positions, mask 0 exactly on the span
    inp = probe_inputs(llama, enc, enc.spans, "mask")
    assert torch.equal(inp["input_ids"][0], inp["input_ids"][1])
    assert torch.equal(inp["position_ids"][0], inp["position_ids"][1])
    t0, t1 = enc.spans[0][0]
    assert inp["attention_mask"][1].tolist() == [0 if t0 <= j < t1 else 1 for j in range(enc.length)]


def test_mask_branch_equals_4d_mask_oracle_image():
    vlm = make_tiny_vlm("llava")
    sm = SteeredModel(vlm)
    enc = sm.encode(["Describe the image."], images=[tiny_image(1)])
    assert not enc.inputs.keys() - {"pixel_values", "image_sizes"}
    inputs = {
        "input_ids": enc.input_ids,
        "position_ids": enc.position_ids(),
        **{k: v for k, v in enc.inputs.items()},
    }
    _check_masked_branch(vlm, enc, enc.image_spans, inputs)
    gen_mask = sm.generate(
        ["Describe the image."], Vhr(layers=(1,), without_image="mask"), images=[tiny_image(1)]
    )
    assert len(gen_mask.token_ids[0]) >= 1


@pytest.mark.parametrize("kind", ["qwen2_vl", "idefics3"])
def test_mask_branch_runs_on_other_families(kind):
    vlm = make_tiny_vlm(kind)
    sm = SteeredModel(vlm)
    enc = sm.encode(["Describe the image.", "What?"], images=[tiny_image(1), tiny_image(2)])
    inp = probe_inputs(vlm, enc, enc.image_spans, "mask")
    b = enc.batch
    assert torch.equal(inp["input_ids"][:b], inp["input_ids"][b:])
    assert torch.equal(inp["position_ids"][..., :b, :], inp["position_ids"][..., b:, :])
    sel = Vhr(layers=(1,), without_image="mask").select(vlm, enc)
    assert torch.isfinite(sel.vhd).all() and (sel.vhd[:, 0] > 0).any()


def test_mask_is_default_off_and_checked(llama):
    enc = _enc(llama)
    assert Vhr().without_image == "delete"
    a = Vhr(layers=(1, 3)).select(llama, enc)
    b = Vhr(layers=(1, 3), without_image="delete").select(llama, enc)
    assert torch.equal(a.vhd, b.vhd) and all(torch.equal(a.heads[la], b.heads[la]) for la in (1, 3))
    assert torch.equal(
        probe_inputs(llama, enc, enc.spans)["input_ids"],
        probe_inputs(llama, enc, enc.spans, "delete")["input_ids"],
    )
    for bad in ("drop", None, 1):
        with pytest.raises(ValueError, match="without_image"):
            Vhr(without_image=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="without_image"):
            probe_inputs(llama, enc, enc.spans, bad)  # type: ignore[arg-type]


def test_mask_span_at_first_token_stays_finite(llama):
    """A passage at the very first column leaves its own query rows with no visible key in the
    masked branch; nothing may turn NaN (those rows are never attended to)."""
    enc = _enc(llama, ["**Alice lives in Rome and teaches music.** Where does Alice live?"])
    assert enc.spans[0][0][0] == 0
    sel = Vhr(layers=(1, 3), without_image="mask").select(llama, enc)
    assert torch.isfinite(sel.vhd).all() and torch.isfinite(sel.probe_logits).all()
    inputs = {"input_ids": enc.input_ids, "position_ids": torch.arange(enc.length)[None]}
    _check_masked_branch(llama, enc, enc.spans, inputs)


# --------------------------------------------------------------------------- T-VHD per decode step
def test_vhd_trace_step0_cache_and_oracle(llama):
    from steer.vhr.trace import vhd_trace

    prompt = PROMPTS[0]
    tr = vhd_trace(llama, prompt, chat=False, max_new_tokens=5, k=2)
    n = len(tr.frame)
    assert n == 5 and list(tr.frame.columns) == ["step", "token_id", "token", "t_vhd"]
    assert tr.vhd.shape == (n, llama.n_layers, llama.n_heads)
    # step 0 = the prefill (probe) VHD of Vhr(alpha=1).select; T-VHD from it
    enc = _enc(llama, [prompt])
    sel = Vhr(alpha=1.0, layers=(1,)).select(llama, enc)
    torch.testing.assert_close(tr.vhd[0], sel.vhd[0], atol=1e-6, rtol=1e-6)
    assert tr.frame.t_vhd[0] == pytest.approx(float(t_vhd(sel.vhd[0], k=2)), rel=1e-5)
    torch.testing.assert_close(torch.tensor(tr.frame.t_vhd.tolist()), t_vhd(tr.vhd, k=2))
    # the with-image row decodes exactly like plain greedy generation
    plain = llama.model.generate(
        input_ids=enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=5, do_sample=False
    )
    assert tr.frame.token_id.tolist() == plain[0, enc.length :].tolist()
    # labels are readable text as in every other table: `␣the`, not the raw decode ` the`
    assert tr.frame.token.tolist() == readable_tokens(llama.tokenizer, tr.frame.token_id.tolist())
    # cached = uncached (full re-run of both rows every step)
    slow = vhd_trace(llama, prompt, chat=False, max_new_tokens=5, k=2, use_cache=False)
    assert slow.frame.token_id.tolist() == tr.frame.token_id.tolist()
    torch.testing.assert_close(slow.vhd, tr.vhd, atol=1e-5, rtol=1e-5)
    # independent oracle at the last step: two separate runs with the generated history
    t0, t1 = enc.spans[0][0]
    hist = torch.tensor(tr.frame.token_id.tolist()[:-1])
    ids = enc.input_ids[0]
    with_z = _plain_heads(llama, {"input_ids": torch.cat([ids, hist])[None]})
    without_z = _plain_heads(llama, {"input_ids": torch.cat([ids[:t0], ids[t1:], hist])[None]})
    for la in range(llama.n_layers):
        torch.testing.assert_close(
            tr.vhd[-1, la], (with_z[la] - without_z[la]).norm(dim=-1), atol=1e-5, rtol=1e-5
        )
    # mask branch, cached = uncached too
    m1 = vhd_trace(llama, prompt, chat=False, max_new_tokens=3, without_image="mask")
    m2 = vhd_trace(llama, prompt, chat=False, max_new_tokens=3, without_image="mask", use_cache=False)
    torch.testing.assert_close(m1.vhd, m2.vhd, atol=1e-5, rtol=1e-5)


def test_vhd_trace_bad_input(llama):
    from steer.vhr.trace import vhd_trace

    for kw in (
        {"max_new_tokens": 0},
        {"max_new_tokens": True},
        {"k": 0},
        {"k": llama.n_heads + 1},
        {"reduce": "max"},
        {"target": "audio"},
        {"without_image": "drop"},
    ):
        with pytest.raises(ValueError):
            vhd_trace(llama, PROMPTS[0], chat=False, **kw)
    with pytest.raises(ValueError, match="one prompt"):
        vhd_trace(llama, PROMPTS, chat=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="to remove"):
        vhd_trace(llama, "no markup here", chat=False)
    for kw in ({"use_cache": "no"}, {"use_cache": None}, {"chat": "yes"}):
        with pytest.raises(TypeError, match="must be True"):
            vhd_trace(llama, PROMPTS[0], **kw)
    for kw in ({"reinforce_without": "no"}, {"outliers": None}, {"reuse_cache": "x"}):
        with pytest.raises(TypeError, match="must be True or False"):
            Vhr(**kw)
    for ddof in (True, 0.0, 2):
        with pytest.raises(ValueError, match="ddof"):
            Vhr(ddof=ddof)


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl", "idefics3"])
def test_vhd_trace_vlm_cached_equals_uncached(kind):
    from steer.vhr.trace import vhd_trace

    vlm = make_tiny_vlm(kind)
    fast = vhd_trace(vlm, "Describe the image.", images=tiny_image(1), max_new_tokens=3)
    slow = vhd_trace(vlm, "Describe the image.", images=tiny_image(1), max_new_tokens=3, use_cache=False)
    assert fast.frame.token_id.tolist() == slow.frame.token_id.tolist()
    torch.testing.assert_close(fast.vhd, slow.vhd, atol=1e-4, rtol=1e-4)
    enc = SteeredModel(vlm).encode(["Describe the image."], images=[tiny_image(1)])
    sel = Vhr(alpha=1.0, layers=(1,)).select(vlm, enc)
    torch.testing.assert_close(fast.vhd[0], sel.vhd[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl", "idefics3"])
def test_without_rows_drop_every_image_token_and_marker(kind):
    """§6.5 complete removal: the without-image rows hold no image token and no image-framing
    marker (Qwen2-VL vision start / end, Idefics3 fake-image / global-image / tile tokens); every
    other token stays, in order."""
    from steer.vhr.method import _marker_ids

    vlm = make_tiny_vlm(kind)
    enc = SteeredModel(vlm).encode(["Describe the image.", "What?"], images=[tiny_image(1), tiny_image(2)])
    inp = probe_inputs(vlm, enc, enc.image_spans)
    b = enc.batch
    img_id = vlm.model.config.image_token_id
    markers = _marker_ids(vlm)
    if kind != "llava":
        assert markers  # the family frames its images
    for r in range(b):
        with_ids = enc.input_ids[r][enc.attention_mask[r].bool()].tolist()
        without = inp["input_ids"][b + r][inp["attention_mask"][b + r].bool()].tolist()
        assert img_id not in without and not markers & set(without)
        assert without == [t for t in with_ids if t != img_id and t not in markers]
