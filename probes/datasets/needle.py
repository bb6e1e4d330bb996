"""Needle-in-a-haystack tasks of any length (1k-32k tokens and more) for retrieval-head and sink
studies (written for this project; deterministic for a seed, no download).

A task is a haystack of short everyday sentences (drawn from the fixed lists below with a seeded
`random.Random`), one *needle* sentence "The secret code of the {key} is {code}." placed at a
chosen depth, then the question and the start of the answer:

    <haystack ... needle ... haystack> Question: what is the secret code of the {key}?
    Answer: the secret code of the {key} is

so the next tokens are the code (teacher-force it with `answer_ids`). The token sequence is built
piece by piece from the tokenizer's own tokens, so `input_ids` has exactly `length` tokens and the
needle's and the answer's token ranges are exact. The same haystack cut into passages
(`passages`, the needle's passage at index `gold`) is a QRHead item
(`heads.scorers.retrieval.qrhead`).

With the embedded model's tokenizer (SmolLM2; `needle` and `gold` depend on the tokenizer,
`key` and `code` only on the seed):

    >>> from heads import load_tokenizer
    >>> from probes.datasets.needle import needle_task
    >>> task = needle_task(load_tokenizer(), 8192, depth=0.5, seed=0)
    >>> len(task.input_ids), task.key, task.code
    (8192, 'river mill', '7311')
    >>> task.needle  # (start, end) of the code's tokens in input_ids
    (4011, 4016)
    >>> task.question
    'What is the secret code of the river mill?'
    >>> task.gold, len(task.passages)  # the needle's passage among the QRHead passages
    (19, 40)
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from heads._util.validation import check_int, check_number, check_seed, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError

__all__ = ["MAX_LENGTH", "MIN_LENGTH", "NeedleTask", "build_task", "needle_task", "needle_tasks"]

MIN_LENGTH = 64
"""Shortest task (tokens): room for a haystack sentence, the needle and the question."""
MAX_LENGTH = 1 << 20
"""Longest task (tokens); a model's own positions bound it further."""

_PEOPLE = [
    *("Anna", "Ben", "Clara", "David", "Elena", "Farid"),
    *("Grace", "Hugo", "Iris", "Jonas", "Keiko", "Luis"),
]
_PLACES = [
    "the market",
    "the library",
    "the station",
    "the beach",
    "the museum",
    "the harbor",
    "the garden",
    "the bakery",
    "the school",
    "the bridge",
]
_THINGS = ["a red umbrella", "a small lamp", "a bicycle", "a blue kettle", "an old map", "a wooden box"]
_WEATHER = ["quiet", "busy", "cold", "sunny", "windy", "calm", "crowded", "rainy"]
_TIMES = ["that morning", "in the afternoon", "after lunch", "before dinner", "on Sunday", "late at night"]
_KEYS = ["blue door", "north tower", "garden shed", "old ship", "silver box", "west gate", "river mill"]
_TEMPLATES = [
    "{p} walked to {l} {t}.",
    "{p} met {q} near {l}, which was {w} {t}.",
    "{p} left {x} at {l}.",
    "{q} gave {p} {x} {t}.",
    "The weather at {l} was {w} {t}.",
    "{p} and {q} talked about {l} for a while.",
    "Later, {p} went back to {l} to get {x}.",
]


@dataclass(frozen=True)
class NeedleTask:
    """One needle-in-a-haystack task.

    Attributes:
        input_ids: exactly `length` token ids: the haystack with the needle, the question and
            the answer prefix (BOS first when the tokenizer has one).
        needle: `(start, end)` token range of the code inside the needle sentence.
        key: the needle's key, one of seven places ("river mill" for seed 0).
        code: the needle's code, four digits as text ("7311" for seed 0).
        answer_ids: the code's tokens as they follow the answer prefix (teacher forcing).
        depth: where the needle sits, as a share of the haystack before it (0 = first).
        passages: the haystack as QRHead passages (about `passage_tokens` each), the needle's
            sentence in passage `gold`; `question` asks for the code.
        seed: the seed it was drawn with.
    """

    input_ids: list[int] = field(repr=False)  # thousands of ids: left out of the repr
    needle: tuple[int, int]
    key: str
    code: str
    answer_ids: list[int]
    depth: float
    question: str
    passages: list[str] = field(repr=False)
    gold: int
    seed: int

    @property
    def length(self) -> int:
        return len(self.input_ids)

    def text(self, tokenizer: object) -> str:
        """The task decoded to text (special tokens dropped): a method, as it needs the tokenizer
        (`task.text(model.tokenizer)`).

        Tokenizing this text again gives `input_ids` without the leading BOS (`length - 1` ids
        with SmolLM2's tokenizer, which adds no BOS itself), so positions such as `needle` shift
        by one; to see the very same tokens in another tool, pass `input_ids` rather than the text.
        """
        return str(tokenizer.decode(self.input_ids, skip_special_tokens=True))  # type: ignore[attr-defined]


def _sentence(rng: random.Random) -> str:
    p, q = rng.sample(_PEOPLE, 2)
    return rng.choice(_TEMPLATES).format(
        p=p, q=q, l=rng.choice(_PLACES), x=rng.choice(_THINGS), w=rng.choice(_WEATHER), t=rng.choice(_TIMES)
    )


def _encode(tokenizer: object, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]


