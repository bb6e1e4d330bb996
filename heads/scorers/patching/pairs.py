"""Clean / corrupted prompt pairs for causal analysis (activation and path patching, EAP).

A *pair* is a clean prompt x and a corrupted prompt x~ of the **same token length**, so that
position t of one is aligned with position t of the other, plus the answer token(s) c (what the
clean prompt should predict) and the counterfactual token(s) w (what the corrupted prompt
suggests). Sources: Meng et al. 2022 (causal tracing), Wang et al. 2022 (IOI, Sec. 3),
Zhang & Nanda 2024 (best practices: token-aligned corruptions).

`encode_pairs` tokenizes a list of pairs into a `PairBatch`: the clean and the corrupted rows
left-padded to one width `T` (they share one attention mask, since each pair has one length),
and the answer / counterfactual ids as `[N, A]` / `[N, C]` tensors with masks. The metric is
read at the last column (`T - 1`), the last real token of every row under left padding.

Alignment is checked on token ids, never on characters: a pair whose two prompts tokenize to
different lengths is a `ValueError` naming both lengths, never truncated or padded inside the
pair. Answer strings must be single tokens (a `ValueError` names the string and its tokens;
`first_token=True` takes the first token instead).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from heads._util.validation import check_int, is_int, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.tokens import readable_tokens
from heads.scorers.patching.pair_batch import Answer, PairBatch, PromptPair, _answer_list  # noqa: F401 - Answer importable here as before

__all__ = [
    "PairBatch",
    "PromptPair",
    "check_pairs_differ",
    "encode_pairs",
    "load_pairs",
    "pairs_from_tokens",
    "token_id",
]


def token_id(tokenizer: Any, answer: str | int, *, first_token: bool = False, where: str = "answer") -> int:
    """The single token id of `answer` (a string tokenized without special tokens, or an id).

    Raises:
        ValueError: a string that is not exactly one token (names it and its tokens; with
            `first_token=True` the first token is returned instead), an empty string, or an id
            out of the vocabulary.
        TypeError: neither a string nor an int.
    """
    if isinstance(answer, bool) or not isinstance(answer, (str, numbers.Integral)):
        raise HeadsteerTypeError(f"{where} must be a string or a token id, got {short_repr(answer)}")
    if isinstance(answer, numbers.Integral):
        n = len(tokenizer)
        if not 0 <= int(answer) < n:
            raise HeadsteerValueError(f"{where} token id {answer} is outside the vocabulary 0..{n - 1}")
        return int(answer)
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    if not ids:
        raise HeadsteerValueError(f"{where} {short_repr(answer)} tokenizes to nothing")
    if len(ids) != 1 and not first_token:
        pieces = readable_tokens(tokenizer, ids)  # "␣Mary", not the byte-level "ĠMary"
        raise HeadsteerValueError(
            f"{where} {short_repr(answer)} is {len(ids)} tokens {pieces}, not one; pass first_token=True to "
            f"use the first token {short_repr(pieces[0])}"
        )
    return int(ids[0])


def _pad_answers(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max((len(r) for r in rows), default=1))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = True
    return ids, mask


def _check_token_row(where: str, row: object) -> list[int]:
    """`row` (a list / tuple / 1-D tensor of token ids) as a list of ints >= 0.

    Raises:
        HeadsteerTypeError: a string, a non-list, or an entry that is not an int (floats and bools
            included: `1.7` is never silently truncated).
        HeadsteerValueError: a negative id.
    """
    if isinstance(row, torch.Tensor):
        if row.ndim != 1 or row.dtype.is_floating_point or row.dtype == torch.bool:
            raise HeadsteerTypeError(
                f"{where} must be a 1-D list of int token ids, got a {row.dtype} {tuple(row.shape)} tensor"
            )
        row = row.tolist()
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
        raise HeadsteerTypeError(f"{where} must be a list of int token ids, got {short_repr(row)}")
    out = []
    for x in row:
        if not is_int(x):
            raise HeadsteerTypeError(f"{where} token ids must be ints, got {short_repr(x)}")
        if int(x) < 0:
            raise HeadsteerValueError(f"{where} token id {int(x)} is negative")
        out.append(int(x))
    return out


def check_vocab(pairs: PairBatch, d_vocab: int, where: str = "pairs", *, images: bool = False) -> None:
    """Refuse, before any forward, a `PairBatch` whose ids (prompts, padding, answers,
    counterfactuals) fall outside the model's vocabulary `0..d_vocab - 1`, and vision pairs
    unless `images=True` (only activation patching runs their images).

    Raises:
        HeadsteerTypeError: `pairs` not a `PairBatch`.
        HeadsteerValueError: no pairs (`n = 0`);
            `"<where>: <field> token id <id> is outside the vocabulary 0..V-1"`;
            vision pairs where `images` is False.
    """
    if not isinstance(pairs, PairBatch):
        raise HeadsteerTypeError(f"{where} must be a PairBatch (encode_pairs), got {type(pairs).__name__}")
    if pairs.n == 0:
        raise HeadsteerValueError(f"{where} holds no pairs (n = 0, e.g. pairs.select([])): nothing to run")
    if pairs.has_images and not images:
        raise HeadsteerValueError(
            f"{where}: vision pairs (encode_image_pairs) are taken by activation patching (patch) "
            "only; this analysis would run their prompts without the images"
        )
    fields = (
        ("clean", pairs.clean_ids, None),
        ("corrupted", pairs.corrupted_ids, None),
        ("answer", pairs.answers, pairs.answer_mask),
        ("counterfactual", pairs.counterfactuals, pairs.counterfactual_mask),
    )
    for name, ids, mask in fields:
        vals = ids if mask is None else ids[mask.bool()]
        if vals.numel() == 0:
            continue
        bad = vals[(vals < 0) | (vals >= d_vocab)]
        if bad.numel():
            raise HeadsteerValueError(
                f"{where}: {name} token id {int(bad[0])} is outside the vocabulary 0..{d_vocab - 1}"
            )


def _describe(pairs: PairBatch | Sequence[PromptPair], i: int) -> str:
    p = pairs[i] if not isinstance(pairs, PairBatch) else (pairs.pairs[i] if pairs.pairs else None)
    if p is not None:
        return f"clean {short_repr(p.clean)}, corrupted {short_repr(p.corrupted)}"
    assert isinstance(pairs, PairBatch)
    ids = pairs.clean_ids[i][pairs.attention_mask[i].bool()].tolist()
    return f"clean tokens {ids[:8]}{' ...' if len(ids) > 8 else ''}"


def check_pairs_differ(pairs: PairBatch | Sequence[PromptPair], *, counterfactual: bool = True) -> None:
    """Refuse, before any forward, a pair that cannot show any effect: its clean and corrupted
    prompts are the same (text, or for a `PairBatch` the same tokens: every site's two values are
    equal, so every score is 0 / 0), or (with `counterfactual`, for metrics that read it such as
    the logit difference) its counterfactual tokens are its answer tokens (the metric is 0 on
    every run). One shared check: the patching sweeps, `headsteer report patching` (on the pairs'
    text, before the model loads) and the explorer call it. Vision pairs share their prompt by
    design and are not compared on tokens.

    Raises:
        ValueError: `"pair <i> (clean '...', corrupted '...'): ..."`, the first such pair.
    """
    if isinstance(pairs, PairBatch):
        for i in range(pairs.n):
            real = pairs.attention_mask[i].bool()
            if not pairs.has_images and torch.equal(pairs.clean_ids[i][real], pairs.corrupted_ids[i][real]):
                raise HeadsteerValueError(
                    f"pair {i} ({_describe(pairs, i)}): clean and corrupted are the same text (the same "
                    "tokens): nothing to patch"
                )
            ans = set(pairs.answers[i][pairs.answer_mask[i]].tolist())
            cf = set(pairs.counterfactuals[i][pairs.counterfactual_mask[i]].tolist())
            if counterfactual and cf and cf == ans:
                raise HeadsteerValueError(
                    f"pair {i} ({_describe(pairs, i)}): the counterfactual is the answer (token ids "
                    f"{sorted(ans)}): their logit difference is always 0"
                )
        return
    for i, p in enumerate(pairs):
        if p.clean == p.corrupted:
            raise HeadsteerValueError(
                f"pair {i} ({_describe(pairs, i)}): clean and corrupted are the same text: nothing to patch"
            )
        if counterfactual and p.counterfactual is not None:
            a_list = _answer_list(p.answer, f"pair {i} answer")
            c_list = _answer_list(p.counterfactual, f"pair {i} counterfactual")
            if set(map(repr, a_list)) == set(map(repr, c_list)):
                raise HeadsteerValueError(
                    f"pair {i} ({_describe(pairs, i)}): the counterfactual is the answer "
                    f"({short_repr(p.answer)}): their logit difference is always 0"
                )


def pairs_from_tokens(
    clean: Sequence[Sequence[int]],
    corrupted: Sequence[Sequence[int]],
    answers: Sequence[int | Sequence[int]],
    counterfactuals: Sequence[int | Sequence[int]] | None = None,
    *,
    pad_id: int = 0,
    tokens: list[list[str]] | None = None,
    pairs: list[PromptPair | None] | None = None,
    positions: Mapping[str, Sequence[int]] | None = None,
) -> PairBatch:
    """A `PairBatch` from token ids (no tokenizer): rows are left-padded with `pad_id`.

    `tokens`: per pair, the clean row's tokens as text, for position labels (default None: the
    analyses label positions with the ids decoded by the model's tokenizer,
    `PairBatch.position_labels`). `positions`: named positions, `{name: one token index per
    pair}` counted in the unpadded prompt (0 = its first token; -1: the pair lacks the name);
    stored in padded columns.

    Raises:
        ValueError: no pairs, lists of different lengths, an empty prompt, a pair whose clean
            and corrupted rows differ in length (names the pair and both lengths), a pair
            without an answer.
    """
    for name, value in (("clean", clean), ("corrupted", corrupted), ("answers", answers)):
        if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, torch.Tensor)):
            raise HeadsteerTypeError(f"{name} must be a list (one entry per pair), got {short_repr(value)}")
    if counterfactuals is not None and (
        isinstance(counterfactuals, (str, bytes)) or not isinstance(counterfactuals, (Sequence, torch.Tensor))
    ):
        raise HeadsteerTypeError(f"counterfactuals must be a list or None, got {short_repr(counterfactuals)}")
    pad_id = check_int("pad_id", pad_id, lo=0)
    n = len(clean)
    if n == 0:
        raise HeadsteerValueError("no pairs given")
    for name, value in (("clean", clean), ("corrupted", corrupted)):
        for i, row in enumerate(value):
            _check_token_row(f"pair {i} {name}", row)
    if (
        len(corrupted) != n
        or len(answers) != n
        or (counterfactuals is not None and len(counterfactuals) != n)
    ):
        raise HeadsteerValueError(
            f"clean ({n}), corrupted ({len(corrupted)}), answers ({len(answers)}) and counterfactuals "
            "must have one entry per pair"
        )
    for i, (a, b) in enumerate(zip(clean, corrupted, strict=True)):
        if len(a) == 0:
            raise HeadsteerValueError(f"pair {i}: empty clean prompt")
        if len(a) != len(b):
            raise HeadsteerValueError(
                f"pair {i}: clean prompt is {len(a)} tokens, corrupted prompt is {len(b)} tokens; "
                "positions must align (same token length)"
            )
    width = max(len(a) for a in clean)
    c_ids = torch.full((n, width), pad_id, dtype=torch.long)
    x_ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, (a, b) in enumerate(zip(clean, corrupted, strict=True)):
        c_ids[i, width - len(a) :] = torch.as_tensor(list(a), dtype=torch.long)
        x_ids[i, width - len(b) :] = torch.as_tensor(list(b), dtype=torch.long)
        mask[i, width - len(a) :] = 1

    def rows(values, what: str, required: bool) -> list[list[int]]:
        out = []
        for i, v in enumerate(values):
            r = (
                [check_int(f"pair {i} {what}", v, lo=0, what="a token id (an int >= 0)")]
                if (isinstance(v, numbers.Integral) and not isinstance(v, bool))
                else _check_token_row(f"pair {i} {what}", v)
            )
            if required and not r:
                raise HeadsteerValueError(f"pair {i}: no {what} token")
            out.append(r)
        return out

    ans, ans_mask = _pad_answers(rows(answers, "answer", True))
    cf_rows = rows(counterfactuals, "counterfactual", False) if counterfactuals is not None else [[]] * n
    cf, cf_mask = _pad_answers(cf_rows)
    lengths = [len(a) for a in clean]
    return PairBatch(
        c_ids,
        x_ids,
        mask,
        ans,
        ans_mask,
        cf,
        cf_mask,
        list(pairs) if pairs else [None] * n,
        tokens or [],
        _pad_positions(positions or {}, lengths, width),
    )


def _pad_positions(
    positions: Mapping[str, Sequence[int]], lengths: list[int], width: int
) -> dict[str, torch.Tensor]:
    """Named positions in unpadded token indices -> `{name: [N] long}` padded columns (-1 kept).

    Raises:
        ValueError: a name that is not a non-empty string or is `"END"` (always the last
            column), a list without one entry per pair, an index outside its prompt.
    """
    if not isinstance(positions, Mapping):
        raise HeadsteerTypeError(
            f"positions must be a mapping of name -> indices, got {short_repr(positions)}"
        )
    out = {}
    for name, idx in positions.items():
        if not isinstance(name, str) or not name or name == "END":
            raise HeadsteerValueError(
                f"position names are non-empty strings other than 'END' (always the last token), got "
                f"{short_repr(name)}"
            )
        if (
            isinstance(idx, (str, bytes))
            or not isinstance(idx, (Sequence, torch.Tensor))
            or len(idx) != len(lengths)
        ):
            raise HeadsteerValueError(f"position {name!r} needs one token index per pair ({len(lengths)})")
        col = []
        for i, (t, n) in enumerate(zip(idx, lengths, strict=True)):
            t = check_int(f"pair {i} position {name!r}", t, lo=-1, hi=n - 1)
            col.append(-1 if t < 0 else width - n + t)
        out[name] = torch.tensor(col, dtype=torch.long)
    return out


def _locate_positions(
    tok: Any, pair: PromptPair, ids: list[int], *, chat: bool, shift: int, where: str
) -> dict[str, int]:
    """`pair.positions` (character spans or substrings of the clean prompt) as token indices of
    its unpadded clean row `ids`: the token holding each span's last character.

    Raises:
        ValueError: a malformed span, a substring not in the prompt, a slow tokenizer (no
            character offsets), a chat template whose tokens differ from the plain text's.
    """
    if not pair.positions:
        return {}
    from heads.inputs.prompts import render_prompt
    from heads.inputs.spans import char_to_token_range

    if not bool(getattr(tok, "is_fast", False)):
        raise HeadsteerValueError(
            f"{where}: named positions need a fast tokenizer (character offsets); "
            f"{type(tok).__name__} is a slow one"
        )
    if chat:
        text, _, regions = render_prompt(tok, pair.clean, True, False)
        at = regions[0][0]
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    else:
        at = 0
        enc = tok(pair.clean, add_special_tokens=True, return_offsets_mapping=True)
    if list(enc["input_ids"]) != ids[shift:]:
        raise HeadsteerValueError(
            f"{where}: the prompt's tokens differ when read with character offsets, so its named "
            "positions cannot be located"
        )
    special = set(getattr(tok, "all_special_ids", ()))
    skip = [t in special for t in enc["input_ids"]]
    out = {}
    for name, span in pair.positions.items():
        if isinstance(span, str):
            c0 = pair.clean.find(span)
            if not span or c0 < 0:
                raise HeadsteerValueError(
                    f"{where}: position {name!r}: {short_repr(span)} is not in the clean prompt"
                )
            c1 = c0 + len(span)
        elif (
            isinstance(span, (list, tuple))
            and len(span) == 2
            and all(is_int(x) for x in span)
            and 0 <= span[0] < span[1] <= len(pair.clean)
        ):
            c0, c1 = int(span[0]), int(span[1])
        else:
            raise HeadsteerValueError(
                f"{where}: position {name!r} must be a substring of the clean prompt or a [start, end] "
                f"character span inside it (0 <= start < end <= {len(pair.clean)}), got {short_repr(span)}"
            )
        _, t1 = char_to_token_range(enc["offset_mapping"], (at + c0, at + c1), skip)
        out[name] = t1 - 1 + shift
    return out


def _tokenizer_of(model_or_tokenizer: Any) -> Any:
    tok = getattr(model_or_tokenizer, "tokenizer", None)
    if tok is not None and not callable(getattr(model_or_tokenizer, "convert_ids_to_tokens", None)):
        return tok
    if callable(model_or_tokenizer) and hasattr(model_or_tokenizer, "convert_ids_to_tokens"):
        return model_or_tokenizer
    raise HeadsteerTypeError(
        f"need a tokenizer or a HeadModel with one, got {type(model_or_tokenizer).__name__}"
    )


def encode_pairs(
    model_or_tokenizer: Any,
    pairs: Sequence[PromptPair | Mapping[str, Any]] | str | os.PathLike,
    *,
    chat: bool = False,
    first_token: bool = False,
    add_bos: bool = False,
) -> PairBatch:
    """Tokenize pairs into a left-padded `PairBatch` (every check before any model work).

    Args:
        model_or_tokenizer: a `HeadModel` (its tokenizer) or a Hugging Face tokenizer.
        pairs: `PromptPair`s, dicts with `clean`, `corrupted`, `answer`, `counterfactual`
            (optional `positions`: named character spans, see `PromptPair`), or a JSONL file of
            such records (`load_pairs`). The shipped sets carry theirs (IOI: `IO`, `S1`, `S2`).
        chat: render both prompts with the tokenizer's chat template (default False: plain
            text, as in the IOI and causal-tracing papers). Both rows always share the template,
            BOS and padding rule.
        first_token: take the first token of a multi-token answer instead of raising.
        add_bos: prepend the tokenizer's BOS id to both rows when the tokenizer does not add it
            itself (default False: the rows are what the tokenizer gives).

    Returns:
        a `PairBatch` (pad id = the tokenizer's pad id, else 0), its `tokens` readable text, its
        named positions in `positions` (`PairBatch.position(name)`).

    Raises:
        ValueError: no pairs; a pair whose prompts differ in token length (names both lengths);
            an empty prompt; an answer that is not one token (names it; see `first_token`); a
            named position that is no span of the clean prompt, or a slow tokenizer with named
            positions.
        TypeError: a pair of the wrong type.
    """
    tok = _tokenizer_of(model_or_tokenizer)
    if isinstance(pairs, (str, os.PathLike)):
        pairs = load_pairs(pairs)
    if isinstance(pairs, (PromptPair, Mapping)):
        pairs = [pairs]  # type: ignore[list-item]
    items = [
        p if isinstance(p, PromptPair) else PromptPair.from_dict(p, f"pair {i}") for i, p in enumerate(pairs)
    ]
    if not items:
        raise HeadsteerValueError("no pairs given")
    bos = getattr(tok, "bos_token_id", None)
    clean, corr, answers, cfs, tokens = [], [], [], [], []
    located: list[dict[str, int]] = []
    for i, p in enumerate(items):
        for name, text in (("clean", p.clean), ("corrupted", p.corrupted)):
            if not isinstance(text, str):
                raise HeadsteerTypeError(
                    f"pair {i}: {name} prompt must be a string, got {type(text).__name__}"
                )
            if not text.strip():
                raise HeadsteerValueError(f"pair {i}: empty {name} prompt")
        n_plain = 0  # the clean row's length before add_bos (chat=False)
        if chat:
            a = tok.apply_chat_template([{"role": "user", "content": p.clean}], add_generation_prompt=True)
            b = tok.apply_chat_template(
                [{"role": "user", "content": p.corrupted}], add_generation_prompt=True
            )
            a = list(a["input_ids"] if isinstance(a, Mapping) else a)
            b = list(b["input_ids"] if isinstance(b, Mapping) else b)
        else:
            a = list(tok(p.clean, add_special_tokens=True)["input_ids"])
            b = list(tok(p.corrupted, add_special_tokens=True)["input_ids"])
            n_plain = len(a)
            if add_bos and bos is not None:
                if not a or a[0] != bos:
                    a = [bos, *a]
                if not b or b[0] != bos:
                    b = [bos, *b]
        if len(a) != len(b):
            raise HeadsteerValueError(
                f"pair {i}: clean prompt is {len(a)} tokens, corrupted prompt is {len(b)} tokens; "
                f"positions must align (clean {short_repr(p.clean)}, corrupted {short_repr(p.corrupted)})"
            )
        ans = _answer_list(p.answer, f"pair {i} answer")
        if not ans:
            raise HeadsteerValueError(f"pair {i}: no answer token")
        answers.append([token_id(tok, x, first_token=first_token, where=f"pair {i} answer") for x in ans])
        cf = _answer_list(p.counterfactual, f"pair {i} counterfactual")
        cfs.append([token_id(tok, x, first_token=first_token, where=f"pair {i} counterfactual") for x in cf])
        clean.append(a)
        corr.append(b)
        tokens.append(readable_tokens(tok, a))
        shift = 0 if chat else len(a) - n_plain
        located.append(_locate_positions(tok, p, a, chat=chat, shift=shift, where=f"pair {i}"))
    pad = getattr(tok, "pad_token_id", None)
    pad = 0 if pad is None else int(pad)
    names = list(dict.fromkeys(k for row in located for k in row))
    positions = {k: [row.get(k, -1) for row in located] for k in names}
    return pairs_from_tokens(
        clean, corr, answers, cfs, pad_id=pad, tokens=tokens, pairs=list(items), positions=positions
    )


def load_pairs(path: str | os.PathLike, split: str | None = None) -> list[PromptPair]:
    """Read pairs from a JSONL file (one JSON object per line; blank lines skipped).

    Args:
        split: keep only records whose `split` field equals it (e.g. `"train"` / `"test"`).

    Raises:
        ValueError: a missing file or a directory, a line that is not UTF-8 or not JSON or holds
            an integer of more than 4300 digits (one line naming the file and the line:
            `"'p.jsonl' line 3 is not valid JSON: ..."`, `"a number in 'p.jsonl' line 3 is too
            large ..."`), a record without the required keys, or no pairs left.
    """
    shown = os.fspath(path)
    if os.path.isdir(path):
        raise HeadsteerValueError(f"pairs file {shown!r} is a directory, not a JSONL file")
    if not os.path.isfile(path):
        raise HeadsteerValueError(f"pairs file {shown!r} does not exist")
    from heads._util.validation import read_jsonl_file

    out = []
    for n, d in read_jsonl_file(path):  # one line: not JSON (column), not UTF-8, a number too large
        p = PromptPair.from_dict(d, f"{os.fspath(path)} line {n}")
        if split is None or p.meta.get("split") == split:
            out.append(p)
    if not out:
        raise HeadsteerValueError(
            f"no pairs in {os.fspath(path)!r}" + (f" with split {short_repr(split)}" if split else "")
        )
    return out
