"""Clean / corrupted pairs from needle-in-a-haystack tasks (`probes.datasets.needle`), for
activation patching, path patching, attribution and circuits on long prompts.

A pair is one task (`needle_task(tokenizer, length, depth=, seed=)`) and the same token sequence
with the needle's code replaced by another code of as many tokens (the corrupted prompt). The
metric's answer is the first token at which the two codes differ, its counterfactual the
corrupted code's token there: when the codes' tokens share a start (SmolLM2's tokenizer gives
" 7311" as a bare space and one token per digit, so every code starts with the same space token),
that shared start is appended to both prompts, so the next token is a digit and the logit
difference compares the two codes rather than two copies of a space. The prompts have exactly
`length` tokens, shared start included, and the needle's position is named (`"needle"`: the
first differing code token; `"end"`: the last position).

    >>> from heads import load_tokenizer
    >>> from probes.datasets.needle_pairs import needle_pairs
    >>> pairs = needle_pairs(load_tokenizer(), 2048, n=2)
    >>> pairs.n, pairs.width
    (2, 2048)
"""

from __future__ import annotations

import random

from heads._util.validation import check_int, check_number, check_seed, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.scorers.patching.pairs import PairBatch, pairs_from_tokens
from probes.datasets.needle import MAX_LENGTH, MIN_LENGTH, NeedleTask, build_task

__all__ = ["needle_pair_tasks", "needle_pairs"]

MAX_PAIRS = 1024
"""The most pairs one call builds (`n`)."""

MAX_TOKENS = 1 << 24
"""The most tokens one call builds, `n x length` (two prompts of each; 16,777,216)."""


def _code_ids(tokenizer: object, code: str) -> list[int]:
    return list(tokenizer(f" {code}", add_special_tokens=False)["input_ids"])  # type: ignore[operator]


def _shared(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def _other_code(tokenizer: object, task: NeedleTask, seed: int) -> tuple[list[int], int]:
    """`(ids, k)`: another four-digit code's tokens, as many as the task's code has, the first k of
    them shared with it (k < their count, so a token differs), drawn with `seed`."""
    mine = list(task.answer_ids)
    rng = random.Random(seed)
    for code in rng.sample(range(1000, 10000), 9000):
        if str(code)[0] == task.code[0]:
            continue  # the first digit differs: the first differing token is the code's start
        ids = _code_ids(tokenizer, str(code))
        k = _shared(mine, ids)
        if len(ids) == len(mine) and k < len(ids):
            return ids, k
    raise HeadsteerValueError(
        f"no other four-digit code tokenizes into {len(mine)} tokens as {task.code!r} does with this "
        "tokenizer"
    )


def needle_pairs(
    tokenizer: object,
    length: int,
    *,
    n: int = 1,
    depth: float = 0.5,
    seed: int = 0,
) -> PairBatch:
    """`n` clean / corrupted pairs of needle tasks of exactly `length` tokens (module docstring).

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        length: tokens per prompt, `MIN_LENGTH`..`MAX_LENGTH` of `probes.datasets.needle`.
        n: pairs, 1..1024 (default 1); pair i is the task of seed `seed + i`.
        depth: the needle's place in the haystack, 0 .. 1 (default 0.5).
        seed: an int in 0..2**32 - 1 (default 0).

    Returns:
        A `PairBatch` (`[n, length]` ids, no padding) whose answers are each pair's first
        differing code token and counterfactuals the corrupted code's token there; positions
        `"needle"` (that token in the haystack) and `"end"`.

    Raises:
        HeadsteerValueError: a bad length, n, depth or seed, or more than `MAX_TOKENS` tokens
            in all (before any tokenizing); no other code of the same token count.
        HeadsteerTypeError: a tokenizer that is not callable.
    """
    length, n, depth, seed = _checked(tokenizer, length, n, depth, seed, cap=True)
    clean, corrupted, answers, foils, needles = [], [], [], [], []
    for i in range(n):
        task, other, k = _pair_task(tokenizer, length, depth, (seed + i) % 2**32)
        code = list(task.answer_ids)
        lo, hi = task.needle
        prompt = list(task.input_ids) + code[:k]
        bad = prompt[:lo] + other + prompt[hi:]
        clean.append(prompt)
        corrupted.append(bad)
        answers.append(code[k])
        foils.append(other[k])
        needles.append(lo + k)
    return pairs_from_tokens(
        clean, corrupted, answers, foils, positions={"needle": needles, "end": [length - 1] * n}
    )


def _checked(
    tokenizer: object, length: int, n: int, depth: float, seed: int, *, cap: bool
) -> tuple[int, int, float, int]:
    """`(length, n, depth, seed)` checked (with `cap`, n x length against `MAX_TOKENS` too), and
    the tokenizer; before any tokenizing."""
    length = check_int("length", length, lo=MIN_LENGTH, hi=MAX_LENGTH)
    n = check_int("n", n, lo=1, hi=MAX_PAIRS)
    depth = check_number("depth", depth, lo=0, hi=1)
    seed = check_seed("seed", seed)
    if cap and n * length > MAX_TOKENS:
        raise HeadsteerValueError(
            f"n x length is {n} x {length} = {n * length:,} tokens; at most {MAX_TOKENS:,} per call"
        )
    if not callable(tokenizer) or not hasattr(tokenizer, "decode"):
        raise HeadsteerTypeError(f"tokenizer must be a Hugging Face tokenizer, got {short_repr(tokenizer)}")
    return length, n, depth, seed


def _pair_task(tokenizer: object, length: int, depth: float, seed: int) -> tuple[NeedleTask, list[int], int]:
    """`(task, other code's ids, k)` of one pair: the task, `k` tokens shorter when the codes share
    a start of k tokens (appended to the prompt), and the corrupted code's tokens."""
    task = build_task(tokenizer, length, depth, seed, 200)
    if isinstance(task, int):
        raise HeadsteerValueError(f"length {length} leaves no room for a haystack: give at least {task}")
    other, k = _other_code(tokenizer, task, seed)
    if k:  # the codes' shared start joins the prompt: the task is rebuilt k tokens shorter
        task = build_task(tokenizer, length - k, depth, seed, 200)
        if isinstance(task, int):
            raise HeadsteerValueError(
                f"length {length} leaves no room for a haystack once the codes' shared start "
                f"({k} token{'s' if k > 1 else ''}) joins the prompt: give at least {task + k}"
            )
    return task, other, k


def needle_pair_tasks(
    tokenizer: object, length: int, *, n: int = 1, depth: float = 0.5, seed: int = 0
) -> list[NeedleTask]:
    """The `NeedleTask` behind each pair of `needle_pairs` with the same arguments: pair i's clean
    prompt is task i's `input_ids` followed by the codes' shared start (SmolLM2: one space
    token), so its `question`, `passages` and `gold` are a QRHead item of the same document
    (`qrhead_scores(model, [{"question": t.question, "passages": t.passages, "gold": t.gold}
    for t in tasks])`). Task i has seed `seed + i` and `length - k` tokens.

    Raises:
        HeadsteerValueError: as `needle_pairs` (a bad length, n, depth or seed; no room).
        HeadsteerTypeError: a tokenizer that is not callable.
    """
    length, n, depth, seed = _checked(tokenizer, length, n, depth, seed, cap=False)
    return [_pair_task(tokenizer, length, depth, (seed + i) % 2**32)[0] for i in range(n)]
