"""Vision pairs: image-token activation patching on tiny LLaVA-style VLMs equals a plain loop.

The oracle never uses the engine: it runs the VLM's own forward (`pixel_values` through the
vision tower), records the clean site with one hook, and writes it into the corrupted forward
with one hook (whole model, fp32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heads import SweepOptions
from heads.inputs.images import encode_image_prompts
from heads.inputs.prompts import position_ids
from heads.scorers.patching.activation import _qkv_modules, _qkv_slices, patch
from heads.scorers.patching.logit import direct_logit_attribution
from heads.scorers.patching.metrics import get_metric
from heads.scorers.patching.pairs import encode_pairs
from heads.scorers.patching.path import path_patch
from heads.scorers.patching.synthetic_images import COLOURS, colour_pairs, minimal_image_pair
from heads.scorers.patching.vision import ImagePair, ImagePairBatch, _check_aligned, encode_image_pairs
from tests.support import make_tiny
from tests.support.patching import PAIRS, state_copy
from tests.support.vlm_models import IMAGE_TOKENS, image, make_tiny_vlm

OPTS = SweepOptions(max_rows=16, progress=False)


def _two_pairs() -> list[ImagePair]:
    """Two pairs with prompts of different lengths (left padding), one image per side."""
    ps = colour_pairs(2, seed=3)
    return [
        ps[0],
        ImagePair("Colour?", ps[1].clean_image, ps[1].corrupted_image, ps[1].answer, ps[1].counterfactual),
    ]


_CACHE: dict = {}


def _vlm(kind: str, attn: str = "sdpa"):
    if (kind, attn) not in _CACHE:
        hm = make_tiny_vlm(kind, attn=attn)
        _CACHE[(kind, attn)] = (hm, encode_image_pairs(hm, _two_pairs()))
    return _CACHE[(kind, attn)]


@torch.no_grad()
def _forward(model, pairs: ImagePairBatch, side: str, hooks=(), attentions=False):
    """The VLM's own forward on one side (its pixel_values), with `hooks` [(module, kind, fn)]."""
    hs = []
    for module, kind, fn in hooks:
        if kind == "pre":
            hs.append(module.register_forward_pre_hook(fn, with_kwargs=True))
        else:
            hs.append(module.register_forward_hook(fn))
    try:
        out = model.model(
            input_ids=pairs.ids(side),
            attention_mask=pairs.attention_mask,
            position_ids=position_ids(pairs.attention_mask),
            output_attentions=attentions,
            **pairs.image_inputs(side),
        )
    finally:
        for h in hs:
            h.remove()
    return out


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _record(model, pairs, side, kind, layer):
    """The site's activation `[N, T, ...]` on the VLM's own forward of `side`."""
    box = {}
    if kind == "resid_pre":

        def pre(mod, args, kwargs):
            box["x"] = (args[0] if args else kwargs["hidden_states"]).clone()

        hooks = [(model.layers[layer], "pre", pre)]
    elif kind in ("head_out", "head_out_by_pos"):

        def pre(mod, args, kwargs):
            box["x"] = args[0].clone()

        hooks = [(model.out_projs[layer], "pre", pre)]
    elif kind in ("attn_out", "mlp_out", "q", "k", "v"):
        module = (
            model.attentions[layer]
            if kind == "attn_out"
            else model.mlp(layer)
            if kind == "mlp_out"
            else _qkv_modules(model, layer)["qkv".index(kind)]
        )

        def post(mod, args, out):
            box["x"] = _first(out).clone()

        hooks = [(module, "post", post)]
    elif kind == "pattern":
        return _forward(model, pairs, side, attentions=True).attentions[layer].float()
    _forward(model, pairs, side, hooks)
    return box["x"]


