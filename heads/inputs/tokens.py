"""Tokens as readable text: decoded pieces with visible markers for spaces and line breaks.

Tables and figures show a token as the text it stands for, not as the tokenizer's internal
string: the byte-level BPE token `Ġthe` is shown `␣the`, `Ċ` is `⏎`, SentencePiece's `▁the`
is `␣the`. Whitespace that would vanish in a table cell or an axis label gets a marker:

| character | marker |
|---|---|
| space | `␣` (U+2423) |
| newline `\\n` | `⏎` (U+23CE) |
| tab `\\t` | `⇥` (U+21E5) |
| carriage return `\\r` | `␍` (U+240D) |
| other control characters | `\\xNN` |

A token that holds only part of a multi-byte UTF-8 character (byte-level BPE splits some
characters, e.g. CJK, over several tokens) is shown with its bytes as `\\xNN` escapes
instead of the replacement character `�`, so different tokens stay distinguishable.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

import torch

from heads._util.validation import check_int
from heads.errors import HeadsteerTypeError, HeadsteerValueError

__all__ = ["MARKERS", "readable_token", "readable_tokens", "visible"]

MARKERS = {" ": "\u2423", "\n": "\u23ce", "\t": "\u21e5", "\r": "\u240d"}
"""Character -> the visible marker shown in its place."""

_REPLACEMENT = "\ufffd"
_SP_SPACE = "\u2581"  # SentencePiece's word-start marker


def visible(text: str) -> str:
    """`text` with spaces, line breaks and tabs replaced by visible markers (`MARKERS`) and
    other control characters by `\\xNN` escapes; printable text is unchanged.

    Raises:
        TypeError: `text` is not a string.
    """
    if not isinstance(text, str):
        raise HeadsteerTypeError(f"visible() takes a string, got {type(text).__name__}")
    out = []
    for ch in text:
        if ch in MARKERS:
            out.append(MARKERS[ch])
        elif unicodedata.category(ch) == "Cc":
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte, inverted."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _piece(tokenizer: Any, token_id: int) -> str:
    """The text of one token (no markers yet)."""
    text: str = tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    raw = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(raw, str):
        return text
    if _REPLACEMENT in text:
        dec = _byte_decoder()
        if raw and all(ch in dec for ch in raw):  # byte-level BPE: show the bytes themselves
            return bytes(dec[ch] for ch in raw).decode("utf-8", errors="backslashreplace")
    if raw.startswith(_SP_SPACE) and not text.startswith(" "):
        text = " " + text  # SentencePiece drops a single token's leading space when decoding
    return text


def readable_token(tokenizer: Any, token_id: int) -> str:
    """One token as readable text: its decoded piece with visible whitespace markers.

    Args:
        tokenizer: a Hugging Face tokenizer.
        token_id: the token id (an int or a 0-d tensor).

    Raises:
        TypeError: `token_id` is not an integer.
    """
    if isinstance(token_id, torch.Tensor):
        token_id = token_id.item()
    check_int("token_id", token_id, type_error=True)
    return visible(_piece(tokenizer, token_id))


def readable_tokens(tokenizer: Any, ids: Iterable[int] | torch.Tensor) -> list[str]:
    """Each token of `ids` (a list of ints or a 1-D tensor `[T]`) as readable text
    (`readable_token`), e.g. `["Hello", "␣world", "⏎⏎"]`.

    Raises:
        ValueError: a tensor that is not 1-D.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise HeadsteerValueError(
                f"readable_tokens takes a 1-D id tensor [T], got shape {tuple(ids.shape)}"
            )
        ids = ids.tolist()
    return [readable_token(tokenizer, int(i)) for i in ids]
