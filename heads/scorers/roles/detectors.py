"""Head-role detectors: previous-token, duplicate-token, induction, self, entropy (attention on
sequences), copying and successor (the OV circuit), retrieval (needle-in-a-haystack copy rate).

Every detector returns `HeadScores` `[L, H]` and is deterministic for a `seed`. The pattern
detectors share one forward per batch (`pattern_scores`): a `Recorder` on every layer reduces
the pattern to per-(row, head) sums inside the forward, so no `[B, H, T, T]` tensor is kept.

Pattern scores (TransformerLens `head_detector`'s "mul" measure, Olsson et al. 2022): for a
detection mask D (which query row i should look at which key j) and pattern A of one head on
one sequence, `score = sum_ij A_ij D_ij / sum_ij A_ij` over the rows counted; the score of a
head is the mean over sequences. Rows counted (`rows=`):

* `"target"` (default): only the rows that have a target key (D_i. not empty), so a perfect
  head scores 1 (an induction head on [BOS] + R + R scores ~1, not ~0.5);
* `"all"`: every real row, TransformerLens' convention (`detect_head`, error_measure "mul").

The masks (over real tokens only; padding never counts):

* previous-token: D_ij = [j = i - 1];
* duplicate-token: D_ij = [tok_j = tok_i, j < i];
* induction: D_ij = [tok_{j-1} = tok_i, j - 1 < i] (the token after an earlier occurrence);
* self: D_ij = [j = i].

Entropy is the mean over rows with >= 2 visible keys of `H(A_i.) / log(n_i)` (n_i the real
causal keys of row i; 0 = one key, 1 = uniform).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from heads._util.validation import check_bool, check_int, check_seed, is_int, short_repr
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Recorder
from heads.engine.forward import forward
from heads.engine.options import SweepOptions
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, encode_prompts
from heads.model.adapter import HeadModel
from heads.results.roles import RoleScores
from heads.results.scores import HeadScores
from heads.results.stability import check_stability
from heads.scorers.maps.static import RelationPairs, k_for, maps_scores, source_representations
from heads.scorers.stability import attach, check_samples

__all__ = [
    "MAX_COPYING_TOKENS",
    "MAX_FILLER",
    "MAX_SEQUENCES",
    "ORDINAL_SEQUENCES",
    "PATTERN_DETECTORS",
    "copying_scores",
    "detect_roles",
    "duplicate_token_scores",
    "entropy_scores",
    "induction_scores",
    "needle_prompts",
    "pattern_scores",
    "previous_token_scores",
    "random_tokens",
    "repeated_tokens",
    "retrieval_scores",
    "self_scores",
    "successor_scores",
]

PATTERN_DETECTORS = ("previous_token", "duplicate_token", "induction", "self", "entropy")
"""The detectors `pattern_scores` computes from one forward."""

Rows = Literal["target", "all"]

ORDINAL_SEQUENCES: dict[str, list[str]] = {
    "digits": [str(i) for i in range(10)],
    "number_words": [
        " one",
        " two",
        " three",
        " four",
        " five",
        " six",
        " seven",
        " eight",
        " nine",
        " ten",
        " eleven",
        " twelve",
    ],
    "ordinals": [
        " first",
        " second",
        " third",
        " fourth",
        " fifth",
        " sixth",
        " seventh",
        " eighth",
        " ninth",
        " tenth",
    ],
    "days": [" Monday", " Tuesday", " Wednesday", " Thursday", " Friday", " Saturday", " Sunday"],
    "months": [
        " January",
        " February",
        " March",
        " April",
        " May",
        " June",
        " July",
        " August",
        " September",
        " October",
        " November",
        " December",
    ],
    "letters": [" " + chr(c) for c in range(ord("a"), ord("z") + 1)],
    "capitals": [" " + chr(c) for c in range(ord("A"), ord("Z") + 1)],
    "roman": [" I", " II", " III", " IV", " V", " VI", " VII", " VIII", " IX", " X"],
}
"""Ordinal sequences for the successor detector (Gould et al. 2024's task families, written
here): each item's successor is the next item of its list."""


MAX_SEQUENCES = 4096
"""Most generated rows a detector builds (`n_seqs` of `repeated_tokens`, `n_prompts` of `needle_prompts`)."""