def _oracle(model, pairs, kind, layer, index, pos, direction):
    """Logits `[N, V]` of the base side's VLM forward with one site written from the source side."""
    base, src_side = ("corrupted", "clean") if direction == "denoising" else ("clean", "corrupted")
    src = _record(model, pairs, src_side, kind, layer)
    H, d = model.n_heads, model.d_head
    sel = slice(None) if pos < 0 else slice(pos, pos + 1)
    if kind == "resid_pre":

        def pre(mod, args, kwargs):
            x = (args[0] if args else kwargs["hidden_states"]).clone()
            x[:, sel] = src[:, sel]
            return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

        hooks = [(model.layers[layer], "pre", pre)]
    elif kind in ("head_out", "head_out_by_pos"):

        def pre(mod, args, kwargs):
            x = args[0].clone().reshape(*args[0].shape[:-1], H, d)
            x[:, sel, index] = src.reshape(*src.shape[:-1], H, d)[:, sel, index]
            return (x.reshape(args[0].shape), *args[1:]), kwargs

        hooks = [(model.out_projs[layer], "pre", pre)]
    elif kind in ("attn_out", "mlp_out"):

        def post(mod, args, out):
            o = _first(out).clone()
            o[:, sel] = src[:, sel]
            return (o, *out[1:]) if isinstance(out, tuple) else o

        hooks = [(model.attentions[layer] if kind == "attn_out" else model.mlp(layer), "post", post)]
    elif kind in ("q", "k", "v"):
        j = "qkv".index(kind)
        sl = _qkv_slices(model)[j]
        cols = slice(sl.start + index * d, sl.start + (index + 1) * d)

        def post(mod, args, out):
            o = out.clone()
            o[..., cols] = src[..., cols]
            return o

        hooks = [(_qkv_modules(model, layer)[j], "post", post)]
    else:  # pattern: z_h = P_src[h] @ v of this run
        seen = {}
        vj = _qkv_slices(model)[2]

        def keep_v(mod, args, out):
            seen["v"] = out[..., vj]

        def z_pat(mod, args, kwargs):
            x = args[0].clone().reshape(*args[0].shape[:-1], H, d)
            g = index // model.n_groups
            v = seen["v"][..., g * d : (g + 1) * d]
            x[:, :, index] = torch.einsum("nqk,nkd->nqd", src[:, index], v.float()).to(x.dtype)
            return (x.reshape(args[0].shape), *args[1:]), kwargs

        hooks = [(_qkv_modules(model, layer)[2], "post", keep_v), (model.out_projs[layer], "pre", z_pat)]
    return _forward(model, pairs, base, hooks).logits[:, -1].float()


def _check(model, pairs, kind, direction="denoising", positions=None, layers=None):
    before = state_copy(model)
    emb = model.decoder.get_input_embeddings()
    res = patch(model, pairs, kind, direction=direction, layers=layers, positions=positions, options=OPTS)
    assert all(torch.equal(v, before[k]) for k, v in model.model.state_dict().items())
    assert not emb._forward_hooks and not model.decoder._forward_pre_hooks  # every hook removed
    met, idx = get_metric(), torch.arange(pairs.n)
    clean = _forward(model, pairs, "clean").logits[:, -1].float()
    corrupt = _forward(model, pairs, "corrupted").logits[:, -1].float()
    # endpoints: the unpatched metrics are the VLM's own runs with each image
    assert torch.allclose(res.clean, met(clean, pairs, idx, clean), atol=1e-5)
    assert torch.allclose(res.corrupt, met(corrupt, pairs, idx, clean), atol=1e-5)
    assert float((res.clean - res.corrupt).abs().min()) > 1e-4  # the images make a difference
    poss = res.params["positions"]
    worst = 0.0
    for li, la in enumerate(res.params["layers"]):
        if res.grid == ("layer", "position"):
            cells = [((li, pi), (-1, p)) for pi, p in enumerate(poss)]
        elif res.grid == ("layer", "head", "position"):
            cells = [((li, h, pi), (h, p)) for h in range(res.raw.shape[1]) for pi, p in enumerate(poss)]
        else:
            cells = [((li, h), (h, -1)) for h in range(res.raw.shape[1])]
        for cell, (index, pos) in cells:
            want = met(_oracle(model, pairs, kind, la, index, pos, direction), pairs, idx, clean)
            worst = max(worst, float((res.raw[cell] - want).abs().max()))
    assert worst < 1e-5, (kind, worst)
    return res


def _image_and_text_columns(pairs: ImagePairBatch) -> list[int]:
    s, e = pairs.image_spans[0][0]
    return [s, s + 1, e - 1, e, pairs.width - 1]  # first, second, last image token; text after; last


@pytest.mark.parametrize(
    "kind", ["head_out", "head_out_by_pos", "resid_pre", "attn_out", "mlp_out", "q", "k", "v"]
)
def test_llava_image_patching_equals_oracle(kind):
    model, pairs = _vlm("llava")
    assert (pairs.attention_mask == 0).any()  # the two prompts differ in length: left padding
    assert torch.equal(pairs.clean_ids, pairs.corrupted_ids)
    by_pos = kind in ("head_out_by_pos", "resid_pre", "attn_out", "mlp_out")
    res = _check(model, pairs, kind, positions=_image_and_text_columns(pairs) if by_pos else None)
    if by_pos:
        assert res.labels[:3] == ["<image 0>", "<image 1>", f"<image {IMAGE_TOKENS['llava'] - 1}>"]
        assert not res.labels[3].startswith("<image") and res.params["image_positions"] == [0, 1, 2]


