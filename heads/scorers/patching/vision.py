"""Vision pairs: one text prompt with a clean and a corrupted image, for activation patching.

NOTICE (Golovanevsky et al. 2024) measures causal effects in vision-language models with
*semantic minimal pairs*: two images that differ in one attribute (one object's colour, its
identity), the same question, and the answer each image supports. `ImagePair` is one such
pair; `encode_image_pairs` encodes pairs into an `ImagePairBatch`, a `PairBatch` whose two
rows of a pair share their token ids (the same prompt, the same number of image tokens at the
same columns) and differ only in the image features the vision tower writes there.

`heads.scorers.patching.patch` takes an `ImagePairBatch` like a text `PairBatch`: every site
kind, both directions, every metric; the position axis then includes the image tokens, whose
labels are `"<image 0>"`, `"<image 1>"`, ... (`"<image j.k>"` for token k of image span j when
a prompt has several spans: an Idefics3 image split into tiles gives one span per tile and one
for the global view) and `positions="image"` scores the image columns only.

How it runs: the vision tower and the projector run once per side (`language_model_inputs`:
the embeddings the VLM passes to its language model, image features merged in, read by an
engine edit at the first block's `residual` site); every patched forward then runs the language
model on the token ids with its embedding output replaced by those rows (`replaced_embeddings`,
an engine edit at the `embed` site), so the engine's layer- and position-prefix reuse apply
unchanged. The tests check this against the VLM's own forward with
`pixel_values` and one plain hook.

Supported: LLaVA-style VLMs whose language model takes 1-D positions and causal attention over
the image tokens (`SUPPORTED`: LLaVA, Idefics3 / SmolVLM), the Hugging Face backend, one image
per side of a pair. Refused with a `ValueError`: text-only models, Qwen2-VL (3-D M-RoPE
positions), Gemma 3 (bidirectional attention among image tokens), the TransformerLens and
nnsight backends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from heads._util.validation import short_repr
from heads.engine.activations import ActivationEdit
from heads.engine.edits import AttentionCall
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.images import ImageInput, encode_image_prompts, normalize_images, processor_of
from heads.inputs.prompts import EncodedPrompts, Prompt, position_ids
from heads.inputs.tokens import readable_tokens
from heads.model.adapter import HeadModel
from heads.scorers.patching.pairs import (
    Answer,
    PairBatch,
    PromptPair,
    _answer_list,
    pairs_from_tokens,
    token_id,
)

__all__ = [
    "SUPPORTED",
    "ImagePair",
    "ImagePairBatch",
    "check_image_model",
    "encode_image_pairs",
    "image_labels",
    "language_model_inputs",
    "replaced_embeddings",
]

SUPPORTED = ("llava", "idefics3", "smolvlm")
"""VLM `model_type`s whose image pairs can be patched (1-D positions, causal image attention)."""


@dataclass(frozen=True)
class ImagePair:
    """One vision pair: the same prompt with a clean and a corrupted image.

    Attributes:
        prompt: the text prompt (a string or chat messages, as for `heads.encode_prompts`);
            without an image placeholder one is prepended (`heads.inputs.images`).
        clean_image: the clean image (PIL image, `[h, w, c]` uint8 array, `[c, h, w]` tensor
            or a local file: `heads.inputs.images.normalize_images`).
        corrupted_image: the corrupted image; must have the clean image's size in pixels.
        answer: the token(s) the clean image supports (e.g. `" red"`), a string, an id or a list.
        counterfactual: the token(s) the corrupted image supports, or None.
        meta: free JSON-serialisable fields.
    """

    prompt: Prompt
    clean_image: ImageInput
    corrupted_image: ImageInput
    answer: Answer
    counterfactual: Answer | None = None
    meta: dict = field(default_factory=dict)


@dataclass
class ImagePairBatch(PairBatch):
    """A `PairBatch` of vision pairs (`encode_image_pairs`): `clean_ids == corrupted_ids`, the
    images differ.

    Attributes (besides `PairBatch`'s, all `[N, T]` left-padded):
        clean_inputs / corrupted_inputs: the processor's image inputs per side, one row per pair
            (`pixel_values` `[N, 3, h, w]` for LLaVA, `[N, n_img, 3, h, w]` and
            `pixel_attention_mask` for Idefics3).
        image_spans: per pair, the half-open `(t0, t1)` padded columns of its image tokens
            (the same on both sides).
        vlm: the `model_type` the batch was encoded for.
        image_pairs: the source `ImagePair`s (their `meta`), one per pair (`pairs` holds None).
    """

    clean_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    corrupted_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    image_spans: list[list[tuple[int, int]]] = field(default_factory=list)
    vlm: str = ""
    image_pairs: list[ImagePair] = field(default_factory=list)

    @property
    def has_images(self) -> bool:
        return True

    @property
    def image_mask(self) -> torch.Tensor:
        """`[N, T]` bool, True on the image-token columns of each pair."""
        out = torch.zeros(self.n, self.width, dtype=torch.bool)
        for i, spans in enumerate(self.image_spans):
            for s, e in spans:
                out[i, s:e] = True
        return out

    def image_columns(self) -> list[int]:
        """The padded columns holding image tokens, shared by every pair (`positions="image"`).

        Raises:
            ValueError: the pairs hold their image tokens at different columns (prompts of
                different lengths); then pass explicit `positions` or `select` one template.
        """
        m = self.image_mask
        if not bool((m == m[0]).all()):
            bad = int((m != m[0]).any(-1).nonzero()[0])
            raise HeadsteerValueError(
                f"pair {bad} holds its image tokens at other columns than pair 0 "
                f"({self.image_spans[bad]} vs {self.image_spans[0]}); positions='image' needs one "
                "layout: pass positions=[...] or select pairs of one prompt"
            )
        return m[0].nonzero().flatten().tolist()

    def prompts(self, which: str = "clean") -> EncodedPrompts:
        """Refused: a vision pair's prompts need its images and the VLM's positions.

        Raises:
            HeadsteerValueError: always (name the images: `heads.inputs.images.encode_image_prompts`).
        """
        raise HeadsteerValueError(
            "vision pairs (ImagePairBatch) cannot be passed as prompts: encode the prompts with their "
            "images (heads.inputs.images.encode_image_prompts) and pass those"
        )

    def image_inputs(self, which: str) -> dict[str, torch.Tensor]:
        """`clean_inputs` for `"clean"`, `corrupted_inputs` for `"corrupted"`."""
        if which == "clean":
            return self.clean_inputs
        if which == "corrupted":
            return self.corrupted_inputs
        raise HeadsteerValueError(f"which must be 'clean' or 'corrupted', got {short_repr(which)}")

    def select(self, index: Sequence[int] | torch.Tensor) -> ImagePairBatch:
        """The pairs at `index`, re-trimmed to their own longest row (spans shifted with it)."""
        base = PairBatch.select(self, index)
        idx = torch.as_tensor(index, dtype=torch.long)
        trim = self.width - base.width
        return ImagePairBatch(
            **{k: getattr(base, k) for k in PairBatch.__dataclass_fields__},
            clean_inputs={k: v[idx] for k, v in self.clean_inputs.items()},
            corrupted_inputs={k: v[idx] for k, v in self.corrupted_inputs.items()},
            image_spans=[[(s - trim, e - trim) for s, e in self.image_spans[i]] for i in idx.tolist()],
            vlm=self.vlm,
            image_pairs=[self.image_pairs[i] for i in idx.tolist()] if self.image_pairs else [],
        )


def check_image_model(model: HeadModel, where: str = "image pairs") -> str:
    """The VLM `model_type` of `model` if its image pairs can be patched, else a `ValueError`
    (before any work): a text-only model, a family outside `SUPPORTED` (Qwen2-VL: M-RoPE;
    Gemma 3: bidirectional image attention), a backend other than Hugging Face, no processor."""
    if not isinstance(model, HeadModel):
        raise HeadsteerTypeError(f"{where} need a HeadModel, got {type(model).__name__}")
    vlm = model.family.vlm
    if vlm is None:
        raise HeadsteerValueError(
            f"{short_repr(model.name)} is a text-only model ({model.family.model_type}): {where} need a "
            "vision-language model (LLaVA, Idefics3 / SmolVLM) loaded with heads.load_model(folder)"
        )
    if vlm not in SUPPORTED:
        why = (
            "3-D M-RoPE positions, which the patching engine does not pass"
            if vlm.startswith("qwen")
            else "bidirectional attention among image tokens, which the patching engine does not build"
            if model.family.bidirectional_images
            else "a layout the patching engine is not checked on"
        )
        raise HeadsteerValueError(
            f"{where} are not supported on model_type {short_repr(vlm)}: it uses {why}; supported: "
            f"{SUPPORTED}"
        )
    if model.backend.kind != "hf":
        raise HeadsteerValueError(
            f"{where} run on the Hugging Face backend only, not {short_repr(model.backend.kind)}: the image "
            "embeddings are computed and written with plain hooks on the transformers model; wrap "
            "that model itself (heads.load_model(folder))"
        )
    processor_of(model)
    return vlm


def image_labels(tokens: Sequence[str], spans: Sequence[tuple[int, int]]) -> list[str]:
    """`tokens` (one row, unpadded) with the image tokens in `spans` (unpadded columns)
    relabelled `"<image k>"` (one span) or `"<image j.k>"` (token k of span j: several spans,
    e.g. the tiles and the global view of an Idefics3 split image)."""
    out = list(tokens)
    for j, (s, e) in enumerate(spans):
        for k, t in enumerate(range(s, e)):
            out[t] = f"<image {k}>" if len(spans) == 1 else f"<image {j}.{k}>"
    return out


def _check_pair(i: int, p: object) -> ImagePair:
    if not isinstance(p, ImagePair):
        raise HeadsteerTypeError(f"pair {i} must be an ImagePair, got {type(p).__name__}")
    for side in ("clean_image", "corrupted_image"):
        if isinstance(getattr(p, side), (list, tuple)) or getattr(p, side) is None:
            raise HeadsteerValueError(
                f"pair {i}: {side} must be one image, got {short_repr(getattr(p, side))}"
            )
    return p


def _check_aligned(clean: EncodedPrompts, corrupt: EncodedPrompts) -> None:
    """Per pair, equal token lengths, ids and image columns on both sides (before any forward).

    Raises:
        ValueError: `"pair i: the clean image gives A tokens, the corrupted image B tokens; ..."`,
            or different image columns.
    """
    a, b = clean.attention_mask.sum(-1).tolist(), corrupt.attention_mask.sum(-1).tolist()
    for i, (la, lb) in enumerate(zip(a, b, strict=True)):
        if la != lb:
            raise HeadsteerValueError(
                f"pair {i}: with the clean image the prompt is {la} tokens, with the corrupted image "
                f"{lb} tokens; positions must align (images that tokenize to the same length)"
            )
    for i in range(len(a)):
        ca, cb = clean.input_ids[i, -a[i] :], corrupt.input_ids[i, -b[i] :]
        sa = [(s - (clean.length - a[i]), e - (clean.length - a[i])) for s, e in clean.image_spans[i]]
        sb = [(s - (corrupt.length - b[i]), e - (corrupt.length - b[i])) for s, e in corrupt.image_spans[i]]
        if sa != sb or not torch.equal(ca, cb):
            raise HeadsteerValueError(
                f"pair {i}: the image tokens sit at {sa} with the clean image and at {sb} with the "
                "corrupted one; positions must align"
            )


def encode_image_pairs(
    model: HeadModel,
    pairs: Sequence[ImagePair],
    *,
    chat: bool | None = None,
    first_token: bool = False,
) -> ImagePairBatch:
    """Encode vision pairs into a left-padded `ImagePairBatch` (every check before any forward).

    Args:
        model: a supported VLM `HeadModel` with a processor (`check_image_model`).
        pairs: `ImagePair`s (one image per side).
        chat: render the prompt with the chat template (default: when the tokenizer has one,
            as `heads.inputs.images.encode_image_prompts`).
        first_token: take the first token of a multi-token answer instead of raising.

    Returns:
        an `ImagePairBatch` `[N, T]`: `clean_ids == corrupted_ids`, `tokens` with the image
        tokens labelled `"<image k>"`, the processor's image inputs per side, `image_spans`.

    Raises:
        ValueError: a text-only or unsupported model (`check_image_model`); no pairs; two
            images of different sizes (names both, `w x h` pixels); images that tokenize to
            different lengths (names both lengths) or to different image columns; an answer
            that is not one token; bad images or prompts (`encode_image_prompts`).
        TypeError: a pair that is not an `ImagePair`.
    """
    vlm = check_image_model(model)
    if isinstance(pairs, ImagePair):
        pairs = [pairs]
    if isinstance(pairs, (str, bytes, Mapping)) or not isinstance(pairs, Sequence):
        raise HeadsteerTypeError(f"pairs must be a list of ImagePair, got {type(pairs).__name__}")
    items = [_check_pair(i, p) for i, p in enumerate(pairs)]
    if not items:
        raise HeadsteerValueError("no pairs given")
    clean_im = [r[0] for r in normalize_images([p.clean_image for p in items], len(items))]
    corr_im = [r[0] for r in normalize_images([p.corrupted_image for p in items], len(items))]
    for i, (a, b) in enumerate(zip(clean_im, corr_im, strict=True)):
        sa, sb = cast(Any, a).size, cast(Any, b).size
        if sa != sb:
            raise HeadsteerValueError(
                f"pair {i}: the clean image is {sa[0]}x{sa[1]} pixels, the corrupted image "
                f"{sb[0]}x{sb[1]}; a minimal pair needs two images of one size"
            )
    tok = processor_of(model).tokenizer
    answers, cfs = [], []
    for i, p in enumerate(items):  # answers before the processor runs
        ans = _answer_list(p.answer, f"pair {i} answer")
        if not ans:
            raise HeadsteerValueError(f"pair {i}: no answer token")
        answers.append([token_id(tok, x, first_token=first_token, where=f"pair {i} answer") for x in ans])
        cf = _answer_list(p.counterfactual, f"pair {i} counterfactual")
        cfs.append([token_id(tok, x, first_token=first_token, where=f"pair {i} counterfactual") for x in cf])
    prompts = [p.prompt for p in items]
    enc_c = encode_image_prompts(model, prompts, [[im] for im in clean_im], chat=chat, markup=False)
    enc_x = encode_image_prompts(model, prompts, [[im] for im in corr_im], chat=chat, markup=False)
    _check_aligned(enc_c, enc_x)
    n = len(items)
    for side, enc in (("clean", enc_c), ("corrupted", enc_x)):
        for k, v in enc.inputs.items():
            if v.shape[0] != n:
                raise HeadsteerValueError(
                    f"the processor's {side} {short_repr(k)} has shape {tuple(v.shape)}, not one row per "
                    f"pair ({n})"
                )
    lengths = enc_c.attention_mask.sum(-1).tolist()
    rows = [enc_c.input_ids[i, enc_c.length - lengths[i] :].tolist() for i in range(n)]
    spans = [
        [(s - (enc_c.length - lengths[i]), e - (enc_c.length - lengths[i])) for s, e in enc_c.image_spans[i]]
        for i in range(n)
    ]
    tokens = [image_labels(readable_tokens(tok, r), spans[i]) for i, r in enumerate(rows)]
    pad = getattr(tok, "pad_token_id", None)
    text = pairs_from_tokens(
        rows,
        rows,
        answers,
        cfs,
        pad_id=0 if pad is None else int(pad),
        tokens=tokens,
        pairs=cast("list[PromptPair | None]", [None] * n),
    )
    width = text.width
    return ImagePairBatch(
        **{k: getattr(text, k) for k in PairBatch.__dataclass_fields__},
        clean_inputs=dict(enc_c.inputs),
        corrupted_inputs=dict(enc_x.inputs),
        image_spans=[
            [(s + width - lengths[i], e + width - lengths[i]) for s, e in spans[i]] for i in range(n)
        ],
        vlm=vlm,
        image_pairs=items,
    )


@torch.no_grad()
def language_model_inputs(
    model: HeadModel, ids: torch.Tensor, mask: torch.Tensor, inputs: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """`[N, T, D]` the embeddings the VLM passes to its language model for `ids [N, T]`
    (`mask [N, T]`, positions over real tokens) and the image `inputs` (`pixel_values`, ...):
    the token embeddings with the projected image features at the image tokens. Runs the
    vision tower and projector once; the language model's layers do not run (the capture
    stops the forward at their entry).

    Raises:
        ValueError: the VLM does not pass `inputs_embeds` of shape `[N, T, D]` to its
            language model (a layout this capture does not know).
    """
    from heads.engine.context import editing
    from heads.scorers.patching.capture import ForwardStopped, StopAt

    stop = StopAt("residual", 0)  # the stream entering the first block: the inputs_embeds
    dev = model.device
    with editing(model, [stop], require_fired=False):
        try:
            model.model(
                input_ids=ids.to(dev),
                attention_mask=mask.to(dev),
                position_ids=position_ids(mask).to(dev),
                use_cache=False,
                **{k: v.to(dev) for k, v in inputs.items()},
            )
        except ForwardStopped:
            pass
    x = stop.seen
    want = (ids.shape[0], ids.shape[1], model.d_model)
    if x is None or tuple(x.shape) != want:
        got = None if x is None else tuple(x.shape)
        raise HeadsteerValueError(
            f"{short_repr(model.family.vlm)} passed inputs_embeds {got} to its language model, expected "
            f"{want}"
        )
    return x


def replaced_embeddings(model: HeadModel, embeds: torch.Tensor) -> ActivationEdit:
    """An engine edit (`embed` site) making the language model's token-embedding output `embeds
    [R, T', D]` (the rows and columns of the forward to run, e.g. `language_model_inputs` sliced)
    instead of the embedded ids, for the forward it is applied to (the model is unchanged).

    Raises:
        ValueError (at the forward): the forward's ids are not `[R, T']`.
    """

    def fn(x: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        if tuple(x.shape) != tuple(embeds.shape):
            raise HeadsteerValueError(
                f"image embeddings {tuple(embeds.shape)} do not match the forward {tuple(x.shape)}"
            )
        return embeds.to(x.device, x.dtype)

    return ActivationEdit("embed", 0, fn)
