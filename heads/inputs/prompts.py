"""Prompt encoding: chat template, emphasis spans, left padding.

`encode_prompts` turns user prompts (plain strings, chat message lists, or lists
of them) into a left-padded batch with the token ranges of the emphasized spans
in padded coordinates (half-open `[start, end)` token ranges, never BOS or pad).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias, TypeGuard, cast

import torch

from heads._util.validation import short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.spans import Span, char_to_token_range, find_span, parse_markup

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "EncodedPrompts",
    "Prompt",
    "emphasis_rows",
    "encode_prompts",
    "normalize_prompts",
    "position_ids",
    "render_prompt",
]

Message: TypeAlias = Mapping[str, str]
"""One chat message, `{"role": ..., "content": ...}`."""
Prompt: TypeAlias = str | Sequence[Message]
"""A plain string or a chat (a list of messages)."""
SpanLike: TypeAlias = str | Span
"""Text to emphasize: a substring to find, or a `Span` (substring + occurrence)."""
Emphasis: TypeAlias = SpanLike | Sequence[SpanLike] | Sequence[Sequence[SpanLike]] | None
"""`emphasize=`: one span for every prompt, a list for every prompt, or one list per prompt."""


def check_encodable(text: str, what: str) -> None:
    """ValueError naming `what` and the position of a character that UTF-8 cannot encode
    (a lone surrogate such as `"\\ud800"`, which tokenizers reject with a type error)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise HeadsteerValueError(
            f"{what} has a lone surrogate {short_repr(bad)} at character {exc.start}: not valid Unicode text"
        ) from None


def normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> tuple[list[Prompt], bool]:
    """Return `(list of prompts, was_single)`; a chat is a list of `{"role", "content"}` dicts.

    Raises:
        ValueError: empty input or an empty prompt.
        TypeError: anything else than strings and message lists.
    """
    items: list[Prompt]
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], Mapping)
    ):
        items, single = [cast(Prompt, prompts)], True
    elif isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        items, single = list(cast(Sequence[Prompt], prompts)), False
    else:
        raise HeadsteerTypeError(
            f"prompts must be a string, a chat or a list of them, got {type(prompts).__name__}"
        )
    if not items:
        raise HeadsteerValueError("empty prompt list")
    for i, p in enumerate(items):
        if isinstance(p, str):
            if not p.strip():
                raise HeadsteerValueError(f"empty prompt at index {i}")
            check_encodable(p, f"prompt {i}")
        elif isinstance(p, Sequence) and p and all(isinstance(m, Mapping) for m in p):
            for m in cast(Sequence[Message], p):  # all mappings (checked above)
                if "role" not in m or "content" not in m:
                    raise HeadsteerValueError(
                        f"chat message without role/content at prompt {i}: {short_repr(m)}"
                    )
                if not isinstance(m["role"], str) or not isinstance(m["content"], str):
                    raise HeadsteerTypeError(
                        f"chat message role and content must be strings at prompt {i}: {short_repr(m)}"
                    )
                if not m["content"].strip():
                    raise HeadsteerValueError(f"empty message content at prompt {i}: {short_repr(m)}")
                check_encodable(m["content"], f"prompt {i} message content")
                check_encodable(m["role"], f"prompt {i} message role")
        else:
            raise HeadsteerTypeError(
                f"prompt {i} is neither a string nor a chat message list: {short_repr(p)}"
            )
    return items, single


