"""The token rows the head-role detectors read: random non-special tokens (`random_tokens`), the
induction task `[BOS] + R + R` (`repeated_tokens`), and the checks shared by the detectors (positive
sizes, seeds, the user's own sequences as padded rows).

Re-exported by `heads.scorers.roles.detectors`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from heads._util.validation import check_int, check_seed, is_int, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, encode_prompts
from heads.model.adapter import HeadModel

__all__ = ["MAX_SEQUENCES", "SequencesArg", "random_tokens", "repeated_tokens"]

MAX_SEQUENCES = 4096
"""Most generated rows a detector builds (`n_seqs` of `repeated_tokens`, `n_prompts` of `needle_prompts`)."""


def _positive(value: object, what: str, hi: int | None = None) -> int:
    return check_int(what, value, lo=1, hi=hi)


def _seed(seed: object) -> int:
    """Every detector takes the same seeds: an int in 0..2**32 - 1 (`check_seed`)."""
    return check_seed("seed", seed)


def _special_ids(model: HeadModel) -> set[int]:
    ids: set[int] = set()
    tok = model.tokenizer
    if tok is not None:
        ids |= {int(i) for i in tok.all_special_ids}
    cfg = model.model.config
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(cfg, name, None)
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, int):
                ids.add(x)
    return ids


def _bos_id(model: HeadModel) -> int | None:
    tok = model.tokenizer
    bos = getattr(tok, "bos_token_id", None) if tok is not None else None
    if bos is None:
        bos = getattr(model.model.config, "bos_token_id", None)
    return int(bos) if isinstance(bos, int) else None


def _pad_id(model: HeadModel) -> int:
    tok = model.tokenizer
    for v in (
        getattr(tok, "pad_token_id", None) if tok is not None else None,
        getattr(tok, "eos_token_id", None) if tok is not None else None,
        getattr(model.model.config, "pad_token_id", None),
        getattr(model.model.config, "eos_token_id", None),
    ):
        if isinstance(v, int):
            return v
    return 0


def _candidates(model: HeadModel) -> torch.Tensor:
    """Token ids random sequences are drawn from: the vocabulary without special tokens."""
    n = model.d_vocab
    tok = model.tokenizer
    if tok is not None:
        n = min(n, len(tok))
    keep = torch.ones(n, dtype=torch.bool)
    for i in _special_ids(model):
        if 0 <= i < n:
            keep[i] = False
    return torch.nonzero(keep).flatten()


def random_tokens(model: HeadModel, n: int, *, seed: int = 0) -> torch.Tensor:
    """`[n]` distinct non-special token ids drawn with `seed` (`torch.Generator`, CPU).

    Args:
        n: how many ids (1 .. the number of non-special tokens).
        seed: an int in 0..2**32 - 1 (default 0).

    Raises:
        HeadsteerValueError: `n` not a positive int or more than the non-special tokens; a bad seed.
    """
    n = _positive(n, "n")
    seed = _seed(seed)
    cand = _candidates(model)
    if n > len(cand):
        raise HeadsteerValueError(f"n={n} exceeds the {len(cand)} non-special tokens of the vocabulary")
    g = torch.Generator().manual_seed(seed)
    return cand[torch.randperm(len(cand), generator=g)[:n]]


def _pack(model: HeadModel, rows: list[list[int]]) -> EncodedPrompts:
    """Left-pad token rows into an `EncodedPrompts` (no spans)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), _pad_id(model), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[b, width - len(r) :] = 1
    n = len(rows)
    return EncodedPrompts(ids, mask, [[] for _ in range(n)], ["" for _ in range(n)], [[] for _ in range(n)])


