"""Head-specific visual modulation (docs/methods/visual_modulation.md) on the tiny VLMs.

Oracles written here from the rule: VHD from two separate runs (with the image; with every image
token deleted) read at `o_proj`'s input; the two selection streams with explicit loops over the
grid; the amplified pattern as `a * (1 + gamma s_h)` on the selected columns, renormalised, from the
model's own attention (`output_attentions`)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from heads import encode_prompts, forward
from heads.engine.context import editing
from heads.engine.edits import Recorder
from steer import SteeredModel
from steer.noop import NoOpWarning
from steer.visual_modulation import VisualModulation, local_scores
from tests.support import make_tiny
from tests.support.vlm_models import image as tiny_image
from tests.support.vlm_models import make_tiny_vlm

PROMPTS = ["What colour is the square?", "Describe the picture in detail."]


@pytest.fixture(scope="module")
def llava():
    return make_tiny_vlm("llava", attn="eager")


def _enc(model, prompts=PROMPTS, seeds=(1, 2)):
    return SteeredModel(model).encode(prompts, images=[tiny_image(s) for s in seeds])


def _head_outputs(model, **inputs) -> torch.Tensor:
    """`[L, H, d]` o_proj inputs at the last position (a test-only hook)."""
    layers = model.model.model.language_model.layers
    got = []
    hooks = [
        la.self_attn.o_proj.register_forward_pre_hook(lambda m, a: got.append(a[0][0, -1].detach().clone()))
        for la in layers
    ]
    try:
        with torch.no_grad():
            model.model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([g.view(model.n_heads, -1) for g in got])


def test_vhd_and_selection_match_oracle(llava):
    enc = _enc(llava, PROMPTS[:1], (3,))
    v = VisualModulation(gamma=1.0, local_ratio=0.2, regions=2)
    v.edits(llava, enc)
    with_img = _head_outputs(llava, **enc.model_inputs())
    keep = ~enc.image_mask(0)
    without = _head_outputs(llava, input_ids=enc.input_ids[:, keep])
    vhd = (with_img - without).norm(dim=-1)
    assert torch.allclose(v.last["vhd"][0], vhd, atol=1e-4)
    layers = list(range(llava.n_layers // 2, llava.n_layers))
    want = vhd[layers] / vhd[layers].max()
    assert torch.allclose(v.last["sensitivity"][0, layers], want, atol=1e-4)
    # the two streams, by loops over the 4 x 4 grid
    sel = v.last["selection"][0][0]
    t0, t1 = sel.span
    with torch.no_grad():
        hs = llava.model(**enc.model_inputs(), output_hidden_states=True, output_attentions=True)
    x = hs.hidden_states[0][0, t0:t1].float()
    score = torch.zeros(16)
    for j in range(16):
        r, c = divmod(j, 4)
        cells = [(y, z) for y in range(r - 1, r + 2) for z in range(c - 1, c + 2) if (y, z) != (r, c)]
        nb = [4 * y + z for y, z in cells if 0 <= y < 4 and 0 <= z < 4]
        score[j] = (x[j] - x[nb].mean(0)).norm()
    assert torch.allclose(sel.local_score, score, atol=1e-4)
    top = sorted(range(16), key=lambda j: (-float(score[j]), j))[: math.ceil(0.2 * 16)]
    assert sel.local.nonzero().flatten().tolist() == sorted(top)
    att = torch.stack([a[0, :, -1, t0:t1].float().mean(0) for a in hs.attentions]).mean(0)
    assert torch.allclose(sel.attention, att, atol=1e-6)
    spatial = set()
    for ry in (range(0, 2), range(2, 4)):
        for rx in (range(0, 2), range(2, 4)):
            cells = [4 * y + z for y in ry for z in rx]
            spatial.add(max(cells, key=lambda k: (float(att[k]), -k)))
    assert set(sel.spatial.nonzero().flatten().tolist()) == spatial
    assert sel.selected.sum() == len(set(top) | spatial)


def test_amplified_pattern_matches_oracle(llava):
    enc = _enc(llava)
    last = llava.n_layers - 1  # only the last layer edited: its input is the unsteered one
    v = VisualModulation(gamma=3.0, layers=(last,), regions=2)
    edits = v.edits(llava, enc)
    rec = Recorder(layer=last)
    with editing(llava, [*edits, rec]):
        forward(llava, enc)
    got = torch.cat(rec.records, dim=2)
    with torch.no_grad():
        own = llava.model(**enc.model_inputs(), output_attentions=True).attentions[last].float()
    sens = v.last["sensitivity"][:, last]  # [B, H]
    for b in range(enc.batch):
        t0, t1 = enc.image_spans[b][0]
        cols = torch.zeros(enc.length, dtype=torch.bool)
        cols[t0:t1] = v.last["selection"][b][0].selected
        for h in range(llava.n_heads):
            a = own[b, h].clone()
            fac = torch.where(cols, 1 + 3.0 * sens[b, h], 1.0)
            amp = a * fac
            amp = amp / amp.sum(-1, keepdim=True)
            want = torch.where(torch.arange(enc.length)[:, None] >= t1, amp, a)
            assert torch.allclose(got[b, h], want, atol=1e-5), (b, h)
            assert torch.allclose(got[b, h].sum(-1)[enc.attention_mask[b].bool()], torch.ones(1), atol=1e-5)
    # GQA 4:2: each query head moves by its own sensitivity, the least sensitive one least
    assert sens.shape == (2, llava.n_heads)


def test_gamma_zero_noop_restore_batch_and_cache(llava):
    enc = _enc(llava)
    base = forward(llava, enc)
    with pytest.warns(NoOpWarning, match="no-op"):
        assert VisualModulation(gamma=0.0).edits(llava, enc) == []
    v = VisualModulation(gamma=4.0)
    with editing(llava, v.edits(llava, enc)):
        both = forward(llava, enc)
    assert torch.equal(forward(llava, enc), base)  # bitwise restored
    for b, p in enumerate(PROMPTS):
        alone = _enc(llava, [p], (b + 1,))
        with editing(llava, VisualModulation(gamma=4.0).edits(llava, alone)):
            one = forward(llava, alone)
        real = enc.attention_mask[b].bool()
        assert torch.allclose(both[b][real], one[0], atol=1e-4)
    sm = SteeredModel(llava)
    kw = dict(images=[tiny_image(1), tiny_image(2)], max_new_tokens=3, progress=False)
    cached = sm.generate(PROMPTS, VisualModulation(gamma=4.0), **kw)
    full = sm.generate(PROMPTS, VisualModulation(gamma=4.0), use_cache=False, **kw)
    assert cached.token_ids == full.token_ids


def test_text_variant(tokenizer):
    llama = make_tiny("llama", tokenizer, num_hidden_layers=2)
    prompt = "Read: **The capital of Freedonia is Zork and it is big.** Capital?"
    enc = encode_prompts(tokenizer, [prompt], chat=False)
    v = VisualModulation(gamma=2.0, local_ratio=0.25)
    edits = v.edits(llama, enc)
    sel = v.last["selection"][0][0]
    assert sel.grid == (1, sel.span[1] - sel.span[0])
    assert sel.local.sum() == math.ceil(0.25 * sel.local.numel())
    base = forward(llama, enc)
    with editing(llama, edits):
        steered = forward(llama, enc)
    t1 = sel.span[1]
    assert torch.equal(steered[0, :t1], base[0, :t1])  # rows up to the passage's end: unchanged
    assert not torch.allclose(steered[0, t1:], base[0, t1:])


def test_local_scores_borders():
    x = torch.arange(6, dtype=torch.float32).reshape(6, 1)  # a 2 x 3 grid, one feature
    s = local_scores(x, (2, 3))
    # token 0 (row 0, col 0) has neighbours 1, 3, 4: mean 8/3
    assert float(s[0]) == pytest.approx(abs(0 - 8 / 3))
    assert float(local_scores(torch.ones(1, 4), (1, 1))[0]) == 0.0


def test_bad_input(llava, tiny_llama):
    for kw, msg in [
        ({"gamma": -1.0}, "gamma"),
        ({"gamma": float("nan")}, "gamma"),
        ({"local_ratio": 0.0}, "local_ratio"),
        ({"regions": 0}, "regions"),
        ({"target": "audio"}, "target"),
        ({"without_image": "blur"}, "without_image"),
        ({"layers": (-2,)}, "layers"),
    ]:
        with pytest.raises(ValueError, match=msg):
            VisualModulation(**kw)
    enc = _enc(llava)
    with pytest.raises(ValueError, match="layer"):
        VisualModulation(layers=(9,)).edits(llava, enc)
    plain = encode_prompts(tiny_llama.tokenizer, ["no passage here"], chat=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="marked context"):
            VisualModulation().edits(tiny_llama, plain)
