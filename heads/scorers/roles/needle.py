"""Retrieval heads (Wu et al. 2024): needle-in-a-haystack prompts (`needle_prompts`) and each head's
copy-paste rate of the needle (`retrieval_scores`), one teacher-forced forward per batch.

Re-exported by `heads.scorers.roles.detectors`.
"""

from __future__ import annotations

from typing import Any

import torch

from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Recorder
from heads.engine.forward import forward
from heads.engine.options import SweepOptions, sweep_rows
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores
from heads.scorers.roles.sequences import MAX_SEQUENCES, _bos_id, _candidates, _pack, _positive, _seed

__all__ = ["MAX_FILLER", "needle_prompts", "retrieval_scores"]

MAX_FILLER = 8192
"""Most filler sentences of a needle prompt (`n_filler`; about 10 tokens each, so haystacks of 32k
tokens and more); the model's context bounds it further."""


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
    seed: int = 0,
    options: SweepOptions | None = None,
    **deprecated: Any,
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
        options: `heads.SweepOptions`; `max_rows`: prompts per forward (default 8 where
            `max_rows` is left at its default), fewer where `max_memory` needs it (the
            `"retrieval"` plan; refused before any forward when one prompt does not fit).
        **deprecated: `batch_size=` (now `max_rows`) as a keyword (one release; a
            `DeprecationWarning`; refused together with `options.max_rows` set).

    Returns:
        HeadScores `[L, H]` in [0, 1], method `"role_retrieval"`.

    Raises:
        HeadsteerValueError: an argument out of range, prompts longer than the model's context
            (both before any forward).
    """
    opts = sweep_rows(options, deprecated, "retrieval_scores", default=8, takes=("max_rows", "max_memory"))
    enc, needles, answers = needle_prompts(
        model, n_prompts=n_prompts, n_filler=n_filler, needle_words=needle_words, seed=seed
    )
    batch_size = opts.within(model, enc.length, "retrieval").max_rows  # max_memory: rows within it
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
            ids_d: torch.Tensor = ids_d,
            in_needle: torch.Tensor = in_needle,
            target: torch.Tensor = target,
            q_rows: torch.Tensor = q_rows,
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