def needle_task(
    tokenizer: object,
    length: int,
    *,
    depth: float = 0.5,
    seed: int = 0,
    passage_tokens: int = 200,
) -> NeedleTask:
    """A needle-in-a-haystack task of exactly `length` tokens (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer (the model's).
        length: tokens, `MIN_LENGTH`..`MAX_LENGTH` (e.g. 1024 ... 32768).
        depth: the needle's place in the haystack, 0 (start) .. 1 (end); default 0.5.
        seed: an int in 0..2**32 - 1 (default 0): the same seed gives the same task.
        passage_tokens: about how many tokens each QRHead passage holds (default 200).

    Raises:
        HeadsteerValueError: a length, depth, seed or passage size out of range.
        HeadsteerTypeError: a tokenizer that is not callable.
    """
    length = check_int("length", length, lo=MIN_LENGTH, hi=MAX_LENGTH)
    depth = check_number("depth", depth, lo=0, hi=1)
    seed = check_seed("seed", seed)
    passage_tokens = check_int("passage_tokens", passage_tokens, lo=16)
    if not callable(tokenizer) or not hasattr(tokenizer, "decode"):
        raise HeadsteerTypeError(f"tokenizer must be a Hugging Face tokenizer, got {short_repr(tokenizer)}")
    task = build_task(tokenizer, length, depth, seed, passage_tokens)
    if isinstance(task, int):
        raise HeadsteerValueError(f"length {length} leaves no room for a haystack: give at least {task}")
    return task


def build_task(
    tokenizer: object, length: int, depth: float, seed: int, passage_tokens: int
) -> NeedleTask | int:
    """`needle_task` on checked arguments (any `length`), or the least length that leaves room for
    a haystack when `length` does not (for `needle_pairs`, which builds a task a few tokens
    shorter than the length it was given)."""
    rng = random.Random(seed)
    key = rng.choice(_KEYS)
    code = str(rng.randrange(1000, 10000))
    bos = getattr(tokenizer, "bos_token_id", None)
    head = [int(bos)] if isinstance(bos, int) else []
    needle_pre = _encode(tokenizer, f" The secret code of the {key} is")
    code_ids = _encode(tokenizer, f" {code}")
    needle_post = _encode(tokenizer, ".")
    question = f"What is the secret code of the {key}?"
    tail = _encode(tokenizer, f"\nQuestion: {question.lower()}\nAnswer: the secret code of the {key} is")
    room = length - len(head) - len(needle_pre) - len(code_ids) - len(needle_post) - len(tail)
    if room < 8:
        return length - room + 8
    # haystack sentences until `room` tokens, the last one cut at a token
    sentences: list[tuple[str, list[int]]] = []
    used = 0
    while used < room:
        s = _sentence(rng)
        ids = _encode(tokenizer, " " + s)[: room - used]
        sentences.append((s, ids))
        used += len(ids)
    cut = round(depth * len(sentences))
    before = [t for _, ids in sentences[:cut] for t in ids]
    after = [t for _, ids in sentences[cut:] for t in ids]
    start = len(head) + len(before) + len(needle_pre)
    ids = head + before + needle_pre + code_ids + needle_post + after + tail
    assert len(ids) == length
    passages, gold = _passages(sentences, cut, f"The secret code of the {key} is {code}.", passage_tokens)
    return NeedleTask(
        input_ids=ids,
        needle=(start, start + len(code_ids)),
        key=key,
        code=code,
        answer_ids=code_ids,
        depth=depth,
        question=question,
        passages=passages,
        gold=gold,
        seed=seed,
    )


def _passages(
    sentences: Sequence[tuple[str, list[int]]], cut: int, needle: str, size: int
) -> tuple[list[str], int]:
    """The haystack's whole sentences grouped into passages of about `size` tokens, the needle
    sentence appended to the passage where it falls; `(passages, gold index)`."""
    out: list[str] = []
    gold = -1
    cur: list[str] = []
    n = 0
    for i, (s, ids) in enumerate(sentences):
        if i == cut:
            cur.append(needle)
            gold = len(out)
        cur.append(s)
        n += len(ids)
        if n >= size:
            out.append(" ".join(cur))
            cur, n = [], 0
    if cut >= len(sentences):
        cur.append(needle)
        gold = len(out)
    if cur:
        out.append(" ".join(cur))
    if len(out) < 2:  # QRHead needs two passages at least
        half = max(1, len(out[0]) // 2)
        text = out[0]
        split = text.rfind(". ", 0, half) + 1 or half
        out = [text[:split].strip(), text[split:].strip()]
        gold = 0 if needle in out[0] else 1
    return out, gold


def needle_tasks(
    tokenizer: object,
    lengths: Sequence[int] = (1024, 2048, 4096, 8192),
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    *,
    seed: int = 0,
) -> list[NeedleTask]:
    """One task per (length, depth), in that order, each with its own seed (`seed` + index).

    Raises:
        HeadsteerValueError: empty lengths or depths, or a bad value (see `needle_task`).
    """
    if not lengths or not depths:
        raise HeadsteerValueError("lengths and depths must be non-empty lists")
    seed = check_seed("seed", seed)
    out = []
    for i, (n, d) in enumerate((n, d) for n in lengths for d in depths):
        out.append(needle_task(tokenizer, n, depth=d, seed=(seed + i) % 2**32))
    return out