@dataclass
class EncodedPrompts:
    """A left-padded batch and its emphasized spans.

    Attributes:
        input_ids: `[B, P]` long, left-padded.
        attention_mask: `[B, P]` long, 0 on padding.
        spans: per row, the emphasized token ranges `[(t0, t1), ...]` (half-open,
            padded coordinates; never BOS, pad or special tokens).
        texts: the rendered prompts (after the chat template, without markup).
        char_spans: per row, the emphasized character spans in `texts`.
        image_spans: per row, the token ranges of image features (half-open, padded
            coordinates; `heads.inputs.images.image_spans`); empty lists for text prompts.
        inputs: the processor's other model inputs for prompts with images
            (`pixel_values`, `image_grid_thw`, `pixel_attention_mask`,
            `mm_token_type_ids`, ...), passed to the model's forward as they are.
        mrope_position_ids: `[3, B, P]` M-RoPE positions (Qwen2-VL with images),
            else None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    spans: list[list[tuple[int, int]]]
    texts: list[str]
    char_spans: list[list[tuple[int, int]]]
    image_spans: list[list[tuple[int, int]]] = field(default_factory=list)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    mrope_position_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.image_spans:
            self.image_spans = [[] for _ in range(self.input_ids.shape[0])]

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    @property
    def length(self) -> int:
        """P, the padded prompt length."""
        return self.input_ids.shape[1]

    def select_spans(self, target: str = "text") -> list[list[tuple[int, int]]]:
        """Per row, the spans of `target`: `"text"` (emphasized text, `spans`), `"image"`
        (`image_spans`), `"both"` (text spans, then image spans) or `"auto"` (the image spans
        when the batch has any image, else the text spans).

        Raises:
            ValueError: an unknown target.
        """
        if target == "auto":
            target = "image" if any(self.image_spans) else "text"
        if target == "text":
            return self.spans
        if target == "image":
            return self.image_spans
        if target == "both":
            return [t + i for t, i in zip(self.spans, self.image_spans, strict=True)]
        raise HeadsteerValueError(
            f"unknown span target {short_repr(target)}: use 'text', 'image', 'both' or 'auto'"
        )

    def span_mask(
        self, row: int | None = None, which: int | None = None, target: str = "text"
    ) -> torch.Tensor:
        """Bool mask over prompt columns: `[B, P]` (all rows) or `[P]` for `row`.

        `which` selects one span of the row (default: the union of its spans);
        `target` picks text, image or both kinds of span (see `select_spans`).
        """
        spans = self.select_spans(target)
        rows = range(self.batch) if row is None else [row]
        out = torch.zeros(len(rows), self.length, dtype=torch.bool)
        for i, r in enumerate(rows):
            chosen = spans[r] if which is None else [spans[r][which]]
            for t0, t1 in chosen:
                out[i, t0:t1] = True
        return out if row is None else out[0]

    def image_mask(self, row: int | None = None) -> torch.Tensor:
        """Bool mask of image-feature columns: `[B, P]`, or `[P]` for `row`."""
        return self.span_mask(row, target="image")

    def position_ids(self) -> torch.Tensor:
        """Positions that ignore left padding (what `generate` uses): `[B, P]`, or
        `[3, B, P]` M-RoPE positions when `mrope_position_ids` is set (Qwen2-VL with images)."""
        if self.mrope_position_ids is not None:
            return self.mrope_position_ids
        return position_ids(self.attention_mask)

    def model_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Keyword arguments for the model's forward: ids, mask, positions and the processor's `inputs`."""
        out = {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids(),
            **self.inputs,
        }
        return {k: v.to(device) for k, v in out.items()} if device is not None else out


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only: `cumsum(mask) - 1`, 0 on padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _chat_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    """`messages` rendered by the chat template, with the generation prompt (`tokenize=False`: a string)."""
    return cast(str, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def _is_tokenizer(tokenizer: object) -> TypeGuard[PreTrainedTokenizerBase]:
    """The run-time check `encode_prompts` makes: callable, with `all_special_ids`."""
    return callable(tokenizer) and hasattr(tokenizer, "all_special_ids")


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt, chat: bool, markup: bool
) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
    """Render one prompt: `(text, markup char spans, content regions)`.

    The chat template is applied when `chat`; the regions are the half-open
    character ranges of the message contents in `text` (where `emphasize=`
    substrings are searched).

    Raises:
        ValueError: a chat without `chat=True`, or a template that drops,
            reorders or changes messages.
    """
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [dict(m) for m in prompt]
    marks: list[list[tuple[int, int]]] = []
    for m in messages:
        if markup:
            m["content"], sp = parse_markup(m["content"])
        else:
            sp = []
        marks.append(sp)
    if not chat:
        if not isinstance(prompt, str):
            raise HeadsteerValueError(
                "a chat message list needs a tokenizer with a chat template (chat=True)"
            )
        text = messages[0]["content"]
        return text, marks[0], [(0, len(text))]
    # Render with a sentinel in place of every message, so each message's region is known
    # exactly (the same words may also appear in the template's own text).
    sentinels = [dict(m, content=f"\ue000{i}\ue001") for i, m in enumerate(messages)]
    skeleton = _chat_text(tokenizer, sentinels)
    pieces = re.split("\ue000(\\d+)\ue001", skeleton)
    order = [int(i) for i in pieces[1::2]]
    if order != list(range(len(messages))):
        raise HeadsteerValueError("the chat template drops or reorders messages, so spans cannot be located")
    text = ""
    spans: list[tuple[int, int]] = []
    regions: list[tuple[int, int]] = []
    for k, literal in enumerate(pieces[::2]):
        text += literal
        if k < len(messages):
            at, content = len(text), messages[k]["content"]
            regions.append((at, at + len(content)))
            spans.extend((at + a, at + b) for a, b in marks[k])
            text += content
    if text != _chat_text(tokenizer, messages):
        raise HeadsteerValueError(
            "the chat template changes the message text, so spans cannot be located; "
            "pass chat=False or a pre-rendered prompt"
        )
    return text, spans, regions