MAX_COPYING_TOKENS = 8192
"""Most source tokens `copying_scores` reads (`n_tokens`)."""

MAX_FILLER = 8192
"""Most filler sentences of a needle prompt (`n_filler`; about 10 tokens each, so haystacks of 32k
tokens and more); the model's context bounds it further."""


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


def _block_masks(
    ids: torch.Tensor, real: torch.Tensor, a: int, b: int, k_len: int
) -> dict[str, torch.Tensor]:
    """Detection masks `[B, b - a, k_len]` of query rows `a..b-1` (key columns `0..k_len-1`) over real
    tokens, built for one query block at a time so no `[B, T, T]` mask is ever kept."""
    dev = ids.device
    qpos = torch.arange(a, b, device=dev)[:, None]  # [q, 1]
    kpos = torch.arange(k_len, device=dev)[None, :]  # [1, k]
    rq, rk = real[:, a:b], real[:, :k_len]
    pair = rq[:, :, None] & rk[:, None, :]
    causal = (kpos <= qpos)[None]
    strict = (kpos < qpos)[None]
    same = ids[:, a:b, None] == ids[:, None, :k_len]  # tok_i == tok_j
    dup = same & strict & pair
    # induction, key j: tok_{j-1} == tok_i with j - 1 < i, key j real
    ind = torch.zeros_like(dup)
    if k_len > 1:
        prev_same = ids[:, a:b, None] == ids[:, None, : k_len - 1]
        ok = prev_same & (kpos[:, :-1] < qpos)[None] & rq[:, :, None] & rk[:, None, :-1] & rk[:, None, 1:]
        ind[:, :, 1:] = ok
    ind &= causal
    return {
        "previous_token": (kpos == qpos - 1)[None] & pair,
        "duplicate_token": dup,
        "induction": ind,
        "self": (kpos == qpos)[None] & pair,
        "visible": causal & pair,
    }


def _check_detectors(detectors: Sequence[str] | str) -> tuple[str, ...]:
    if isinstance(detectors, str):
        detectors = (detectors,)
    if not isinstance(detectors, (Sequence, set, frozenset)):
        raise HeadsteerTypeError(
            f"detectors must be names of {PATTERN_DETECTORS}, got {short_repr(detectors)}"
        )
    out = tuple(detectors)
    bad = [d for d in out if d not in PATTERN_DETECTORS]
    if bad or not out:
        raise HeadsteerValueError(
            f"unknown detector {short_repr(bad or out)}: use some of {PATTERN_DETECTORS}"
        )
    return out


