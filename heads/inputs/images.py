"""Images in the inputs: image-token spans, processor encoding and M-RoPE positions.

A vision-language model (LLaVA, Qwen2-VL, Idefics3 / SmolVLM) sees an image as a
run of placeholder tokens in its language model's input, whose embeddings the
model replaces by the vision tower's features. headsteer treats that run as a
*span* (docs/architecture.md, "Inputs with images"): PASTA can
emphasise it, VAR/VHR read it.

Image span per family (half-open token ranges, padded coordinates):

* LLaVA (and LLaVA-NeXT / -OneVision): every maximal run of `image_token_id`
  (`encode_image_prompts` also splits a run where one image ends and the next
  begins, using the processor's replacement offsets, so each image is one span).
* Qwen2-VL / Qwen2.5-VL: the tokens strictly between `vision_start_token_id` and
  `vision_end_token_id` (the `<|image_pad|>` run); positions are 3D M-RoPE
  (`[3, B, T]`, from the model's own `get_rope_index`).
* Idefics3 / SmolVLM: every maximal run of `image_token_id`. An image split
  into tiles gives one run per tile plus one for the global view; the
  `<fake_token_around_image>`, `<row_i_col_j>` and `<global-img>` markers between
  them are text tokens, not image features, and are not in the span.

`encode_image_prompts` renders prompts exactly as `heads.encode_prompts` does
(chat template, `**markup**`, `emphasize=`), lets the model's processor expand
the image placeholders, maps the text spans through the expansion, and returns
an `EncodedPrompts` with `image_spans`, the processor's other outputs
(`pixel_values`, `image_grid_thw`, `pixel_attention_mask`, `mm_token_type_ids`,
…) in `inputs`, and M-RoPE `position_ids` where the family uses them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, cast

import torch

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import (
    Emphasis,
    EncodedPrompts,
    Prompt,
    emphasis_rows,
    normalize_prompts,
    render_prompt,
)
from heads.inputs.spans import char_to_token_range, find_span
from heads.model.adapter import HeadModel

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

__all__ = [
    "MROPE_FAMILIES",
    "ImageInput",
    "ImageTextProcessor",
    "encode_image_prompts",
    "image_placeholder",
    "image_spans",
    "image_token_id",
    "is_vision_language",
    "mrope_position_ids",
    "normalize_images",
    "processor_of",
]

MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
"""model types whose language model takes 3D M-RoPE position ids `[3, B, T]`."""

ImageInput: TypeAlias = object
"""A PIL image, numpy array or tensor the model's image processor accepts."""


class ImageTextProcessor(Protocol):
    """What headsteer uses of a vision-language processor (a `transformers.ProcessorMixin`
    such as `LlavaProcessor`, `Qwen2VLProcessor`, `Idefics3Processor`)."""

    image_token: str
    tokenizer: PreTrainedTokenizerBase

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def is_vision_language(config: object) -> bool:
    """True when `config` is a vision-language model's config (it has `vision_config` and `text_config`)."""
    return (
        getattr(config, "vision_config", None) is not None
        and getattr(config, "text_config", None) is not None
    )