def emphasis_rows(emphasize: Emphasis, n: int) -> list[list[SpanLike]]:
    """Expand `emphasize` (see `encode_prompts`) to one list of spans per prompt.

    Raises:
        ValueError: a batch-major list whose length is not `n`.
    """
    if emphasize is None:
        return [[] for _ in range(n)]
    if isinstance(emphasize, (str, Span)):
        return [[emphasize] for _ in range(n)]
    if isinstance(emphasize, (bytes, bytearray)) or not isinstance(emphasize, Sequence):
        raise HeadsteerTypeError(
            f"emphasize must be a string, a Span or a list of them, got {short_repr(emphasize)}"
        )
    entries: list[SpanLike | Sequence[SpanLike]] = [e for e in emphasize]
    if not entries:
        return [[] for _ in range(n)]
    flat = [e for e in entries if isinstance(e, (str, Span))]
    if len(flat) == len(entries):
        return [list(flat) for _ in range(n)]
    if len(entries) != n:
        raise HeadsteerValueError(f"emphasize has {len(entries)} rows for {n} prompts (batch-major layout)")
    rows: list[list[SpanLike]] = []
    for e in entries:
        row = [e] if isinstance(e, (str, Span)) else e
        if isinstance(row, (bytes, bytearray)) or not isinstance(row, Sequence):
            raise HeadsteerTypeError(f"emphasize rows must be lists of strings or Spans, got {short_repr(e)}")
        for x in row:
            if not isinstance(x, (str, Span)):
                raise HeadsteerTypeError(f"span to emphasize must be a string or Span, got {short_repr(x)}")
        rows.append(list(row))
    return rows


def encode_prompts(
    tokenizer: object,
    prompts: Prompt | Sequence[Prompt],
    *,
    emphasize: Emphasis = None,
    chat: bool | None = None,
    markup: bool = True,
) -> EncodedPrompts:
    """Render, tokenize and left-pad prompts, and map emphasized spans to token ranges.

    Args:
        tokenizer: a fast Hugging Face tokenizer (offset mapping required); typed `object`
            because `HeadModel.tokenizer` may be None, and checked here.
        prompts: a string, a chat (list of `{"role", "content"}`), or a list of either.
        emphasize: substrings to emphasize, in addition to `**markup**`: one
            substring / `Span` or a list of them for every prompt, or a batch-major
            list with one list per prompt. Searched only inside message contents.
        chat: apply the tokenizer's chat template (default: when it has one).
        markup: parse `**…**` in prompt texts (default True).

    Returns:
        EncodedPrompts with spans in padded coordinates.

    Raises:
        ValueError: empty prompt, span not found, unbalanced markup, a chat
            without a chat template, or a span with a slow (Python) tokenizer (spans
            need the character offsets only fast tokenizers give).
    """
    if not _is_tokenizer(tokenizer):
        raise HeadsteerTypeError(
            f"tokenizer must be a Hugging Face tokenizer, got {type(tokenizer).__name__}"
        )
    items, _ = normalize_prompts(prompts)
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    rows = emphasis_rows(emphasize, len(items))
    special = set(tokenizer.all_special_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids: list[list[int]] = []
    spans: list[list[tuple[int, int]]] = []
    texts: list[str] = []
    char_spans: list[list[tuple[int, int]]] = []
    for prompt, extra in zip(items, rows, strict=True):
        text, cspans, regions = render_prompt(tokenizer, prompt, chat, markup)
        cspans = cspans + [find_span(text, s, regions) for s in extra]
        fast = bool(getattr(tokenizer, "is_fast", True))
        if cspans and not fast:  # only a fast (Rust) tokenizer returns character offsets
            raise HeadsteerValueError(
                f"locating spans needs a fast tokenizer (character offsets); "
                f"{type(tokenizer).__name__} is a slow Python tokenizer: load it with "
                "AutoTokenizer.from_pretrained(..., use_fast=True) or pass no span"
            )
        enc = tokenizer(text, return_offsets_mapping=fast, add_special_tokens=not chat)
        skip = [t in special for t in enc["input_ids"]]
        ids.append(list(enc["input_ids"]))
        spans.append([char_to_token_range(enc["offset_mapping"], c, skip) for c in cspans])
        texts.append(text)
        char_spans.append(cspans)
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for b, row in enumerate(ids):
        pad = width - len(row)
        input_ids[b, pad:] = torch.tensor(row, dtype=torch.long)
        attention_mask[b, pad:] = 1
        spans[b] = [(t0 + pad, t1 + pad) for t0, t1 in spans[b]]
    return EncodedPrompts(input_ids, attention_mask, spans, texts, char_spans)