def test_llava_pattern_and_noising_equal_oracle():
    model, pairs = _vlm("llava", attn="eager")
    _check(model, pairs, "pattern", layers=[1])
    _check(model, pairs, "head_out_by_pos", direction="noising", positions=_image_and_text_columns(pairs))


@pytest.mark.parametrize("kind", ["head_out_by_pos", "resid_pre"])
def test_idefics3_image_patching_equals_oracle(kind):
    model, pairs = _vlm("idefics3")
    res = _check(model, pairs, kind, positions=_image_and_text_columns(pairs))
    assert res.labels[:2] == ["<image 0>", "<image 1>"]


def test_layer0_text_positions_are_the_same_on_both_sides():
    """Both sides share their token ids: at layer 0 only the image columns differ, so patching a
    text column changes nothing (raw == the base run's metric, within fp32 batch noise) and the
    image columns do."""
    model, pairs = _vlm("llava")
    img = pairs.image_mask  # [N, T]: each pair's own image columns (left padding shifts them)
    for direction, endpoint in (("denoising", "corrupt"), ("noising", "clean")):
        res = patch(model, pairs, "resid_pre", layers=[0], direction=direction, options=OPTS)
        raw, base = res.raw[0], getattr(res, endpoint)  # [T, N], [N]
        for i in range(pairs.n):
            text = ~img[i]
            assert torch.allclose(raw[text, i], base[i].expand(int(text.sum())), atol=1e-5)
            assert float((raw[img[i], i] - base[i]).abs().max()) > 1e-4


def test_positions_image_and_frame():
    model, _ = _vlm("llava")
    pairs = encode_image_pairs(model, colour_pairs(2, seed=5))  # one prompt: one image layout
    cols = pairs.image_columns()
    assert len(cols) == IMAGE_TOKENS["llava"] and cols == list(range(*pairs.image_spans[0][0]))
    a = patch(model, pairs, "head_out_by_pos", positions="image", options=OPTS)
    b = patch(model, pairs, "head_out_by_pos", positions=cols, options=OPTS)
    assert torch.equal(a.raw, b.raw) and a.params["image_positions"] == list(range(len(cols)))
    fr = a.to_frame()
    assert set(fr["token"]) == {f"<image {k}>" for k in range(len(cols))}
    with pytest.raises(ValueError, match="positions='image' needs one layout"):
        patch(model, _vlm("llava")[1], "resid_pre", positions="image")


def test_select_and_split_keep_images():
    model, pairs = _vlm("llava")
    one = pairs.select([1])
    assert isinstance(one, ImagePairBatch) and one.width < pairs.width
    assert one.image_pairs[0].prompt == "Colour?" and len(pairs.image_pairs) == 2
    assert torch.equal(one.clean_inputs["pixel_values"], pairs.clean_inputs["pixel_values"][1:])
    s, e = one.image_spans[0][0]
    assert one.tokens[0][s:e] == [f"<image {k}>" for k in range(e - s)]
    full = patch(model, pairs, "head_out", options=OPTS)
    alone = patch(model, one, "head_out", options=OPTS)
    assert torch.allclose(full.raw[..., 1], alone.raw[..., 0], atol=1e-5)  # padding changes nothing
    a, b = pairs.split(0.5, seed=0)
    assert isinstance(a, ImagePairBatch) and a.n + b.n == 2


def test_synthetic_pair_differs_only_in_the_target_square():
    clean, corr = minimal_image_pair(16, colour="red", counterfactual="blue", cell=(1, 2), seed=0)
    a, b = np.asarray(clean), np.asarray(corr)
    diff = (a != b).any(-1)
    assert diff[4:8, 8:12].all() and diff.sum() == 16  # exactly the 4x4 target cell
    assert tuple(a[5, 9]) == COLOURS["red"] and tuple(b[5, 9]) == COLOURS["blue"]
    again = minimal_image_pair(16, cell=(1, 2), seed=0)
    assert np.array_equal(np.asarray(again[0]), a)
    ps = colour_pairs(3, seed=1)
    assert [p.answer for p in ps] == [f" {p.meta['colour']}" for p in ps]
    assert all(p.meta["colour"] != p.meta["counterfactual"] for p in ps)
    for bad, match in (
        (dict(size=15), "not a multiple of grid 4"),
        (dict(colour="red", counterfactual="red"), "same colour"),
        (dict(colour="mauve"), "'mauve' is not one of"),
        (dict(cell=(4, 0)), r"cell \(4, 0\) is outside the 4x4 grid"),
    ):
        with pytest.raises(ValueError, match=match):
            minimal_image_pair(**bad)