def repeated_tokens(
    model: HeadModel, *, n_seqs: int = 8, length: tuple[int, int] = (25, 50), seed: int = 0
) -> EncodedPrompts:
    """`n_seqs` rows `[BOS] + R + R` (left-padded), R of `length[0]..length[1]` distinct random
    non-special tokens (a length per row, drawn with `seed`), as in Olsson et al. 2022 and
    TransformerLens' induction demos. BOS is left out when the model has none.

    Args:
        n_seqs: rows, 1..`MAX_SEQUENCES` (default 8).
        length: `(min, max)` length of R (ints, numpy ints too; default (25, 50)).
        seed: an int in 0..2**32 - 1 (default 0).

    Returns:
        `EncodedPrompts` `[n_seqs, T]`, T = 2 * (longest R) + 1 with BOS.

    Raises:
        HeadsteerValueError: `n_seqs` not in 1..`MAX_SEQUENCES`, a bad `length` range, R longer
            than the non-special vocabulary, rows longer than the model's context (all checked
            before any row is drawn), a bad seed.
    """
    n_seqs = _positive(n_seqs, "n_seqs", MAX_SEQUENCES)
    if (
        not isinstance(length, (tuple, list))
        or len(length) != 2
        or not all(is_int(x) for x in length)
        or not 1 <= length[0] <= length[1]
    ):
        raise HeadsteerValueError(
            f"length must be (min, max) ints with 1 <= min <= max, got {short_repr(length)}"
        )
    lo, hi = int(length[0]), int(length[1])
    seed = _seed(seed)
    cand = _candidates(model)
    if hi > len(cand):
        raise HeadsteerValueError(f"length {hi} exceeds the {len(cand)} non-special tokens")
    bos = _bos_id(model)
    model.check_length(2 * hi + (bos is not None))
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_seqs):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        r = cand[torch.randperm(len(cand), generator=g)[:n]].tolist()
        rows.append(([bos] if bos is not None else []) + r + r)
    model.check_length(max(len(r) for r in rows))
    return _pack(model, rows)


SequencesArg = EncodedPrompts | torch.Tensor | str | Sequence[str] | None


def _sequences(model: HeadModel, sequences: SequencesArg, seed: int) -> EncodedPrompts:
    """The batch to score: repeated random tokens (None), texts (plain, no chat template), a
    `[B, T]` id tensor (no padding), a list of id lists (left-padded here) or an `EncodedPrompts`."""
    if sequences is None:
        return repeated_tokens(model, seed=seed)
    if isinstance(sequences, Sequence) and not isinstance(sequences, str) and len(sequences) == 0:
        raise HeadsteerValueError("sequences is empty: give at least one text or token row")
    if isinstance(sequences, EncodedPrompts):
        ids = sequences.input_ids
        if sequences.batch == 0 or ids.numel() == 0 or not _int_dtype(ids):
            raise HeadsteerValueError("the EncodedPrompts holds no token ids (or not integer ones)")
        if ((ids < 0) | (ids >= model.d_vocab)).any():
            raise HeadsteerValueError("the EncodedPrompts holds ids outside the vocabulary")
        return sequences
    if isinstance(sequences, torch.Tensor):
        if sequences.ndim != 2 or not _int_dtype(sequences):
            raise HeadsteerValueError(
                "token sequences must be a [batch, pos] integer tensor, got shape "
                f"{tuple(sequences.shape)} {sequences.dtype}"
            )
        if sequences.numel() == 0 or ((sequences < 0) | (sequences >= model.d_vocab)).any():
            raise HeadsteerValueError("token sequences are empty or hold ids outside the vocabulary")
        return _pack(model, sequences.long().tolist())
    if (
        isinstance(sequences, Sequence)
        and not isinstance(sequences, str)
        and sequences
        and all(isinstance(r, (list, tuple, torch.Tensor)) for r in sequences)
    ):
        rows = []
        for r in sequences:
            if isinstance(r, torch.Tensor) and (r.ndim != 1 or not _int_dtype(r)):
                raise HeadsteerValueError(
                    f"a token row must be a 1-D integer tensor, got shape {tuple(r.shape)} {r.dtype}"
                )
            row = r.tolist() if isinstance(r, torch.Tensor) else list(r)
            bad = next((x for x in row if not is_int(x)), None)
            if bad is not None:
                raise HeadsteerValueError(f"token ids must be ints, got {short_repr(bad)}")
            rows.append([int(x) for x in row])
        if any(not r or min(r) < 0 or max(r) >= model.d_vocab for r in rows):
            raise HeadsteerValueError("token sequences are empty or hold ids outside the vocabulary")
        return _pack(model, rows)
    if isinstance(sequences, str) or (
        isinstance(sequences, Sequence) and sequences and all(isinstance(s, str) for s in sequences)
    ):
        if model.tokenizer is None:
            raise HeadsteerValueError("text sequences need a HeadModel with a tokenizer")
        return encode_prompts(model.tokenizer, sequences, chat=False, markup=False)
    if isinstance(sequences, Sequence) and any(isinstance(s, str) for s in sequences):
        i, odd = next((i, s) for i, s in enumerate(sequences) if not isinstance(s, str))
        raise HeadsteerTypeError(
            f"sequences mixes texts with a {type(odd).__name__} at index {i}: "
            "give only texts or only token rows"
        )
    raise HeadsteerTypeError(
        "sequences must be None, texts, a [batch, pos] token tensor or EncodedPrompts, "
        f"got {type(sequences).__name__}"
    )


def _int_dtype(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)
