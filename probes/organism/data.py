"""The organism's training data: seeded repeated random segments mixed with the shipped corpus.

A row of `context` tokens is, with probability `repeat_fraction`, `[BOS] + R + R + ...` (a
segment R of `min_segment .. context // 2` random non-special tokens repeated to the end of the
row: induction is the only way to predict past the first copy), else a window of the shipped
corpus (`probes/datasets/corpus.py`) encoded with the organism's tokenizer, texts joined by EOS.
Row `i` of step `s` is drawn from a generator seeded with `(seed, s)` alone, so a batch does
not depend on what ran before it (a run is reproducible and could resume at any step).

The in-context-learning set (`icl_rows`) is `[BOS] + R + R` with `|R| = (context - 1) // 2`,
drawn from its own seed: the ICL score (`heads.dynamics.icl_score`) is the mean loss on the
second copy minus that on the first.
"""

from __future__ import annotations

from typing import Any

import torch

from heads._util.validation import check_int, check_seed
from heads.errors import HeadsteerValueError
from probes.datasets.corpus import load_corpus

__all__ = ["ICL_SEED", "CorpusStream", "batch_rows", "icl_rows", "special_ids"]

ICL_SEED = 7_777
"""Seed of the held-out repeated sequences (never the training seed's draws)."""


def special_ids(tokenizer: Any) -> set[int]:
    """Ids random segments never use: the tokenizer's special tokens."""
    return {int(i) for i in tokenizer.all_special_ids}


def _candidates(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    bad = special_ids(tokenizer)
    return torch.tensor([i for i in range(vocab_size) if i not in bad], dtype=torch.long)


class CorpusStream:
    """The shipped corpus as one token stream (texts joined by EOS), windows drawn at random.

    Args:
        tokenizer: the organism's tokenizer (ids must be below its length).
    """

    def __init__(self, tokenizer: Any) -> None:
        ids: list[int] = []
        for text in load_corpus():
            ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        self.ids = torch.tensor(ids, dtype=torch.long)

    def window(self, n: int, g: torch.Generator) -> torch.Tensor:
        """`[n]` consecutive tokens starting at a random place (`g`)."""
        if n > len(self.ids):
            raise HeadsteerValueError(f"a window of {n} tokens exceeds the corpus ({len(self.ids)} tokens)")
        start = int(torch.randint(0, len(self.ids) - n + 1, (1,), generator=g))
        return self.ids[start : start + n]


def batch_rows(
    step: int,
    *,
    batch: int,
    context: int,
    tokenizer: Any,
    corpus: CorpusStream,
    seed: int,
    repeat_fraction: float = 0.5,
    min_segment: int = 4,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training batch of `step` (see the module docstring).

    Args:
        step: the step number (0-based); with `seed` it alone fixes the batch.
        batch, context: rows and tokens per row (`context` >= 2 * `min_segment` + 1).
        tokenizer: the organism's tokenizer (BOS starts each row).
        corpus: the encoded corpus.
        seed: the run's seed (0 .. 2**32 - 1).
        repeat_fraction: share of rows that are repeated random segments, in [0, 1].
        min_segment: shortest segment R.
        vocab_size: ids drawn below it (default: the tokenizer's length).

    Returns:
        `(ids [batch, context], repeated [batch] bool)`: the token ids, and which rows are
        repeated random segments (the others are corpus windows).

    Raises:
        HeadsteerValueError: a bad count, fraction or seed.
    """
    check_int("step", step, lo=0)
    batch = check_int("batch", batch, lo=1)
    min_segment = check_int("min_segment", min_segment, lo=1)
    context = check_int("context", context, lo=2 * min_segment + 1)
    seed = check_seed("seed", seed)
    if not 0.0 <= float(repeat_fraction) <= 1.0:
        raise HeadsteerValueError(f"repeat_fraction must be in [0, 1], got {repeat_fraction!r}")
    cand = _candidates(tokenizer, vocab_size or len(tokenizer))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rows, kinds = [], []
    for _ in range(batch):
        kinds.append(float(torch.rand((), generator=g)) < repeat_fraction)
        if kinds[-1]:
            n = int(torch.randint(min_segment, context // 2 + 1, (1,), generator=g))
            seg = cand[torch.randint(0, len(cand), (n,), generator=g)]
            body = seg.repeat((context - 1) // n + 1)[: context - 1]
        else:
            body = corpus.window(context - 1, g)
        rows.append(torch.cat([torch.tensor([tokenizer.bos_token_id]), body]))
    return torch.stack(rows), torch.tensor(kinds, dtype=torch.bool)


def icl_rows(
    tokenizer: Any, *, n: int, context: int, seed: int = ICL_SEED, vocab_size: int | None = None
) -> torch.Tensor:
    """`[n, 1 + 2 * m]` rows `[BOS] + R + R` with `m = (context - 1) // 2` random non-special
    tokens (distinct within R), for the in-context-learning score.

    Raises:
        HeadsteerValueError: `n` < 1, `context` < 3, a bad seed.
    """
    n = check_int("n", n, lo=1)
    context = check_int("context", context, lo=3)
    g = torch.Generator().manual_seed(check_seed("seed", seed))
    cand = _candidates(tokenizer, vocab_size or len(tokenizer))
    m = (context - 1) // 2
    rows = []
    for _ in range(n):
        seg = cand[torch.randperm(len(cand), generator=g)[:m]]
        rows.append(torch.cat([torch.tensor([tokenizer.bos_token_id]), seg, seg]))
    return torch.stack(rows)