def test_bad_inputs_refused_before_any_forward(tokenizer, monkeypatch):
    model, pairs = _vlm("llava")
    ps = colour_pairs(1)
    big = image(0, size=32)
    with pytest.raises(
        ValueError, match=r"^pair 0: the clean image is 16x16 pixels, the corrupted image 32x32"
    ):
        encode_image_pairs(model, [ImagePair("Q?", ps[0].clean_image, big, " red")])
    with pytest.raises(ValueError, match="must be one image"):
        encode_image_pairs(model, [ImagePair("Q?", [ps[0].clean_image], ps[0].corrupted_image, " red")])
    with pytest.raises(TypeError, match="must be an ImagePair"):
        encode_image_pairs(model, [{"prompt": "Q?"}])
    with pytest.raises(ValueError, match="is 2 tokens"):
        encode_image_pairs(model, [ImagePair("Q?", ps[0].clean_image, ps[0].corrupted_image, " crimson")])
    # images that tokenize to different lengths: the check names both lengths
    short = encode_image_prompts(model, ["Q?"], [[image(0)]])
    long = encode_image_prompts(model, ["A longer question?"], [[image(0)]])
    with pytest.raises(
        ValueError, match=r"^pair 0: with the clean image the prompt is \d+ tokens, with the corrupted"
    ):
        _check_aligned(short, long)
    # a text-only model: named before any work
    text = make_tiny("llama", tokenizer)
    with pytest.raises(ValueError, match="text-only model"):
        encode_image_pairs(text, ps)
    text_pairs = encode_pairs(tokenizer, PAIRS)

    def no_forward(*a, **k):
        raise AssertionError("a forward ran")

    monkeypatch.setattr(type(text.model), "forward", no_forward)
    with pytest.raises(ValueError, match="text-only model"):
        patch(text, pairs, "head_out")
    with pytest.raises(ValueError, match="positions='image' needs vision pairs"):
        patch(make_tiny("llama", tokenizer), text_pairs, "resid_pre", positions="image")
    # analyses that would drop the images refuse vision pairs
    with pytest.raises(ValueError, match="taken by activation patching"):
        path_patch(model, pairs)
    with pytest.raises(ValueError, match="taken by activation patching"):
        direct_logit_attribution(model, pairs)


def test_unsupported_vlm_families_refused():
    qwen = make_tiny_vlm("qwen2_vl")
    with pytest.raises(ValueError, match="not supported on model_type 'qwen2_vl'.*M-RoPE"):
        encode_image_pairs(qwen, colour_pairs(1))


def test_nnsight_backend_refused_for_image_pairs():
    from nnsight.modeling.transformers import TransformersModel

    from heads import HeadModel

    model, pairs = _vlm("llava")
    tok = model.processor.tokenizer
    wrapped = HeadModel(TransformersModel(model.model, tokenizer=tok), tok, processor=model.processor)
    assert wrapped.backend.kind == "nnsight"
    with pytest.raises(ValueError, match="Hugging Face backend only, not 'nnsight'"):
        encode_image_pairs(wrapped, colour_pairs(1))
    with pytest.raises(ValueError, match="Hugging Face backend only, not 'nnsight'"):
        patch(wrapped, pairs, "head_out")


def test_idefics3_split_images_label_each_tile_and_equal_oracle():
    model = make_tiny_vlm("idefics3")
    improc = model.processor.image_processor
    improc.do_image_splitting, improc.size = True, {"longest_edge": 32}
    ps = colour_pairs(2, size=32, seed=2)
    pairs = encode_image_pairs(model, ps)
    n = IMAGE_TOKENS["idefics3"]
    assert [e - s for s, e in pairs.image_spans[0]] == [n] * 5  # 2 x 2 tiles + the global view
    assert pairs.clean_inputs["pixel_values"].shape[:2] == (2, 5)
    (s0, _), (s1, _) = pairs.image_spans[0][:2]
    assert pairs.position_labels(0)[s0 : s0 + 2] == ["<image 0.0>", "<image 0.1>"]
    assert pairs.position_labels(0)[s1] == "<image 1.0>"
    last = pairs.image_spans[0][-1][0]
    res = _check(model, pairs, "resid_pre", positions=[s0, s1 + 1, last, pairs.width - 1])
    assert res.labels == ["<image 0.0>", "<image 1.1>", "<image 4.0>", res.labels[-1]]
