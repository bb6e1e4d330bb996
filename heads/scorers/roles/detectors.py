"""Head-role detectors: previous-token, duplicate-token, induction, self, entropy (attention on
sequences), copying and successor (the OV circuit), retrieval (needle-in-a-haystack copy rate).

Every detector returns `HeadScores` `[L, H]` and is deterministic for a `seed`. The pattern
detectors share one forward per batch (`pattern_scores`): a `Recorder` on every layer reduces
the pattern to per-(row, head) sums inside the forward, every detector from one pass over each
query block (`heads.scorers.roles.pattern_sums`), so no `[B, H, T, T]` tensor is kept.

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

The token rows (`random_tokens`, `repeated_tokens`) live in `heads.scorers.roles.sequences`, the
retrieval detector (`needle_prompts`, `retrieval_scores`) in `heads.scorers.roles.needle`; both are
re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from heads._util.validation import check_bool, is_int, short_repr
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Recorder
from heads.engine.forward import forward
from heads.engine.options import SweepOptions, sweep_options
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.results.roles import RoleScores
from heads.results.scores import HeadScores
from heads.results.stability import check_stability
from heads.scorers.maps.static import RelationPairs, k_for, maps_scores, source_representations
from heads.scorers.roles.needle import MAX_FILLER, needle_prompts, retrieval_scores
from heads.scorers.roles.pattern_sums import block_sums
from heads.scorers.roles.request import DetectRolesRequest

# Names imported `as` themselves are re-exported: `heads.scorers.roles.detectors.<name>` stays.
from heads.scorers.roles.sequences import (
    MAX_SEQUENCES,
    SequencesArg,
    _candidates,
    _int_dtype,
    _positive,
    _seed,
    _sequences,
    random_tokens,
    repeated_tokens,
)
from heads.scorers.roles.sequences import _bos_id as _bos_id
from heads.scorers.roles.sequences import _pack as _pack
from heads.scorers.roles.sequences import _pad_id as _pad_id
from heads.scorers.roles.sequences import _special_ids as _special_ids
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
    "run_detect_roles",
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

MAX_COPYING_TOKENS = 8192
"""Most source tokens `copying_scores` reads (`n_tokens`)."""


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
    seed: int = 0,
    stability: int = 0,
    options: SweepOptions | None = None,
    **deprecated: Any,
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
        seed: the seed of the default sequences (an int in 0..2**32 - 1, default 0).
        stability: bootstrap resamples of the sequences (default 0: none; e.g. 100) for each
            ranking's stability, `scores.stability` (from the per-sequence scores, no extra forward).
        options: `heads.SweepOptions`; `max_rows`: sequences per forward (without `options`,
            8), fewer where `max_memory` needs it (the `"detectors"` plan; refused before any
            forward when one sequence does not fit).
        **deprecated: `batch_size=` (sequences per forward, now `max_rows`) as a keyword (one
            release; a `DeprecationWarning`; refused together with `options.max_rows` set).

    Returns:
        `{detector: HeadScores [L, H]}` in [0, 1] (NaN for a head with no counted row), method
        `"role_<detector>"`.

    Raises:
        HeadsteerValueError: unknown detector or `rows`; bad sequences (non-integer, bool or
            float ids, ids outside the vocabulary, empty rows, longer than the model's context);
            bad `max_rows` / `batch_size` or `seed`; another option than `max_rows`. All checked
            before the first forward.
        HeadsteerTypeError: a flag that is not a bool; `sequences` or `detectors` of a wrong type.
    """
    names = _check_detectors(detectors)
    if not isinstance(rows, str) or rows not in ("target", "all"):
        raise HeadsteerValueError(f"rows must be 'target' or 'all', got {short_repr(rows)}")
    check_bool("exclude_bos", exclude_bos)
    check_bool("exclude_current_token", exclude_current_token)
    legacy_rows = deprecated.get("batch_size")
    opts = sweep_options(
        options,
        deprecated,
        "pattern_scores",
        takes=("max_rows", "max_memory"),
        renamed={"batch_size": "max_rows"},
    )
    batch_size = opts.max_rows if options is not None or legacy_rows is not None else 8
    seed = _seed(seed)
    stability = check_stability(stability)
    enc = _sequences(model, sequences, seed)
    model.check_length(enc.length)
    batch_size = opts.replace(max_rows=batch_size).within(model, enc.length, "detectors").max_rows
    check_samples(enc.batch, stability, "sequences")
    dev = model.device
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
            probs: torch.Tensor,
            call: AttentionCall,
            ids_dev: torch.Tensor = ids_dev,
            real_dev: torch.Tensor = real_dev,
            first: torch.Tensor = first,
        ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
            flags = (exclude_bos, exclude_current_token)
            return block_sums(probs, call.q_offset, ids_dev, real_dev, first, names, rows, *flags)

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


def _one(detector: str) -> Callable[..., HeadScores]:
    def scorer(model: HeadModel, sequences: SequencesArg = None, **kwargs: Any) -> HeadScores:
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
    request = DetectRolesRequest(
        apply_first_mlp=apply_first_mlp,
        seed=seed,
        retrieval=retrieval,
        successor=successor,
        stability=stability,
    )
    return run_detect_roles(model, sequences, request)


def run_detect_roles(
    model: HeadModel,
    sequences: SequencesArg,
    request: DetectRolesRequest,
    options: SweepOptions | None = None,
) -> RoleScores:
    """Run a `DetectRolesRequest` (built and checked by `detect_roles`: see there for the result and
    the errors); `options`' `max_rows` / `max_memory` bound `pattern_scores`' sequences per forward."""
    if not isinstance(request, DetectRolesRequest):
        raise HeadsteerTypeError(f"request must be a DetectRolesRequest, got {type(request).__name__}")
    r = request
    rows = None if options is None else SweepOptions(max_rows=options.max_rows, max_memory=options.max_memory)
    out = pattern_scores(model, sequences, seed=r.seed, stability=r.stability, options=rows)
    out["copying"] = copying_scores(model, apply_first_mlp=r.apply_first_mlp, seed=r.seed)
    if r.successor and model.tokenizer is not None:
        out["successor"] = successor_scores(model, apply_first_mlp=r.apply_first_mlp)
    if r.retrieval:
        budget = None if options is None else SweepOptions(max_memory=options.max_memory)
        out["retrieval"] = retrieval_scores(model, seed=r.seed, options=budget)
    return RoleScores(out)