def image_token_id(config: object) -> int:
    """The token id the model replaces by image features (`image_token_id` or LLaVA's `image_token_index`).

    Raises:
        ValueError: the config names no image token.
    """
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    raise HeadsteerValueError(
        f"model_type={short_repr(getattr(config, 'model_type', '?'))} has no image_token_id in its config"
    )


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs of True in a 1-D bool tensor, as half-open `(start, end)` pairs."""
    m = mask.to(torch.int8)
    edges = torch.diff(m, prepend=m.new_zeros(1), append=m.new_zeros(1))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends, strict=True))


def _split(spans: list[tuple[int, int]], cuts: list[int]) -> list[tuple[int, int]]:
    """Split half-open spans at the token indices `cuts` that fall strictly inside them."""
    out: list[tuple[int, int]] = []
    for s, e in spans:
        bounds = [s, *sorted({c for c in cuts if s < c < e}), e]
        out.extend(zip(bounds[:-1], bounds[1:], strict=True))
    return out


def image_spans(input_ids: torch.Tensor, config: PreTrainedConfig) -> list[list[tuple[int, int]]]:
    """Per row, the half-open token ranges of the image features (see the module docstring).

    Args:
        input_ids: `[B, T]` long, the *expanded* ids (after the processor).
        config: the vision-language model's config.

    Returns:
        `B` lists of `(t0, t1)`, in the columns of `input_ids` (so padded
        coordinates for a padded batch); empty for a row without an image.

    Raises:
        ValueError: a config without an image token; for Qwen2-VL, unbalanced
            vision start/end tokens or a run between them that is not all image
            (or video) tokens.
    """
    if input_ids.ndim != 2:
        raise HeadsteerValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    img = image_token_id(config)
    if getattr(config, "model_type", "") in MROPE_FAMILIES:
        start_id, end_id = config.vision_start_token_id, config.vision_end_token_id
        pads = {img, getattr(config, "video_token_id", img)}
        out: list[list[tuple[int, int]]] = []
        for b, row in enumerate(input_ids.tolist()):
            starts = [i for i, t in enumerate(row) if t == start_id]
            ends = [i for i, t in enumerate(row) if t == end_id]
            if len(starts) != len(ends) or any(e <= s for s, e in zip(starts, ends, strict=True)):
                raise HeadsteerValueError(f"row {b}: unbalanced vision start/end tokens at {starts} / {ends}")
            spans = []
            for s, e in zip(starts, ends, strict=True):
                if e == s + 1 or any(t not in pads for t in row[s + 1 : e]):
                    raise HeadsteerValueError(
                        f"row {b}: tokens {s + 1}..{e} between vision start/end are not image tokens"
                    )
                if row[s + 1] == img:
                    spans.append((s + 1, e))
            inside = sum(e - s - 1 for s, e in zip(starts, ends, strict=True))
            if sum(t in pads for t in row) != inside:
                raise HeadsteerValueError(f"row {b}: image tokens outside a vision start/end pair")
            out.append(spans)
        return out
    return [_runs(row == img) for row in input_ids]


def image_placeholder(processor: ImageTextProcessor, config: PreTrainedConfig) -> str:
    """The text a prompt holds for one image before the processor expands it.

    LLaVA and Idefics3: the processor's `image_token` (`"<image>"`); Qwen2-VL:
    `"<|vision_start|><|image_pad|><|vision_end|>"` (what its chat template writes).
    """
    token = processor.image_token
    if getattr(config, "model_type", "") in MROPE_FAMILIES:
        tok = processor.tokenizer
        start = tok.convert_ids_to_tokens(config.vision_start_token_id)
        end = tok.convert_ids_to_tokens(config.vision_end_token_id)
        return f"{start}{token}{end}"
    return token


def normalize_images(images: object, n: int) -> list[list[ImageInput]]:
    """One list of images per prompt.

    `images` may be None (no images), one image (every prompt gets it), or a list
    with one entry per prompt, each an image, a list of images, or None. With a
    single prompt, a flat list of images is that prompt's images.

    Each image is a PIL image, a numpy array or torch tensor `[h, w, c]` / `[c, h, w]` (uint8
    0..255, or float in [0, 1]: see `as_pil`), or the path of a local image file; URLs are
    refused (nothing is fetched over the network). Every image is returned as an RGB PIL image.

    Raises:
        ValueError: a per-prompt list whose length is not `n`, or an image that is none of
            the above (a URL, a missing file, a file that is not an image, an empty image, a
            float array outside [0, 1], another type).
    """
    rows = _image_rows(images, n)
    for row in rows:
        for image in row:
            _check_image(image)
    return [[as_pil(image) for image in row] for row in rows]


def as_pil(image: object) -> object:
    """An RGB PIL image from a checked image input, each type read with its own convention.

    * a path: opened with Pillow (a file Pillow cannot decode is a `ValueError` naming it);
    * a PIL image: converted to RGB;
    * a uint8 array / tensor: values 0..255 (the PIL / numpy convention);
    * a float array / tensor: values in [0, 1] (the torchvision convention), scaled by 255;
      a float image with values outside [0, 1] (or NaN) is ambiguous and refused by name;
    * another integer dtype: values must lie in 0..255 (else refused).

    Layout: `[h, w]`, `[h, w, c]` or `[c, h, w]` with c in 1, 3, 4; a torch tensor is read as
    `[c, h, w]` when its first dimension can be channels (torchvision), a numpy array as
    `[h, w, c]` when its last one can (PIL).

    Raises:
        ValueError: as above, or a shape with no channel dimension of 1, 3 or 4.
    """
    import numpy as np
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        text = os.fspath(image)
        try:
            with Image.open(text) as im:
                return im.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise HeadsteerValueError(
                f"image file {text!r} is not an image Pillow can read: {first}"
            ) from None
    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    is_tensor = isinstance(image, torch.Tensor)
    arr = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    kind = "tensor" if is_tensor else "array"
    if arr.dtype == np.bool_ or not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        raise HeadsteerValueError(
            f"an image {kind} must be uint8 (0..255) or float ([0, 1]), got dtype {arr.dtype}"
        )
    if arr.ndim == 3:
        chw = arr.shape[0] in (1, 3, 4) and (is_tensor or arr.shape[-1] not in (1, 3, 4))
        if chw:
            arr = np.moveaxis(arr, 0, -1)
        if arr.shape[-1] not in (1, 3, 4):
            raise HeadsteerValueError(
                f"an image {kind} of shape {tuple(arr.shape)} has no channel dimension of 1, 3 or 4"
            )
        if arr.shape[-1] == 1:
            arr = arr[..., 0]
    if np.issubdtype(arr.dtype, np.floating):
        finite = arr[np.isfinite(arr)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (float("nan"),) * 2
        if finite.size != arr.size or lo < 0 or hi > 1:
            raise HeadsteerValueError(
                f"a float image {kind} must hold values in [0, 1] (torchvision convention), got "
                f"{lo:g}..{hi:g}: pass uint8 for 0..255 pixels, or divide by 255"
            )
        arr = np.rint(arr.astype(np.float64) * 255)
    elif arr.dtype != np.uint8:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > 255:
            raise HeadsteerValueError(
                f"an integer image {kind} ({arr.dtype}) must hold values in 0..255, got {lo}..{hi}"
            )
    pil = Image.fromarray(np.ascontiguousarray(arr.astype(np.uint8)))
    return pil if pil.mode == "RGB" else pil.convert("RGB")


def _check_image(image: object) -> None:
    """ValueError unless `image` is a non-empty PIL image / array / tensor or a local file."""
    import numpy as np
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        text = os.fspath(image)
        if "://" in text:
            raise HeadsteerValueError(f"images must be local: URLs are not fetched, got {short_repr(text)}")
        if not os.path.isfile(text):
            raise HeadsteerValueError(f"image file {text!r} does not exist")
        return
    if isinstance(image, Image.Image):
        if image.width == 0 or image.height == 0:
            raise HeadsteerValueError(f"empty image ({image.width}x{image.height})")
        return
    if isinstance(image, (np.ndarray, torch.Tensor)):
        if image.ndim not in (2, 3) or 0 in tuple(image.shape):
            raise HeadsteerValueError(
                f"image arrays must be [h, w(, c)] and non-empty, got shape {tuple(image.shape)}"
            )
        return
    raise HeadsteerValueError(
        f"an image must be a PIL image, an array, a tensor or a local file path, got {type(image).__name__}"
    )


def _image_rows(images: object, n: int) -> list[list[ImageInput]]:
    if images is None:
        return [[] for _ in range(n)]
    if not isinstance(images, (list, tuple)):
        return [[images] for _ in range(n)]
    if n == 1 and images and not any(x is None or isinstance(x, (list, tuple)) for x in images):
        return [list(images)]  # one prompt: a flat list holds its images
    if len(images) != n:
        raise HeadsteerValueError(
            f"images has {len(images)} entries for {n} prompts (one image or list of images per prompt)"
        )
    rows: list[list[ImageInput]] = []
    for entry in images:
        if entry is None:
            rows.append([])
        elif isinstance(entry, (list, tuple)):
            if any(x is None for x in entry):
                raise HeadsteerValueError("None inside a prompt's list of images")
            rows.append(list(entry))
        else:
            rows.append([entry])
    return rows


def _content_to_text(prompt: object, placeholder: str, found: list[ImageInput]) -> object:
    """Chat messages whose content is a list of `{"type": "image" | "text"}` items → string content.

    An image item becomes `placeholder`; its `"image"` value (if any) is appended to `found`.
    """
    if isinstance(prompt, str) or not isinstance(prompt, Sequence):
        return prompt
    out = []
    for m in prompt:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, (list, tuple)):
            parts = []
            for item in content:
                kind = item.get("type") if isinstance(item, Mapping) else None
                if kind == "image":
                    parts.append(placeholder)
                    if item.get("image") is not None:
                        found.append(item["image"])
                elif kind == "text" and isinstance(item.get("text"), str):
                    parts.append(item["text"])
                else:
                    raise HeadsteerValueError(
                        "chat content items must be {'type': 'image'} or {'type': 'text', 'text': str}, "
                        f"got {short_repr(item)}"
                    )
            m = dict(m, content="".join(parts))
        out.append(m)
    return out


def _with_placeholders(prompt: Prompt, k: int, placeholder: str) -> Prompt:
    """Prepend `k` placeholders to the prompt (string) or to its first user message."""
    lead = placeholder * k + "\n"
    if isinstance(prompt, str):
        return lead + prompt
    msgs = [dict(m) for m in prompt]
    at = next((i for i, m in enumerate(msgs) if m["role"] == "user"), 0)
    msgs[at]["content"] = lead + msgs[at]["content"]
    return msgs


def _shift(pos: int, replacements: list[dict]) -> int:
    """Character position in the rendered text -> position in the processor's expanded text.

    Raises:
        ValueError: `pos` falls inside an image placeholder.
    """
    shift = 0
    for r in replacements:
        s, e = r["span"]
        if e <= pos:
            shift = r["new_span"][1] - e
        elif s < pos:
            raise HeadsteerValueError("an emphasized span overlaps an image placeholder")
    return pos + shift


def processor_of(model: HeadModel) -> ImageTextProcessor:
    """The processor of a vision-language `HeadModel` (`model.processor`).

    Raises:
        ValueError: the model has no processor (not loaded as a vision-language model).
    """
    proc = getattr(model, "processor", None)
    if proc is None:
        raise HeadsteerValueError(
            f"{short_repr(getattr(model, 'name', 'the model'))} has no image processor: images need a "
            "vision-language model loaded with heads.load_model(folder)"
        )
    return cast(ImageTextProcessor, proc)


def _rope_index(model: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`get_rope_index` of a VLM (of the model or of its `.model`)."""
    for m in (model, getattr(model, "model", None)):
        fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = (
            getattr(m, "get_rope_index", None) if m is not None else None
        )
        if callable(fn):
            return fn
    raise HeadsteerValueError(f"{type(model).__name__} uses M-RoPE but has no get_rope_index")