@torch.no_grad()
def pattern_scores(
    model: HeadModel,
    sequences: SequencesArg = None,
    *,
    detectors: Sequence[str] | str = PATTERN_DETECTORS,
    rows: Rows = "target",
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
    batch_size: int = 8,
    seed: int = 0,
    stability: int = 0,
) -> dict[str, HeadScores]:
    """Pattern-based role scores of every head, all from the same forward passes.

    Args:
        model: the model.
        sequences: None (default: 8 rows of [BOS] + R + R, `repeated_tokens(seed=seed)`), texts
            (encoded plainly, no chat template), a `[B, T]` integer token tensor, a list of
            token-id lists (ints or numpy / torch integers; left-padded here), or `EncodedPrompts`.
        detectors: which of `PATTERN_DETECTORS` to return (a name or a list of names; default all).
        rows: `"target"` (rows with a target key) or `"all"` (every real row, TransformerLens'
            normalisation); see the module docstring. Not used by `"entropy"`.
        exclude_bos: drop the first real token's column from numerator and denominator
            (TransformerLens' `exclude_bos`).
        exclude_current_token: drop the diagonal likewise (`exclude_current_token`).
        batch_size: sequences per forward (a positive int, default 8).
        seed: the seed of the default sequences (an int in 0..2**32 - 1, default 0).
        stability: bootstrap resamples of the sequences (default 0: none; e.g. 100) for each
            ranking's stability, `scores.stability` (from the per-sequence scores, no extra forward).

    Returns:
        `{detector: HeadScores [L, H]}` in [0, 1] (NaN for a head with no counted row), method
        `"role_<detector>"`.

    Raises:
        HeadsteerValueError: unknown detector or `rows`; bad sequences (non-integer, bool or
            float ids, ids outside the vocabulary, empty rows, longer than the model's context);
            bad `batch_size` or `seed`. All checked before the first forward.
        HeadsteerTypeError: a flag that is not a bool; `sequences` or `detectors` of a wrong type.
    """
    names = _check_detectors(detectors)
    if not isinstance(rows, str) or rows not in ("target", "all"):
        raise HeadsteerValueError(f"rows must be 'target' or 'all', got {short_repr(rows)}")
    check_bool("exclude_bos", exclude_bos)
    check_bool("exclude_current_token", exclude_current_token)
    batch_size = _positive(batch_size, "batch_size")
    seed = _seed(seed)
    stability = check_stability(stability)
    enc = _sequences(model, sequences, seed)
    model.check_length(enc.length)
    check_samples(enc.batch, stability, "sequences")
    dev = model.device
    pattern_names = [n for n in names if n != "entropy"]
    L, H = model.n_layers, model.n_heads
    total = {n: torch.zeros(L, H, dtype=torch.float64) for n in names}
    count = {n: torch.zeros(L, H, dtype=torch.float64) for n in names}
    per_seq = {n: torch.full((enc.batch, L, H), math.nan) for n in names} if stability else {}
    for start in range(0, enc.batch, batch_size):
        ids = enc.input_ids[start : start + batch_size]
        real = enc.attention_mask[start : start + batch_size].bool()
        sub = EncodedPrompts(
            ids,
            enc.attention_mask[start : start + batch_size],
            [[]] * len(ids),
            [""] * len(ids),
            [[]] * len(ids),
        )
        ids_dev, real_dev = ids.to(dev), real.to(dev)
        first = real_dev.float().argmax(-1)

        def reduce(
            probs: torch.Tensor, call: AttentionCall, ids_dev=ids_dev, real_dev=real_dev, first=first
        ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
            a, b = call.q_offset, call.q_offset + call.q_len
            p = probs.float()  # [B, H, q, k]
            masks = _block_masks(ids_dev, real_dev, a, b, call.k_len)
            kp = masks["visible"].clone()  # [B, q, k]: the entries counted in the denominator
            if exclude_bos:
                kp &= torch.arange(call.k_len, device=kp.device)[None, None, :] != first[:, None, None]
            if exclude_current_token:
                cols = torch.arange(call.k_len, device=kp.device)
                kp &= ~(cols[None, :] == torch.arange(a, b, device=kp.device)[:, None])[None]
            pk = p * kp[:, None]
            row_mass = pk.sum(-1)  # [B, H, q]
            out = {}
            for n in pattern_names:
                d = masks[n] & kp
                num = (pk * d[:, None]).sum(-1)  # [B, H, q]
                counted = d.any(-1) if rows == "target" else masks["visible"].any(-1)  # [B, q]
                out[n] = ((num * counted[:, None]).sum(-1), (row_mass * counted[:, None]).sum(-1))
            if "entropy" in names:
                vis = masks["visible"]
                n_vis = vis.sum(-1)  # [B, q]
                ent = -(p * torch.log(p.clamp(min=1e-30))).sum(-1)  # [B, H, q]
                ok = n_vis >= 2
                norm = torch.log(n_vis.clamp(min=2).float())
                out["entropy"] = (
                    (ent / norm[:, None] * ok[:, None]).sum(-1),
                    ok.sum(-1)[:, None].float().expand_as(ent[..., 0]),
                )
            return out

        recs = [Recorder(layer=la, fn=reduce) for la in range(L)]
        with editing(model, recs):
            forward(model, sub, logits_to_keep=1)  # no full-vocabulary logits at every position
        for la, rec in enumerate(recs):
            for n in names:
                num = sum(r[n][0] for r in rec.records).double().cpu()  # [B, H]
                den = sum(r[n][1] for r in rec.records).double().cpu()
                has = den > 0
                per = torch.where(has, num / den.clamp(min=1e-30), 0.0)
                total[n][la] += per.sum(0)
                count[n][la] += has.double().sum(0)
                if stability:
                    per_seq[n][start : start + len(ids), la] = torch.where(has, per, math.nan).float()
    params = {
        "rows": rows,
        "exclude_bos": exclude_bos,
        "exclude_current_token": exclude_current_token,
        "n_sequences": enc.batch,
        "sequences": "repeated_random" if sequences is None else "given",
    }
    out = {}
    for n in names:
        s = torch.where(count[n] > 0, total[n] / count[n].clamp(min=1), math.nan).float()
        p = dict(params)
        if n == "entropy":
            p.pop("rows")
        out[n] = HeadScores(
            s,
            f"role_{n}",
            p,
            model=model.name,
            n_kv_heads=model.n_kv_heads,
            seed=seed if sequences is None else None,
        )
        if stability:
            attach(out[n], per_seq[n], stability)
    return out


def _one(detector: str):
    def scorer(model: HeadModel, sequences: SequencesArg = None, **kwargs) -> HeadScores:
        return pattern_scores(model, sequences, detectors=(detector,), **kwargs)[detector]

    scorer.__name__ = f"{detector}_scores"
    scorer.__doc__ = (
        f"The `{detector}` score of every head (`pattern_scores(..., detectors=('{detector}',))`; "
        "same arguments and errors). Returns `HeadScores [L, H]` in [0, 1]."
    )
    return scorer


previous_token_scores = _one("previous_token")
duplicate_token_scores = _one("duplicate_token")
induction_scores = _one("induction")
self_scores = _one("self")
entropy_scores = _one("entropy")


@torch.no_grad()
def copying_scores(
    model: HeadModel,
    *,
    n_tokens: int = 512,
    k: int | None = None,
    apply_first_mlp: bool = True,
    seed: int = 0,
) -> HeadScores:
    """OV copying score: the share of random tokens t whose own id is in the top-`k` of the head's
    OV map `M[t] = ẽ_t W_V W_O W_U` over the whole vocabulary (MAPS' copying relation, Elhelo &
    Geva 2025, on `n_tokens` random non-special tokens drawn with `seed`).

    Args:
        n_tokens: source tokens, 1..`MAX_COPYING_TOKENS` (default 512); fewer when the
            vocabulary has fewer non-special tokens (then all of them).
        k: top-k, 1..d_vocab (default MAPS' copy rule: 1, or 3 for vocabularies >= 100K).
        apply_first_mlp: ẽ = MLP_0(norm(E)) for heads of layers >= 1 (MAPS; False for
            attention-only models, whose first MLP is absent or zero). Default True.
        seed: an int in 0..2**32 - 1 (default 0).

    Returns:
        HeadScores `[L, H]` in [0, 1], method `"role_copying"`.

    Raises:
        HeadsteerValueError: `n_tokens`, `k` or `seed` out of range (checked before any work).
        HeadsteerTypeError: `apply_first_mlp` not a bool.
    """
    n_tokens = _positive(n_tokens, "n_tokens", MAX_COPYING_TOKENS)
    k = k_for("copy", model.d_vocab) if k is None else _positive(k, "k", model.d_vocab)
    check_bool("apply_first_mlp", apply_first_mlp)
    seed = _seed(seed)
    ids = random_tokens(model, min(n_tokens, len(_candidates(model))), seed=seed).tolist()
    rel = RelationPairs("copying", [(t, t) for t in ids], k)
    s = maps_scores(
        model, [rel], apply_first_mlp=apply_first_mlp, options=SweepOptions(progress=False)
    ).relation["copying"]
    return HeadScores(
        s.scores,
        "role_copying",
        {"n_tokens": len(ids), "k": k, "apply_first_mlp": apply_first_mlp},
        model=model.name,
        n_kv_heads=model.n_kv_heads,
        seed=seed,
    )


def _ordinal_ids(model: HeadModel, sequences: Mapping[str, Sequence[str]]) -> dict[str, list[int]]:
    """Each sequence's items as single token ids (items that are not one token end the run)."""
    tok = model.tokenizer
    if tok is None:
        raise HeadsteerValueError("successor_scores needs a tokenizer (or pass token-id sequences)")
    out = {}
    for name, items in sequences.items():
        ids = []
        for s in items:
            enc = tok(s, add_special_tokens=False)["input_ids"]
            if len(enc) != 1:
                break  # the successor chain needs every step to be one token
            ids.append(int(enc[0]))
        if len(ids) >= 3:
            out[name] = ids
    return out


@torch.no_grad()
def successor_scores(
    model: HeadModel,
    sequences: Mapping[str, Sequence[str] | Sequence[int]] | None = None,
    *,
    apply_first_mlp: bool = True,
) -> HeadScores:
    """Succession score of every head (Gould et al., ICLR 2024, arXiv:2312.09230, §2).

    For every item t of an ordinal sequence (but its last), the head's OV map
    `ẽ_t W_V W_O W_U` is read on the tokens of that same sequence only; the item scores 1
    when its successor is the top-1 among them. The head's score is the mean over all items
    of all sequences (top-1 of the restricted candidates, as in the paper, not MAPS' top-k
    over the whole vocabulary).

    Args:
        sequences: `{name: [items]}`, each a list (or tuple, or 1-D integer tensor) of strings
            (each must be one token; a sequence is cut at the first item that is not; needs a
            tokenizer) or of token ids (ints, numpy / torch integers); sequences left with fewer
            than 3 items are skipped. A bare string as a sequence is refused (it is not split
            into letters). Default `ORDINAL_SEQUENCES`.
        apply_first_mlp: ẽ = MLP_0(norm(E)) for heads of layers >= 1 (Gould et al. use the
            first MLP's output, as MAPS does). Default True.

    Returns:
        HeadScores `[L, H]` in [0, 1], method `"role_successor"`.

    Raises:
        HeadsteerValueError: no sequence of >= 3 single-token items, ids outside the vocabulary,
            a sequence mixing strings and ids, string items without a tokenizer.
        HeadsteerTypeError: `sequences` not a mapping, a sequence that is a string or not a list,
            `apply_first_mlp` not a bool.
    """
    check_bool("apply_first_mlp", apply_first_mlp)
    seqs = ORDINAL_SEQUENCES if sequences is None else sequences
    if not isinstance(seqs, Mapping):
        raise HeadsteerTypeError(f"sequences must be a {{name: [items]}} mapping, got {type(seqs).__name__}")
    id_seqs: dict[str, list[int]] = {}
    str_seqs: dict[str, list[str]] = {}
    for k, v in seqs.items():
        if not isinstance(k, str):
            raise HeadsteerTypeError(f"sequence names must be strings, got {short_repr(k)}")
        if isinstance(v, torch.Tensor):
            if v.ndim != 1 or not _int_dtype(v):
                raise HeadsteerValueError(
                    f"sequence {short_repr(k)} must be a 1-D integer tensor, got {v.dtype}"
                )
            v = v.tolist()
        if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
            raise HeadsteerTypeError(
                f"sequence {short_repr(k)} must be a list of items (strings or token ids), got "
                f"{short_repr(v)}"
            )
        if all(is_int(x) for x in v):
            if any(not 0 <= int(x) < model.d_vocab for x in v):
                raise HeadsteerValueError(f"sequence {short_repr(k)} holds ids outside the vocabulary")
            if len(v) >= 3:
                id_seqs[k] = [int(x) for x in v]
        elif all(isinstance(x, str) for x in v):
            str_seqs[k] = [str(x) for x in v]
        else:
            odd = [x for x in v if not (is_int(x) or isinstance(x, str))]
            what = repr(odd[0]) if odd else "strings and ids mixed"
            raise HeadsteerValueError(
                f"sequence {short_repr(k)} must hold only strings or only token ids, got {what}"
            )
    if str_seqs:
        id_seqs.update(_ordinal_ids(model, str_seqs))
        id_seqs = {k: id_seqs[k] for k in seqs if k in id_seqs}  # the caller's order
    if not id_seqs:
        raise HeadsteerValueError("no ordinal sequence of >= 3 single-token items to score")
    U = model.W_U.float()
    L, H = model.n_layers, model.n_heads
    hits = torch.zeros(L, H, dtype=torch.float64)
    n_items = sum(len(v) - 1 for v in id_seqs.values())
    for layer in range(L):
        w = model.layer_weights(layer)
        wv, wo = w["W_V"].float(), w["W_O"].float()
        for ids in id_seqs.values():
            t = torch.tensor(ids, device=U.device)
            x = source_representations(model, t, layer, apply_first_mlp=apply_first_mlp)  # [n, D]
            u = U[:, t]  # [D, n]
            for h in range(H):
                logits = (x @ wv[model.kv_head(h)] @ wo[h]) @ u  # [n, n]: source row, candidate col
                best = logits[:-1].argmax(-1)  # ties: the lowest index (the earliest item)
                hits[layer, h] += (best == torch.arange(1, len(ids), device=U.device)).sum().item()
    return HeadScores(
        (hits / n_items).float(),
        "role_successor",
        {"sequences": {k: len(v) for k, v in id_seqs.items()}, "apply_first_mlp": apply_first_mlp},
        model=model.name,
        n_kv_heads=model.n_kv_heads,
    )


_FILLER = (
    "The grass is green and the sky is blue.",
    "A small boat drifted slowly along the quiet river.",
    "Farmers in the valley planted wheat in the spring.",
    "The old library kept maps of every town in the region.",
    "Children played in the park until the sun went down.",
    "The baker opened his shop early every morning.",
    "Rain fell on the roofs of the village all night.",
    "A train crossed the bridge on its way to the coast.",
    "The museum showed paintings from many different centuries.",
    "Birds built their nests in the tall trees by the road.",
)
_KEYS = (
    "blue lantern",
    "silver key",
    "hidden garden",
    "quiet harbor",
    "golden clock",
    "paper crane",
    "red door",
    "stone bridge",
)
_WORDS = (
    "apple",
    "river",
    "mountain",
    "violin",
    "tiger",
    "copper",
    "window",
    "orange",
    "planet",
    "forest",
    "candle",
    "marble",
    "falcon",
    "ocean",
    "pepper",
    "ladder",
)


def needle_prompts(
    model: HeadModel, *, n_prompts: int = 8, n_filler: int = 12, needle_words: int = 4, seed: int = 0
) -> tuple[EncodedPrompts, list[tuple[int, int]], list[tuple[int, int]]]:
    """Needle-in-a-haystack rows for `retrieval_scores` (Wu et al. 2024, written here).

    Each row: `n_filler` filler sentences with a needle sentence "The secret words of the
    {key} are {w1 ... wn}." inserted at a random depth, then "Question: what are the secret
    words of the {key}? Answer: the secret words of the {key} are {w1 ... wn}" (the answer
    teacher-forced). A model without a tokenizer gets token rows instead: random haystack,
    needle = key + value tokens, and the key + value repeated at the end.

    Args:
        n_prompts: rows, 1..`MAX_SEQUENCES` (default 8).
        n_filler: filler sentences a row (1..`MAX_FILLER`, default 12; without a tokenizer, 4
            random tokens each).
        needle_words: words of the needle's value (default 4; at most 16 with a tokenizer, the
            shipped word list; without one, the non-special tokens less 3).
        seed: an int in 0..2**32 - 1 (default 0).

    Returns:
        `(batch, needle token ranges, answer token ranges)` in padded coordinates, half-open.

    Raises:
        HeadsteerValueError: an argument out of range, or rows that cannot fit the model's
            context (checked from a lower bound of the row length before any row is built).
    """
    n_prompts = _positive(n_prompts, "n_prompts", MAX_SEQUENCES)
    n_filler = _positive(n_filler, "n_filler", MAX_FILLER)
    tok = model.tokenizer
    n_cand = len(_candidates(model)) if tok is None else len(_WORDS) + 3
    needle_words = _positive(needle_words, "needle_words", n_cand - 3)
    seed = _seed(seed)
    bos = _bos_id(model)
    limit = model.max_positions
    if limit is not None:
        if tok is None:  # exact: bos + haystack + key + value + key + value
            least = (bos is not None) + 4 * n_filler + 4 + 2 * needle_words
        else:  # every filler sentence is at least its shortest tokenisation
            least = n_filler * min(len(tok(f, add_special_tokens=False)["input_ids"]) for f in _FILLER)
        if least > limit:
            raise HeadsteerValueError(
                f"n_filler={n_filler}, needle_words={needle_words} make needle prompts of at least "
                f"{least} tokens, over the model's limit of {limit} positions"
            )
    g = torch.Generator().manual_seed(seed)
    rows: list[list[int]] = []
    needles, answers = [], []
    for _ in range(n_prompts):
        if tok is not None:
            fill = [_FILLER[int(i)] for i in torch.randint(len(_FILLER), (n_filler,), generator=g)]
            key = _KEYS[int(torch.randint(len(_KEYS), (1,), generator=g))]
            words = [_WORDS[int(i)] for i in torch.randperm(len(_WORDS), generator=g)[:needle_words]]
            value = " " + " ".join(words)
            depth = int(torch.randint(n_filler + 1, (1,), generator=g))

            def enc(s: str) -> list[int]:
                return list(tok(s, add_special_tokens=False)["input_ids"])

            before = enc(
                " ".join(fill[:depth]) + (" " if depth else "") + f"The secret words of the {key} are"
            )
            val = enc(value)
            after = enc(
                ". " + " ".join(fill[depth:]) + f"\nQuestion: what are the secret words of the {key}? "
                f"Answer: the secret words of the {key} are"
            )
            head = ([bos] if bos is not None else []) + before
            row = head + val + after + val
            needles.append((len(head), len(head) + len(val)))
            answers.append((len(head) + len(val) + len(after), len(row)))
        else:
            cand = _candidates(model)
            perm = cand[torch.randperm(len(cand), generator=g)]
            key_ids: list[int] = perm[:2].tolist()
            val_ids: list[int] = perm[2 : 2 + needle_words].tolist()
            rest = perm[2 + needle_words :]  # the haystack never holds a key or needle token
            hay = rest[torch.randint(len(rest), (4 * n_filler,), generator=g)].tolist()
            depth = int(torch.randint(len(hay) + 1, (1,), generator=g))
            head = ([bos] if bos is not None else []) + hay[:depth] + key_ids
            row = head + val_ids + hay[depth:] + key_ids + val_ids
            needles.append((len(head), len(head) + len(val_ids)))
            answers.append((len(row) - len(val_ids), len(row)))
        rows.append(row)
    batch = _pack(model, rows)
    pads = [batch.length - len(r) for r in rows]
    needles = [(a + p, b + p) for (a, b), p in zip(needles, pads, strict=True)]
    answers = [(a + p, b + p) for (a, b), p in zip(answers, pads, strict=True)]
    model.check_length(batch.length)
    return batch, needles, answers


@torch.no_grad()
def retrieval_scores(
    model: HeadModel,
    *,
    n_prompts: int = 8,
    n_filler: int = 12,
    needle_words: int = 4,
    batch_size: int = 8,
    seed: int = 0,
) -> HeadScores:
    """Retrieval score (Wu et al. 2024, arXiv:2404.15574, §2): the copy-paste rate of each head on
    needle-in-a-haystack prompts (`needle_prompts`).

    The answer (the needle's value) is teacher-forced, so one forward replaces Wu et al.'s
    decoding loop: query row i predicts answer token y = tok[i+1]; head h copies it when its
    argmax key at row i lies in the needle and holds y. The score is the share of answer tokens
    copied (|g_h ∩ k| / |k| per prompt), averaged over prompts. Unlike Wu et al., rows count
    whether or not the model itself predicts y (the pattern is read at the same place either way).

    Args:
        n_prompts, n_filler, needle_words, seed: as in `needle_prompts` (defaults 8, 12, 4, 0).
        batch_size: prompts per forward (a positive int, default 8).

    Returns:
        HeadScores `[L, H]` in [0, 1], method `"role_retrieval"`.

    Raises:
        HeadsteerValueError: an argument out of range, prompts longer than the model's context
            (both before any forward).
    """
    batch_size = _positive(batch_size, "batch_size")
    enc, needles, answers = needle_prompts(
        model, n_prompts=n_prompts, n_filler=n_filler, needle_words=needle_words, seed=seed
    )
    L, H = model.n_layers, model.n_heads
    total = torch.zeros(L, H, dtype=torch.float64)
    dev = model.device
    for start in range(0, enc.batch, batch_size):
        sl = slice(start, start + batch_size)
        ids = enc.input_ids[sl]
        B, T = ids.shape
        sub = EncodedPrompts(ids, enc.attention_mask[sl], [[]] * B, [""] * B, [[]] * B)
        q_rows = torch.zeros(B, T, dtype=torch.bool)  # rows predicting an answer token
        target = torch.zeros(B, T, dtype=torch.long)
        in_needle = torch.zeros(B, T, dtype=torch.bool)
        for b, ((n0, n1), (a0, a1)) in enumerate(zip(needles[sl], answers[sl], strict=True)):
            q_rows[b, a0 - 1 : a1 - 1] = True
            target[b, a0 - 1 : a1 - 1] = ids[b, a0:a1]
            in_needle[b, n0:n1] = True
        q_rows, target, in_needle, ids_d = q_rows.to(dev), target.to(dev), in_needle.to(dev), ids.to(dev)

        def copy_hits(
            probs: torch.Tensor,
            call: AttentionCall,
            ids_d=ids_d,
            in_needle=in_needle,
            target=target,
            q_rows=q_rows,
        ) -> torch.Tensor:
            a, b = call.q_offset, call.q_offset + call.q_len
            j = probs.argmax(-1)  # [B, H, q]
            key_tok = ids_d.gather(1, j.flatten(1).clamp(max=ids_d.shape[1] - 1)).view_as(j)
            hit = in_needle.gather(1, j.flatten(1)).view_as(j) & (key_tok == target[:, None, a:b])
            return (hit & q_rows[:, None, a:b]).sum(-1)  # [B, H]

        # only the answer rows' pattern is computed (`[B, H, rows, T]`, never `[B, H, T, T]`)
        rows_ = (min(a0 for a0, _ in answers[sl]) - 1, max(a1 for _, a1 in answers[sl]) - 1)
        recs = [Recorder(layer=la, fn=copy_hits, query_range=rows_) for la in range(L)]
        with editing(model, recs):
            forward(model, sub, logits_to_keep=1)
        n_ans = q_rows.sum(-1).double().cpu()  # [B]
        for la, rec in enumerate(recs):
            hits = sum(rec.records).double().cpu()  # [B, H]
            total[la] += (hits / n_ans[:, None]).sum(0)
    return HeadScores(
        (total / enc.batch).float(),
        "role_retrieval",
        {"n_prompts": enc.batch, "n_filler": n_filler, "needle_words": needle_words},
        model=model.name,
        n_kv_heads=model.n_kv_heads,
        seed=int(seed),
    )


def detect_roles(
    model: HeadModel,
    sequences: SequencesArg = None,
    *,
    apply_first_mlp: bool = True,
    seed: int = 0,
    retrieval: bool = True,
    successor: bool = True,
    stability: int = 0,
) -> RoleScores:
    """Every detector: the pattern scores (one forward per batch), copying, successor and retrieval.

    Args:
        sequences: the pattern detectors' sequences (see `pattern_scores`; default repeated
            random tokens).
        apply_first_mlp: passed to `copying_scores` and `successor_scores` (default True).
        seed: seeds the random sequences, copying tokens and needle prompts (0..2**32 - 1).
        retrieval: also run `retrieval_scores` (default True; False skips the needle forward).
        successor: also run `successor_scores` (default True; skipped without a tokenizer).
        stability: bootstrap resamples of the sequences for the pattern detectors' rankings
            (`pattern_scores(stability=)`; default 0: none).

    Returns:
        a `RoleScores`: the mapping `{name: HeadScores [L, H]}` (`PATTERN_DETECTORS`, `"copying"`,
        then `"successor"` and `"retrieval"` when run) with the result protocol's
        `head_scores(role)`, `to_frame()`, `save()` / `load()`.

    Raises:
        HeadsteerTypeError: a flag that is not a bool. HeadsteerValueError: a bad seed or
            sequences (see the detectors). Checked before the first forward.
    """
    check_bool("apply_first_mlp", apply_first_mlp)
    check_bool("retrieval", retrieval)
    check_bool("successor", successor)
    seed = _seed(seed)
    out = pattern_scores(model, sequences, seed=seed, stability=stability)
    out["copying"] = copying_scores(model, apply_first_mlp=apply_first_mlp, seed=seed)
    if successor and model.tokenizer is not None:
        out["successor"] = successor_scores(model, apply_first_mlp=apply_first_mlp)
    if retrieval:
        out["retrieval"] = retrieval_scores(model, seed=seed)
    return RoleScores(out)
