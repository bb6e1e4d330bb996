"""Named attention patterns: where a head of a given kind looks, per query row and key column.

Shared by the pattern-injection edit (`steer.pattern_injection`, which sets or mixes a head's
attention toward one of these patterns) and by pattern discovery (`heads.scorers.roles.clusters`,
which measures how much of each head's attention falls on each pattern). A pattern is a 0/1
*support* `S[b, i, j]` over absolute positions of the left-padded batch; rows are query
positions, columns key positions. Only real (unpadded), causal keys are ever in the support;
with a sliding window only keys with `i - j < window`.

The names (`NAMED_PATTERNS`), for a row at prompt position `c` (0 = the row's first real token):

* `previous-token`: key `c - 1` (Olsson et al. 2022; the reference's "-1 positional" heads of
  Li et al., EMNLP 2022). The first token has no previous token: an empty row.
* `first-token`: key 0, the row's first real token (BOS where the tokenizer adds one): the
  attention sink (Xiao et al. 2024).
* `attend-to-span`: the keys of the row's marked span(s) (`**...**` / `emphasize=`, or the image
  tokens); rows before the span start are empty.
* `same-sentence`: the keys of the sentence that holds the row (Li et al.'s intra-sentence
  pattern). Sentences end after a token whose text ends in `.`, `!` or `?` (closing quotes and
  brackets allowed after it), or holds a line break. Generated tokens (positions >= the prompt
  length) all belong to one open sentence: the prompt's last sentence when the prompt does not
  end one, else a new sentence of generated tokens only (their text is not known in advance).
* `matching-token`: earlier keys holding the same token id as the row (Li et al.'s matching-token
  pattern, restricted to earlier keys as a decoder sees them; the row itself excluded). Generated
  rows are empty.

An empty row means "no target": the injection leaves it unchanged, discovery does not count it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts

__all__ = ["NAMED_PATTERNS", "PatternContext", "check_pattern_name", "named_support", "sentence_ids"]

NAMED_PATTERNS = ("previous-token", "first-token", "attend-to-span", "same-sentence", "matching-token")
"""The named patterns `named_support` builds."""

_END = re.compile(r"[.!?][\"')\]»”’]*\s*$")


def check_pattern_name(name: object) -> str:
    """`name` if it is one of `NAMED_PATTERNS` (HeadsteerValueError naming the choices otherwise)."""
    if not isinstance(name, str) or name not in NAMED_PATTERNS:
        raise HeadsteerValueError(
            f"unknown pattern {short_repr(name)}: use one of {', '.join(NAMED_PATTERNS)} or a [T, T] tensor"
        )
    return name


def sentence_ids(tokens: Sequence[str], real: torch.Tensor) -> torch.Tensor:
    """`[P]` long sentence index of each token of one row (-1 on padding; 0 for the first sentence).

    Args:
        tokens: the decoded text of each of the row's P tokens (padding included, ignored).
        real: `[P]` bool, True on real tokens.

    A sentence ends after a token whose text ends in `.`, `!` or `?` (closing quotes or brackets
    may follow) or holds a line break; the next real token starts a new one.
    """
    out = torch.full((len(tokens),), -1, dtype=torch.long)
    sid, ended = 0, False
    for i, (text, on) in enumerate(zip(tokens, real.tolist(), strict=True)):
        if not on:
            continue
        if ended:
            sid, ended = sid + 1, False
        out[i] = sid
        ended = "\n" in text or bool(_END.search(text))
    return out


@dataclass
class PatternContext:
    """What the named patterns need to know of a left-padded batch (built by `of`).

    Attributes:
        first: `[B]` long, the absolute position of each row's first real token (its left padding).
        length: P, the padded prompt length; positions >= P are generated tokens.
        span: `[B, P]` bool, the marked span's key columns (`attend-to-span`).
        sentence: `[B, P]` long sentence ids of the prompt tokens (-1 on padding).
        open_sentence: `[B]` long, the sentence id of every generated token.
        ids: `[B, P]` long token ids of the prompt (`matching-token`).
        window: sliding-window size of the layer (keys with `i - j < window`), or None.
    """

    first: torch.Tensor
    length: int
    span: torch.Tensor
    sentence: torch.Tensor
    open_sentence: torch.Tensor
    ids: torch.Tensor
    window: int | None = None

    @classmethod
    def of(cls, enc: EncodedPrompts, tokenizer: object, *, span_target: str = "text") -> PatternContext:
        """The context of `enc` (sentences from `tokenizer`'s decoding of each token; spans of
        `span_target`: `"text"`, `"image"`, `"both"` or `"auto"`, see `EncodedPrompts.select_spans`)."""
        real = enc.attention_mask.bool()
        first = (~real).long().sum(-1)  # left padding: the first real position
        span = enc.span_mask(target=span_target) & real
        sent = torch.full_like(enc.input_ids, -1)
        open_ = torch.zeros(enc.batch, dtype=torch.long)
        decode = getattr(tokenizer, "decode", None)
        for b in range(enc.batch):
            ids = enc.input_ids[b].tolist()
            toks = [str(decode([t])) if callable(decode) else "" for t in ids]
            sent[b] = sentence_ids(toks, real[b])
            last = int(sent[b, -1])
            ends = bool(real[b, -1]) and ("\n" in toks[-1] or bool(_END.search(toks[-1])))
            open_[b] = last + 1 if ends else last
        return cls(first, enc.length, span, sent, open_, enc.input_ids.clone())


def named_support(
    name: str, ctx: PatternContext, q_offset: int, q_len: int, k_len: int, device: torch.device
) -> torch.Tensor:
    """`[B, q_len, k_len]` bool support of pattern `name` for query rows `q_offset..q_offset+q_len-1`
    (absolute positions) over key columns `0..k_len-1`, already restricted to real, causal keys
    (and to the window). See the module docstring for each name.

    Raises:
        HeadsteerValueError: an unknown name.
    """
    check_pattern_name(name)
    b = ctx.first.shape[0]
    first = ctx.first.to(device)[:, None, None]  # [B, 1, 1]
    q = torch.arange(q_offset, q_offset + q_len, device=device)[None, :, None]  # [1, Q, 1]
    k = torch.arange(k_len, device=device)[None, None, :]  # [1, 1, K]
    visible = (k <= q) & (k >= first)
    if ctx.window is not None:
        visible &= q - k < ctx.window
    p = ctx.length
    if name == "previous-token":
        sup = k == q - 1
    elif name == "first-token":
        sup = k == first
    elif name == "attend-to-span":
        cols = torch.zeros(b, k_len, dtype=torch.bool, device=device)
        w = min(p, k_len)
        cols[:, :w] = ctx.span[:, :w].to(device)
        sup = cols[:, None, :]
    elif name == "same-sentence":
        kid = torch.empty(b, k_len, dtype=torch.long, device=device)
        w = min(p, k_len)
        kid[:, :w] = ctx.sentence[:, :w].to(device)
        kid[:, w:] = ctx.open_sentence.to(device)[:, None]
        qpos = torch.arange(q_offset, q_offset + q_len, device=device)
        qid = torch.empty(b, q_len, dtype=torch.long, device=device)
        in_prompt = qpos < p
        qid[:, in_prompt] = ctx.sentence.to(device)[:, qpos[in_prompt]]
        qid[:, ~in_prompt] = ctx.open_sentence.to(device)[:, None]
        sup = (kid[:, None, :] == qid[:, :, None]) & (qid[:, :, None] >= 0)
    else:  # matching-token
        kid = torch.full((b, k_len), -1, dtype=torch.long, device=device)
        w = min(p, k_len)
        kid[:, :w] = ctx.ids[:, :w].to(device)
        qpos = torch.arange(q_offset, q_offset + q_len, device=device)
        qid = torch.full((b, q_len), -2, dtype=torch.long, device=device)
        in_prompt = qpos < p
        qid[:, in_prompt] = ctx.ids.to(device)[:, qpos[in_prompt]]
        sup = (kid[:, None, :] == qid[:, :, None]) & (k < q)
    return sup & visible