def mrope_position_ids(model: HeadModel, enc: EncodedPrompts) -> torch.Tensor:
    """`[3, B, P]` M-RoPE positions (temporal, height, width) of a padded batch.

    Computed by the model's own `get_rope_index` from the expanded ids, the mask
    and the processor's `image_grid_thw` / `mm_token_type_ids`.

    Padding columns get 0; text tokens count over real tokens only, so a row gives
    the same positions alone and inside a left-padded batch.
    """
    inputs = {
        k: v for k, v in enc.inputs.items() if k in ("image_grid_thw", "video_grid_thw", "mm_token_type_ids")
    }
    pos, _ = _rope_index(model.model)(
        enc.input_ids.to(model.device),
        attention_mask=enc.attention_mask.to(model.device),
        **{k: v.to(model.device) for k, v in inputs.items()},
    )
    return pos.cpu()


def encode_image_prompts(
    model: HeadModel,
    prompts: Prompt | Sequence[Prompt],
    images: object = None,
    *,
    emphasize: Emphasis = None,
    chat: bool | None = None,
    markup: bool = True,
) -> EncodedPrompts:
    """Render, expand, tokenize and left-pad prompts with images for a vision-language `HeadModel`.

    Args:
        model: a `HeadModel` with a `processor` (`heads.load_model` on a VLM folder).
        prompts: as for `heads.encode_prompts`; chat message contents may also be
            lists of `{"type": "image"}` / `{"type": "text", "text": ...}` items
            (an image item may carry the image under `"image"`).
        images: see `normalize_images`. A prompt with k images and no placeholder
            gets k placeholders (`image_placeholder`) prepended to its first user
            message (or to the string); otherwise its placeholder count must be k.
        emphasize, chat, markup: as for `heads.encode_prompts`.

    Returns:
        `EncodedPrompts` `[B, P]` (left-padded) with `spans` (text emphasis),
        `image_spans`, the processor's other outputs in `inputs` and, for
        Qwen2-VL, `position_ids()` of shape `[3, B, P]`.

    Raises:
        ValueError: a model without processor; images that do not match the
            placeholders; an emphasized span over a placeholder; bad prompts or spans.
    """
    proc = processor_of(model)
    cfg = model.model.config
    tok = proc.tokenizer
    placeholder = image_placeholder(proc, cfg)
    token = proc.image_token
    batch_prompts: list[object]
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], Mapping)
    ):
        batch_prompts = [prompts]
    else:
        batch_prompts = list(prompts)
    embedded: list[list[ImageInput]] = []
    converted: list[object] = []
    for p in batch_prompts:
        found: list[ImageInput] = []
        converted.append(_content_to_text(p, placeholder, found))
        embedded.append(found)
    items, _ = normalize_prompts(cast("list[Prompt]", converted))  # checked there
    if images is not None and any(embedded):
        raise HeadsteerValueError("images given both in chat content items and in images=; use one")
    if any(embedded):
        for row in embedded:
            for image in row:
                _check_image(image)
        rows_images = [[as_pil(image) for image in row] for row in embedded]
    else:
        rows_images = normalize_images(images, len(items))
    if chat is None:
        chat = bool(getattr(tok, "chat_template", None))
    rows = emphasis_rows(emphasize, len(items))
    texts, cspans = [], []
    for i, (prompt, extra) in enumerate(zip(items, rows, strict=True)):
        k = len(rows_images[i])
        raw = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
        if k and token not in raw:
            prompt = _with_placeholders(prompt, k, placeholder)
        text, spans, regions = render_prompt(tok, prompt, chat, markup)
        if text.count(token) != k:
            raise HeadsteerValueError(
                f"prompt {i} holds {text.count(token)} image placeholders {short_repr(token)} for {k} images"
            )
        spans = spans + [find_span(text, s, regions) for s in extra]
        texts.append(text)
        cspans.append(spans)
    flat = [im for r in rows_images for im in r]
    kwargs = dict(
        text=list(texts),
        padding=True,
        padding_side="left",
        return_tensors="pt",
        return_offsets_mapping=True,
        return_text_replacement_offsets=True,
        add_special_tokens=not chat,
    )
    if getattr(cfg, "model_type", "") in MROPE_FAMILIES:
        kwargs["return_mm_token_type_ids"] = True
    if flat:
        kwargs["images"] = flat  # every processor splits a flat list by the placeholders in each text
    batch = proc(**kwargs)
    input_ids = batch.pop("input_ids").long()
    mask = batch.pop("attention_mask").long()
    offsets = batch.pop("offset_mapping").tolist()
    replacements = batch.pop("text_replacement_offsets", None) or [[] for _ in texts]
    special = set(tok.all_special_ids)
    token_spans: list[list[tuple[int, int]]] = []
    for b in range(len(texts)):
        reps = [r for r in replacements[b] if r.get("type", "image") == "image"]
        skip = [
            bool(m == 0) or t in special for t, m in zip(input_ids[b].tolist(), mask[b].tolist(), strict=True)
        ]
        row_spans: list[tuple[int, int]] = []
        for c0, c1 in cspans[b]:
            row_spans.append(char_to_token_range(offsets[b], (_shift(c0, reps), _shift(c1, reps)), skip))
        token_spans.append(row_spans)
    inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    spans_img = image_spans(input_ids, cfg)
    for b in range(len(texts)):  # adjacent images (LLaVA "<image><image>") form one run: split per image
        real = [(t, o0) for t, (o0, o1) in enumerate(offsets[b]) if mask[b, t] and o1 > o0]
        cuts = []
        for r in replacements[b]:
            if r.get("type", "image") == "image":  # the first token of this image's expansion
                first = next((t for t, o0 in real if o0 >= r["new_span"][0]), None)
                if first is not None:
                    cuts.append(first)
        spans_img[b] = _split(spans_img[b], cuts)
    enc = EncodedPrompts(input_ids, mask, token_spans, texts, cspans, image_spans=spans_img, inputs=inputs)
    if getattr(cfg, "model_type", "") in MROPE_FAMILIES and flat:
        enc.mrope_position_ids = mrope_position_ids(model, enc)
    return enc
