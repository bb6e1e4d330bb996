"""Scorers: attention mass each head puts on an emphasized span (`span_attention`), one head's
pattern (`head_pattern`), and the attention between two named positions of prompt pairs
(`position_attention`: "from END to IO" on IOI)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from heads._util.validation import check_int, short_repr
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Edit, Recorder
from heads.engine.forward import forward
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import (
    Emphasis,
    EncodedPrompts,
    Prompt,
    emphasis_rows,
    encode_prompts,
    normalize_prompts,
)
from heads.inputs.tokens import readable_tokens
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores
from heads.scorers.patching.pairs import PairBatch, check_vocab

__all__ = ["head_pattern", "position_attention", "span_attention"]


def span_attention(
    model: HeadModel,
    prompts: Prompt | Sequence[Prompt],
    *,
    emphasize: Emphasis = None,
    chat: bool | None = None,
    query: Literal["last", "after_span"] = "last",
    batch_size: int = 8,
    steer: Any = (),
) -> HeadScores:
    """Attention mass on the emphasized span, per (layer, head), averaged over prompts.

    For head (l, h) and prompt b, the score is `sum_{j in G_b} A[l, h, i, j]`, the
    share of query row i's attention that falls on the span's tokens G_b (a number
    in [0, 1]), with i the last prompt position (`query="last"`, the row that
    predicts the first answer token) or averaged over all rows after the end of the
    last span (`query="after_span"`). Prompts without a span, or (with
    `after_span`) with no token after it, are skipped.

    Args:
        model: the model to score.
        prompts: prompts with `**span**` markup, or plain prompts plus `emphasize`.
        emphasize: substrings to emphasize (see `encode_prompts`).
        chat: apply the chat template (default: when the tokenizer has one).
        query: which query rows to read (see above).
        batch_size: prompts per forward pass.
        steer: interventions (objects with `.edits(model, enc)`, e.g. `steer.Pasta`)
            applied while measuring, to see the shares after steering.

    Returns:
        HeadScores `[n_layers, n_heads]`, method `"span_attention"`.

    Raises:
        ValueError: no prompt has a span, an unknown `query`, or bad prompts.

    Source: the attention-share diagnostic of PASTA (Zhang et al., ICLR 2024,
    arXiv:2311.02262, Sec. 3); a heuristic head ranking, not PASTA's profiling.
    """
    if query not in ("last", "after_span"):
        raise HeadsteerValueError(f"query must be 'last' or 'after_span', got {short_repr(query)}")
    check_int("batch_size", batch_size, lo=1)
    if model.tokenizer is None:
        raise HeadsteerValueError("span_attention needs a HeadModel with a tokenizer")
    items, _ = normalize_prompts(prompts)
    span_rows = emphasis_rows(emphasize, len(items))
    total = torch.zeros(model.n_layers, model.n_heads, dtype=torch.float64)
    n_scored = 0
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        enc = encode_prompts(
            model.tokenizer, chunk, emphasize=span_rows[start : start + batch_size], chat=chat
        )
        span = enc.span_mask().to(model.device)
        has = span.any(1)
        rows = torch.zeros_like(span)
        if query == "last":
            rows[:, -1] = True
        else:
            for b, sp in enumerate(enc.spans):
                if sp:
                    rows[b, max(t1 for _, t1 in sp) :] = True
        rows &= has[:, None]
        has &= rows.any(1)  # a span at the very end leaves no row to read: skip that prompt

        def read(
            probs: torch.Tensor, call: AttentionCall, span: torch.Tensor = span, rows: torch.Tensor = rows
        ) -> torch.Tensor:
            q = rows[:, call.q_offset : call.q_offset + call.q_len].float()  # [B, q]
            mass = (probs * span[:, None, None, : call.k_len]).sum(-1)  # [B, H, q]
            return (mass * q[:, None, :]).sum(-1)  # [B, H]

        # only the rows read are computed (the last one, or those after the span), and only the
        # last position's logits: memory linear in the prompt
        pos = torch.nonzero(rows.any(0)).flatten()
        first_row = int(pos.min()) if len(pos) else enc.length - 1
        wanted = (first_row, enc.length)
        recorders = [Recorder(layer=layer, fn=read, query_range=wanted) for layer in range(model.n_layers)]
        steering = [e for s in ([steer] if hasattr(steer, "edits") else steer) for e in s.edits(model, enc)]
        with editing(model, [*steering, *recorders]):
            forward(model, enc, logits_to_keep=1)
        denom = rows.sum(1).clamp(min=1).double()  # [B]
        for layer, rec in enumerate(recorders):
            mass = torch.stack(rec.records).sum(0).double() / denom[:, None]  # [B, H]
            total[layer] += mass[has].sum(0).cpu()
        n_scored += int(has.sum())
    if n_scored == 0:
        raise HeadsteerValueError(
            "no prompt has an emphasized span to score: mark one with **...** or pass emphasize="
            + (" (with query='after_span' the span must not end the prompt)" if query == "after_span" else "")
        )
    return HeadScores(
        (total / n_scored).float(),
        method="span_attention",
        params={"query": query, "n_prompts": n_scored},
        model=model.name,
        n_kv_heads=model.n_kv_heads,
    )


def head_pattern(
    model: HeadModel,
    prompt: Prompt,
    layer: int,
    head: int,
    *,
    emphasize: Emphasis = None,
    chat: bool | None = None,
    edits: Sequence[Edit] = (),
) -> tuple[torch.Tensor, list[str], list[tuple[int, int]]]:
    """One head's attention pattern on one prompt.

    Returns `(probs [T, T], tokens, spans)`: the post-softmax pattern (after any
    `edits`, e.g. a PASTA steering), the tokens as readable text (`heads.inputs.tokens`:
    `␣the`, `⏎`), and the emphasized token ranges.

    Raises:
        ValueError: unknown layer/head or bad prompt.
    """
    model.check_head(layer, head)
    enc = encode_prompts(model.tokenizer, prompt, emphasize=emphasize, chat=chat)
    if enc.batch != 1:
        raise HeadsteerValueError("head_pattern takes one prompt")
    rec = Recorder(layer=layer)
    with editing(model, [*edits, rec]):
        forward(model, enc)
    tokens = readable_tokens(model.tokenizer, enc.input_ids[0])
    return torch.cat(rec.records, dim=2)[0, head], tokens, enc.spans[0]


@torch.no_grad()
def position_attention(
    model: HeadModel,
    pairs: PairBatch,
    query: str = "END",
    key: str = "IO",
    *,
    which: str = "clean",
    batch_size: int = 16,
    steer: Any = (),
) -> HeadScores:
    """Attention from one named position to another, per head, averaged over the pairs.

    For head (l, h) the score is the mean over pairs b of `A[l, h, q_b, k_b]`, the attention
    probability (in [0, 1]) that query position q_b (`pairs.position(query)`) puts on key
    position k_b (`pairs.position(key)`). The shipped pair sets carry their positions (IOI:
    `IO`, `S1`, `S2`; Colored Objects: `COLOR`, `OBJECT`, `QUERY`; comp_mech: `OLD`, `NEW`) and
    every pair has `END`, its last token: `position_attention(model, pairs, "END", "IO")` is
    the name movers' signature of Wang et al. 2022 (Sec. 3.1, Fig. 3).

    Args:
        model: the model.
        pairs: a `PairBatch` (`encode_pairs`) with the named positions.
        query, key: position names (`pairs.position_names`).
        which: `"clean"` (default) or `"corrupted"` prompts (the columns are shared).
        batch_size: pairs per forward (default 16).
        steer: interventions (objects with `.edits(model, enc)`, e.g. `steer.Ablate`) applied
            while measuring.

    Returns:
        HeadScores `[n_layers, n_heads]`, method `"position_attention"`, params `query`, `key`,
        `which`, `n_pairs`.

    Raises:
        ValueError: an unknown position name (the message lists the pair's names), a key after
            the query (causal attention never looks ahead), an unknown `which`, `batch_size` < 1;
            all before any forward.
        TypeError: `pairs` not a `PairBatch`.
    """
    if not isinstance(pairs, PairBatch):
        raise HeadsteerTypeError(f"pairs must be a PairBatch (encode_pairs), got {type(pairs).__name__}")
    if which not in ("clean", "corrupted"):
        raise HeadsteerValueError(f"which must be 'clean' or 'corrupted', got {short_repr(which)}")
    check_int("batch_size", batch_size, lo=1)
    check_vocab(pairs, model.d_vocab)
    q_all, k_all = pairs.position(query), pairs.position(key)
    if bool((k_all > q_all).any()):
        b = int((k_all > q_all).nonzero()[0])
        raise HeadsteerValueError(
            f"pair {b}: key position {key!r} comes after query position {query!r}: a causal head "
            "cannot attend to it"
        )
    model.check_length(pairs.width)
    total = torch.zeros(model.n_layers, model.n_heads, dtype=torch.float64)
    for start in range(0, pairs.n, batch_size):
        idx = torch.arange(start, min(pairs.n, start + batch_size))
        sub = pairs.select(idx)
        n = sub.n
        qs, ks = sub.position(query), sub.position(key)
        enc = EncodedPrompts(
            sub.ids(which), sub.attention_mask, [[] for _ in range(n)], [""] * n, [[] for _ in range(n)]
        )

        def read(
            probs: torch.Tensor, call: AttentionCall, qs: torch.Tensor = qs, ks: torch.Tensor = ks
        ) -> torch.Tensor:
            rows = qs - call.q_offset
            inside = (rows >= 0) & (rows < call.q_len)
            b = torch.arange(probs.shape[0])[inside]
            out = torch.zeros(probs.shape[0], probs.shape[1], dtype=torch.float64)
            out[b] = probs[b, :, rows[inside].to(probs.device), ks[inside].to(probs.device)].double().cpu()
            return out

        recorders = [Recorder(layer=layer, fn=read) for layer in range(model.n_layers)]
        steering = [e for s in ([steer] if hasattr(steer, "edits") else steer) for e in s.edits(model, enc)]
        with editing(model, [*steering, *recorders]):
            forward(model, enc, logits_to_keep=1)
        for layer, rec in enumerate(recorders):
            total[layer] += torch.stack(rec.records).sum(0).sum(0)
    return HeadScores(
        (total / pairs.n).float(),
        method="position_attention",
        params={"query": query, "key": key, "which": which, "n_pairs": pairs.n},
        model=model.name,
        n_kv_heads=model.n_kv_heads,
    )
