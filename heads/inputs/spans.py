"""Spans: emphasis markup, substring spans and character -> token ranges.

Source: docs/methods/pasta.md (half-open offsets, never BOS or pad). Character spans
and token ranges are half-open `[start, end)`. A token belongs to a span when its
character range overlaps it (`s < c_end and e > c_start`), so a token that ends
exactly at the span start (adjacent punctuation, BOS at character 0) is excluded.
Special and pad tokens are never part of a token range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from heads._util.validation import check_int, short_repr
from heads.errors import HeadsteerValueError

__all__ = ["MARKER", "Span", "char_to_token_range", "find_span", "parse_markup"]

MARKER = "**"


@dataclass(frozen=True)
class Span:
    """A substring to emphasize; `occurrence` picks the k-th match (0 = first).

    Raises:
        ValueError: empty text or negative occurrence.
    """

    text: str
    occurrence: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text:
            raise HeadsteerValueError(f"span text must be a non-empty string, got {short_repr(self.text)}")
        check_int("span occurrence", self.occurrence, lo=0)


def parse_markup(text: str, marker: str = MARKER) -> tuple[str, list[tuple[int, int]]]:
    """Strip `**emphasis**` markup.

    Args:
        text: e.g. `"Bio ... **Answer in JSON.** ..."`.
        marker: the delimiter (default `**`).

    Returns:
        `(clean_text, spans)`: the text without markers and the half-open character
        spans `[(start, end), ...]` of the emphasized parts in `clean_text`.

    Raises:
        ValueError: an unclosed marker or an empty emphasized part (`****`).
    """
    parts = text.split(marker)
    if len(parts) % 2 == 0:
        raise HeadsteerValueError(
            f"unbalanced {short_repr(marker)} markup in prompt: {short_repr(text[:80])}"
        )
    clean: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for i, part in enumerate(parts):
        if i % 2 == 1:
            if not part.strip():
                raise HeadsteerValueError(f"empty emphasized span {marker}{part}{marker} in prompt")
            spans.append((pos, pos + len(part)))
        clean.append(part)
        pos += len(part)
    return "".join(clean), spans


def find_span(
    text: str,
    span: str | Span,
    regions: Sequence[tuple[int, int]] | None = None,
) -> tuple[int, int]:
    """Character span of the `occurrence`-th match of `span` in `text`.

    Args:
        text: the (rendered) prompt.
        span: substring or `Span(substring, occurrence)`.
        regions: optional half-open character regions to search in (e.g. the message
            contents of a chat prompt, so template text is never matched);
            occurrences are counted across regions in order.

    Raises:
        ValueError: the substring (or that occurrence of it) is not in the text.
    """
    sp = span if isinstance(span, Span) else Span(span)
    regions = list(regions) if regions is not None else [(0, len(text))]
    seen = 0
    for r0, r1 in regions:
        at = text.find(sp.text, r0, r1)
        while at != -1:
            if seen == sp.occurrence:
                return at, at + len(sp.text)
            seen += 1
            at = text.find(sp.text, at + 1, r1)
    which = "" if sp.occurrence == 0 else f" (occurrence {sp.occurrence}; found {seen})"
    raise HeadsteerValueError(f"span {short_repr(sp.text)} not found in the prompt{which}")


def char_to_token_range(
    offsets: Sequence[tuple[int, int]],
    char_span: tuple[int, int],
    skip: Sequence[bool] | None = None,
) -> tuple[int, int]:
    """Half-open token range `[t0, t1)` covering the half-open character span.

    Args:
        offsets: per-token `(start, end)` character offsets (a fast tokenizer's
            `offset_mapping`), length T.
        char_span: `(c_start, c_end)`, `c_start < c_end`.
        skip: per-token flags for tokens that may never be in a span (special,
            BOS, pad); tokens with empty offsets are skipped too.

    Raises:
        ValueError: empty char span, or no token overlaps it (never an empty range).
    """
    c0, c1 = char_span
    if not c0 < c1:
        raise HeadsteerValueError(f"empty character span {char_span}")
    hit = [
        i
        for i, (s, e) in enumerate(offsets)
        if e > s and s < c1 and e > c0 and not (skip is not None and skip[i])
    ]
    if not hit:
        raise HeadsteerValueError(f"no token covers characters {c0}..{c1}")
    return hit[0], hit[-1] + 1
