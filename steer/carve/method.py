"""CARVE: contrastive attention refinement for visual enhancement (Ge et al., "Focusing by
Contrastive Attention: Enhancing VLMs' Visual Reasoning", 2025, arXiv:2509.06461;
docs/methods/carve.md). No public code was found: this follows the paper's written rule.

The paper models the attention of a query Q on the image tokens as semantic signal mixed with
question-independent visual noise. Under a general instruction ("Describe the image.") the map
holds almost only the noise, so the contrast of the task map against the general map isolates the
signal. For each image of a sample:

1. two prefills, the task prompt and the general instruction (same image); the per-layer attention
   of the last prompt token on the image tokens, averaged over heads and renormalised over the
   image (`heads.scorers.image_attention`): `T_l` and `G_l`;
2. the contrast per layer `C_l[j] = T_l[j] / (G_l[j] + eps)`, renormalised, averaged over the
   chosen layers (default the deeper half, where the paper finds attention converged), renormalised:
   `C`;
3. `C` on the image's token grid, upsampled bilinearly to the image's pixels; the pixels at or above
   the `(1 - keep)` quantile are kept (a pixel-level mask);
4. the refined image: the other pixels set to the image's mean colour (`refine="mask"`, default) or
   the image cropped to the kept pixels' bounding box (`refine="crop"`);
5. the task prompt is answered again on the refined image (`SteeredModel.generate` calls
   `refine_images` before it encodes the batch).

CARVE changes the input, not the attention: `edits` returns no edit, and the generation on the
refined image uses the model's own attention (other interventions in the same `steer` list apply
to it as usual).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from heads._util.validation import check_layer_list, check_number, is_number, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.images import encode_image_prompts, normalize_images
from heads.inputs.prompts import Emphasis, EncodedPrompts, Prompt
from heads.model.adapter import HeadModel
from heads.scorers.image_attention import ImageAttention, image_attention

__all__ = ["Carve", "CarveMaps", "contrast_map", "pixel_mask", "refine_image"]

Refine = Literal["mask", "crop"]

DEFAULT_GENERAL = "Describe the image."
"""The general instruction (the paper's example of a general query)."""


def default_carve_layers(n_layers: int) -> list[int]:
    """The deeper half: layers `n_layers // 2 .. n_layers - 1`."""
    return list(range(n_layers // 2, n_layers))


def contrast_map(task: torch.Tensor, general: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """CARVE's contrast `[n]` from per-layer maps `[L', n]` (each row summing to 1; step 2 of the
    module docstring): the per-layer ratio `T / (G + eps)` renormalised, averaged, renormalised."""
    c = task.float() / (general.float() + eps)
    c = c / c.sum(-1, keepdim=True).clamp(min=1e-30)
    m = c.mean(0)
    return m / m.sum().clamp(min=1e-30)


def pixel_mask(
    contrast: torch.Tensor, grid: tuple[int, int], size: tuple[int, int], keep: float
) -> torch.Tensor:
    """`[H, W]` bool pixel mask (step 3): the contrast `[rows * cols]` on its grid, upsampled
    bilinearly (`align_corners=False`) to `size = (H, W)`; True at or above the `(1 - keep)` quantile."""
    rows, cols = grid
    h, w = size
    up = torch.nn.functional.interpolate(
        contrast.float().reshape(1, 1, rows, cols), size=(h, w), mode="bilinear", align_corners=False
    )[0, 0]
    if keep >= 1:
        return torch.ones(h, w, dtype=torch.bool)
    thr = torch.quantile(up.flatten(), 1 - keep)
    return up >= thr


def refine_image(image: Any, mask: torch.Tensor, refine: Refine = "mask") -> Any:
    """The refined PIL image (step 4): outside `mask` `[H, W]` the image's mean colour (`"mask"`), or
    the crop to the mask's bounding box (`"crop"`)."""
    from PIL import Image

    arr = np.asarray(image.convert("RGB"))
    keep = mask.numpy()
    if refine == "crop":
        ys, xs = np.nonzero(keep)
        return Image.fromarray(arr[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1].copy())
    mean = np.rint(arr.reshape(-1, 3).astype(np.float64).mean(0)).astype(np.uint8)
    out = np.where(keep[..., None], arr, mean[None, None, :])
    return Image.fromarray(out.astype(np.uint8))


@dataclass
class CarveMaps:
    """What CARVE computed for one image of one prompt.

    Attributes:
        task: the per-layer image attention under the task prompt (`ImageAttention`: maps
            `[L, n]`, entropy, convergence, grid).
        general: the same under the general instruction.
        layers: the layers contrasted.
        contrast: `[n]` the contrast map (sums to 1), on `task.grid`.
        mask: `[H, W]` bool pixels kept.
        image: the input image (PIL).
        refined: the refined image (PIL).
    """

    task: ImageAttention
    general: ImageAttention
    layers: list[int]
    contrast: torch.Tensor
    mask: torch.Tensor
    image: Any
    refined: Any


def _prompt_count(prompts: Prompt | Sequence[Prompt]) -> int:
    if isinstance(prompts, str):
        return 1
    if isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], dict):
        return 1  # one chat
    return len(prompts) if isinstance(prompts, Sequence) else 1


@dataclass(frozen=True)
class Carve:
    """CARVE: answer on the image refined by the contrast of task and general attention (module docstring).

    Args:
        general: the general instruction (default `"Describe the image."`).
        keep: share of the image's pixels kept, in (0, 1] (default 0.5); 1 keeps the image (a no-op).
        layers: layers contrasted (default the deeper half, `n_layers // 2 ..`).
        eps: the regularisation constant of the ratio, > 0 (default 1e-3, on maps summing to 1).
        refine: `"mask"` (default: other pixels to the mean colour) or `"crop"` (bounding box).

    After `refine_images`, `last["maps"]` holds per prompt a list of `CarveMaps` (one per image).

    Raises:
        TypeError / ValueError: a bad value (at construction); when applied: prompts without images,
            a model without a processor, a layer outside the model.

    Source: Ge et al. 2025, §3 (observations), §4 (CARVE); no public code.
    """

    general: str = DEFAULT_GENERAL
    keep: float = 0.5
    layers: tuple[int, ...] | None = None
    eps: float = 1e-3
    refine: Refine = "mask"
    last: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.general, str) or not self.general.strip():
            raise HeadsteerValueError(
                f"general must be a non-empty instruction, got {short_repr(self.general)}"
            )
        check_number("keep", self.keep, lo=0, hi=1, lo_open=True)
        if not is_number(self.eps) or not math.isfinite(self.eps) or self.eps <= 0:
            raise HeadsteerValueError(f"eps must be a finite number > 0, got {short_repr(self.eps)}")
        if self.refine not in ("mask", "crop"):
            raise HeadsteerValueError(f"unknown refine {short_repr(self.refine)}: use 'mask' or 'crop'")
        if self.layers is not None:
            check_layer_list("layers", self.layers)
            if any(int(x) < 0 for x in self.layers):
                raise HeadsteerValueError(f"layers must be >= 0, got {short_repr(self.layers)}")
            object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))

    def target_layers(self, model: HeadModel) -> list[int]:
        """The contrasted layers for `model`, checked."""
        layers = default_carve_layers(model.n_layers) if self.layers is None else list(self.layers)
        for la in layers:
            model.check_head(la, 0)
        return sorted(set(layers))

    def maps(
        self,
        model: HeadModel,
        prompts: Prompt | Sequence[Prompt],
        images: object,
        *,
        chat: bool | None = None,
        emphasize: Emphasis = None,
        markup: bool = True,
    ) -> list[list[CarveMaps]]:
        """Per prompt, per image: the contrast maps, masks and refined images (steps 1-4).

        Raises:
            ValueError: no image in any prompt, a model without a processor, a bad layer.
        """
        if getattr(model, "processor", None) is None:
            raise HeadsteerValueError(
                f"CARVE needs a vision-language model; {short_repr(model.name)} has none"
            )
        layers = self.target_layers(model)
        n = _prompt_count(prompts)
        rows = normalize_images(images, n)
        if not any(rows):
            raise HeadsteerValueError("CARVE needs prompts with images (images= is empty)")
        task = encode_image_prompts(model, prompts, rows, emphasize=emphasize, chat=chat, markup=markup)
        gen = encode_image_prompts(model, [self.general] * n, rows, chat=chat, markup=False)
        t_maps = image_attention(model, task, target="image")  # every layer: entropy / convergence by depth
        g_maps = image_attention(model, gen, target="image")
        out: list[list[CarveMaps]] = []
        for b in range(n):
            per = []
            for k, image in enumerate(rows[b]):
                img: Any = image  # an RGB PIL image (normalize_images)
                t, g = t_maps[b][k], g_maps[b][k]
                if t.maps.shape[-1] != g.maps.shape[-1]:
                    raise HeadsteerValueError(
                        f"prompt {b}: image {k} has {t.maps.shape[-1]} tokens in the task prompt and "
                        f"{g.maps.shape[-1]} under the general instruction"
                    )
                c = contrast_map(t.maps[layers], g.maps[layers], self.eps)
                mask = pixel_mask(c, t.grid, (img.height, img.width), self.keep)
                per.append(CarveMaps(t, g, layers, c, mask, img, refine_image(img, mask, self.refine)))
            out.append(per)
        return out

    def refine_images(
        self,
        model: HeadModel,
        prompts: Prompt | Sequence[Prompt],
        images: object,
        *,
        chat: bool | None = None,
        emphasize: Emphasis = None,
        markup: bool = True,
    ) -> list[list[Any]]:
        """The refined images, one list per prompt (what `SteeredModel.generate` answers on).

        `keep = 1` returns the images unchanged without any forward. The maps are kept in
        `last["maps"]`.
        """
        n = _prompt_count(prompts)
        if self.keep >= 1:
            rows = normalize_images(images, n)
            self.last["maps"] = []
            return rows
        maps = self.maps(model, prompts, images, chat=chat, emphasize=emphasize, markup=markup)
        self.last["maps"] = maps
        return [[m.refined for m in per] for per in maps]

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list:
        """No attention edit: CARVE acts through `refine_images`."""
        if not isinstance(enc, EncodedPrompts):
            raise HeadsteerTypeError(f"enc must be EncodedPrompts, got {short_repr(enc)}")
        return []
