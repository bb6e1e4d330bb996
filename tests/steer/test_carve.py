"""CARVE (docs/methods/carve.md) on the tiny VLMs: the contrast map, the pixel mask and the refined
image against an oracle of the written rule (attention read with the model's own
`output_attentions`, the ratio, the bilinear upsampling and the quantile written out here)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from heads.scorers.image_attention import attention_entropy, convergence, image_grid
from steer import SteeredModel
from steer.carve import Carve, contrast_map, pixel_mask, refine_image
from tests.support.vlm_models import image as tiny_image
from tests.support.vlm_models import make_tiny_vlm

QUESTION = "What colour is the square in the corner?"


@pytest.fixture(scope="module")
def llava():
    return make_tiny_vlm("llava", attn="eager")


@pytest.fixture(scope="module")
def idefics():
    return make_tiny_vlm("idefics3")


def _own_maps(model, prompt, img):
    """`[L, n]` head-mean attention of the last prompt token on the image, from output_attentions."""
    enc = SteeredModel(model).encode([prompt], images=[img])
    with torch.no_grad():
        out = model.model(**enc.model_inputs(), output_attentions=True)
    t0, t1 = enc.image_spans[0][0]
    rows = torch.stack([a[0, :, -1, t0:t1].float().mean(0) for a in out.attentions])  # [L, n]
    return rows / rows.sum(-1, keepdim=True)


def _bilinear(grid: np.ndarray, h: int, w: int) -> np.ndarray:
    """Bilinear upsampling with half-pixel centres (align_corners=False), edges clamped."""
    r, c = grid.shape

    def axis(n_out, n_in):
        src = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, None)
        i0 = np.minimum(np.floor(src).astype(int), n_in - 1)
        i1 = np.minimum(i0 + 1, n_in - 1)
        return i0, i1, src - i0

    y0, y1, fy = axis(h, r)
    x0, x1, fx = axis(w, c)
    top = grid[y0][:, x0] * (1 - fx) + grid[y0][:, x1] * fx
    bot = grid[y1][:, x0] * (1 - fx) + grid[y1][:, x1] * fx
    return top * (1 - fy[:, None]) + bot * fy[:, None]


def test_matches_oracle_on_tiny_llava(llava):
    img = tiny_image(3)
    carve = Carve(keep=0.4, eps=1e-3)
    got = carve.maps(llava, [QUESTION], [img])[0][0]
    t = _own_maps(llava, QUESTION, img)
    g = _own_maps(llava, carve.general, img)
    assert torch.allclose(got.task.maps, t, atol=1e-6) and torch.allclose(got.general.maps, g, atol=1e-6)
    layers = [llava.n_layers // 2 + i for i in range(llava.n_layers - llava.n_layers // 2)]
    assert got.layers == layers
    ratio = t[layers] / (g[layers] + 1e-3)
    ratio = ratio / ratio.sum(-1, keepdim=True)
    want = ratio.mean(0) / ratio.mean(0).sum()
    assert torch.allclose(got.contrast, want, atol=1e-6)
    assert got.task.grid == (4, 4) and got.contrast.numel() == 16  # the patch grid
    up = _bilinear(want.numpy().reshape(4, 4), img.height, img.width)
    thr = np.quantile(up.ravel(), 0.6)
    assert np.array_equal(got.mask.numpy(), up >= thr - 1e-7)
    # refined: kept pixels unchanged, the others the mean colour
    arr, ref = np.asarray(img), np.asarray(got.refined)
    mean = np.rint(arr.reshape(-1, 3).mean(0))
    assert np.array_equal(ref[got.mask.numpy()], arr[got.mask.numpy()])
    assert (ref[~got.mask.numpy()] == mean).all()
    assert 0.35 <= got.mask.float().mean() <= 0.5


def test_generate_answers_on_the_refined_image(idefics):
    sm = SteeredModel(idefics)
    img = tiny_image(5)
    carve = Carve(keep=0.5)
    kw = dict(max_new_tokens=4, progress=False)
    out = sm.generate([QUESTION, "Describe it."], carve, images=[img, tiny_image(6)], **kw)
    refined = [per[0].refined for per in carve.last["maps"]]
    plain = sm.generate([QUESTION, "Describe it."], [], images=refined, **kw)
    assert out.token_ids == plain.token_ids  # CARVE = the unedited model on the refined input
    again = Carve(keep=0.5).refine_images(idefics, [QUESTION, "Describe it."], [img, tiny_image(6)])
    assert all(np.array_equal(np.asarray(a[0]), np.asarray(b)) for a, b in zip(again, refined, strict=True))
    # the contrast map lives on the image's token grid (Idefics3: 2 x 2)
    m = carve.last["maps"][0][0]
    assert m.task.grid == (2, 2) and m.contrast.shape == (4,) and m.mask.shape == (img.height, img.width)


def test_keep_one_is_a_noop(idefics):
    sm = SteeredModel(idefics)
    img = tiny_image(7)
    kw = dict(max_new_tokens=3, progress=False)
    assert (
        sm.generate(QUESTION, Carve(keep=1.0), images=[img], **kw).token_ids
        == sm.generate(QUESTION, [], images=[img], **kw).token_ids
    )


def test_crop_and_rules():
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[2:5, 3:7] = True
    from PIL import Image

    img = Image.fromarray(np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3))
    crop = refine_image(img, mask, "crop")
    assert crop.size == (4, 3) and np.array_equal(np.asarray(crop), np.asarray(img)[2:5, 3:7])
    c = contrast_map(torch.tensor([[0.5, 0.5], [0.9, 0.1]]), torch.tensor([[0.5, 0.5], [0.5, 0.5]]), eps=0.0)
    assert torch.allclose(c, torch.tensor([0.7, 0.3]))
    m = pixel_mask(torch.tensor([0.1, 0.2, 0.3, 0.4]), (2, 2), (4, 4), keep=0.25)
    assert m[2:, 2:].all() and int(m.sum()) >= 4
    assert attention_entropy(torch.full((4,), 0.25)).item() == pytest.approx(1.0)
    assert attention_entropy(torch.tensor([1.0, 0.0, 0.0, 0.0])).item() == pytest.approx(0.0, abs=1e-6)
    assert convergence(torch.tensor([0.7] + [0.3 / 19] * 19)).item() == pytest.approx(0.7 + 0.3 / 19)
    assert math.isclose(float(convergence(torch.full((10,), 0.1))), 0.1, rel_tol=1e-6)


def test_bad_input(llava, tiny_llama):
    for kw, msg in [
        ({"keep": 0.0}, "keep"),
        ({"keep": 1.5}, "keep"),
        ({"eps": 0.0}, "eps"),
        ({"refine": "blur"}, "refine"),
        ({"general": " "}, "general"),
        ({"layers": (-1,)}, "layer"),
    ]:
        with pytest.raises(ValueError, match=msg):
            Carve(**kw)
    with pytest.raises(ValueError, match="vision-language"):
        Carve().maps(tiny_llama, ["hi"], None)
    with pytest.raises(ValueError, match="images"):
        Carve().maps(llava, ["hi"], None)
    with pytest.raises(ValueError, match="layer"):
        Carve(layers=(7,)).maps(llava, ["hi"], [tiny_image(1)])


def test_image_grid_qwen2_vl():
    vlm = make_tiny_vlm("qwen2_vl")
    enc = SteeredModel(vlm).encode(["a", "b"], images=[tiny_image(1), tiny_image(2)])
    t0, t1 = enc.image_spans[1][0]
    assert image_grid(vlm, enc, 1, 0, t1 - t0) == (2, 2)
