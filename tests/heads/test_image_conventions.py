"""Image arrays are read with their own convention (uint8 0..255, float [0, 1]); ambiguous or
unreadable images are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from heads.errors import HeadsteerValueError
from heads.inputs.images import as_pil, encode_image_prompts, normalize_images
from tests.support.vlm_models import make_tiny_vlm

RNG = np.random.default_rng(0)
PIXELS = RNG.integers(0, 256, size=(12, 10, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    "image",
    [
        Image.fromarray(PIXELS),
        PIXELS,
        torch.from_numpy(PIXELS).permute(2, 0, 1),  # uint8 CHW tensor
        PIXELS.astype(np.float32) / 255,  # float HWC in [0, 1]
        torch.from_numpy(PIXELS).permute(2, 0, 1).float() / 255,  # torchvision: float CHW in [0, 1]
        PIXELS.astype(np.int64),
    ],
)
def test_every_documented_type_gives_the_same_picture(image):
    assert np.array_equal(np.asarray(as_pil(image)), PIXELS)


def test_the_model_sees_the_same_pixels_from_a_float_tensor_as_from_pil():
    hm = make_tiny_vlm("llava")
    as_float = torch.from_numpy(PIXELS).permute(2, 0, 1).float() / 255
    a = encode_image_prompts(hm, "describe", Image.fromarray(PIXELS))
    b = encode_image_prompts(hm, "describe", as_float)
    assert torch.allclose(a.inputs["pixel_values"], b.inputs["pixel_values"])


@pytest.mark.parametrize(
    ("image", "needle"),
    [
        (PIXELS.astype(np.float32), r"float image array must hold values in \[0, 1\]"),
        (np.full((4, 4, 3), np.nan, dtype=np.float32), r"\[0, 1\]"),
        (PIXELS.astype(np.int64) * 2, "0..255"),
        (np.zeros((4, 4, 3), dtype=bool), "dtype bool"),
        (np.zeros((5, 6, 7), dtype=np.uint8), "no channel dimension"),
    ],
)
def test_ambiguous_images_are_refused_by_name(image, needle):
    with pytest.raises(HeadsteerValueError, match=needle):
        normalize_images(image, 1)


def test_a_file_that_is_not_an_image_is_one_line_error(tmp_path):
    f = tmp_path / "notes.png"
    f.write_text("not an image at all")
    with pytest.raises(HeadsteerValueError, match="notes.png.*not an image Pillow can read") as info:
        normalize_images(str(f), 1)
    assert "\n" not in str(info.value)
