"""The blocked kernel: an edited layer's attention in torch, `QUERY_BLOCK` query rows at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from heads.engine import state
from heads.engine.activations import apply_activation_edits
from heads.engine.edits import (
    AttentionCall,
    LogitBias,
    ProbEdit,
)
from heads.engine.kernels.common import (
    AttentionInputs,
    additive_mask,
    causal_additive,
    check_window,
    checked_bias,
    checked_probs,
    checked_score_bias,
    mask_in_dtype,
    own_sdpa,
)
from heads.engine.state import MIN_LOGIT, LayerEdits

__all__ = ["blocked_attention"]


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Row softmax of fp32 `scores` `[B, H, Q, K]`; with `sinks` `[H]` each head's sink logit
    joins the normalisation and is dropped (as gpt-oss's own eager attention does)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().to(scores.device).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    both = torch.cat([scores, sink], dim=-1)
    both = both - both.max(dim=-1, keepdim=True).values
    return torch.softmax(both, dim=-1)[..., :-1]


def _with_score_biases(
    scores: torch.Tensor, reading: list[LogitBias], head_masks: dict, call: AttentionCall
) -> torch.Tensor:
    """`scores` plus each logit-reading bias's `score_bias` (fp32, on its heads), in `scores`' dtype."""
    if not reading:
        return scores
    s32 = scores.float()
    add = sum(torch.where(head_masks[id(e)], checked_score_bias(e, s32, call), 0.0) for e in reading)
    return (s32 + add).to(scores.dtype)


def _as_4d(b: torch.Tensor) -> torch.Tensor:
    """A bias broadcastable to `[B, H, Q, K]` with its leading broadcast dims made explicit."""
    return b.reshape((1,) * (4 - b.dim()) + tuple(b.shape)) if b.dim() < 4 else b


def _logits_and_pattern(
    q_blk: torch.Tensor,
    key: torch.Tensor,
    add: torch.Tensor | None,
    inputs: AttentionInputs,
    *,
    sinks: torch.Tensor | None,
    eager_low: bool,
    inplace: bool,
    biased: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logits, fp32 pattern)` of query rows `q_blk [B, H, q, d]` over `key [B, H, K, d]` with the
    additive mask `add` (or None: every key visible), the family's scale and soft-cap, `sinks`
    (`[H]` of the heads in `q_blk`, or None) and `biased(logits)` (the logit-reading biases) before
    the mask; masked keys are not zeroed here.
    `eager_low`: the model's own dtype up to the softmax (eager attention in bf16 / fp16), else
    fp32; `inplace`: the same operations on one buffer (no autograd)."""
    scaling, softcap = inputs.scaling, inputs.softcap
    if eager_low:  # the model's dtype, as eager_attention_forward
        scores = torch.matmul(q_blk, key.transpose(-1, -2)) * scaling
        if softcap is not None:  # Gemma 2: c * tanh(s / c) on the scaled logits, before the mask
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores if biased is None else biased(scores)
        if add is not None:
            scores = scores + mask_in_dtype(add, q_blk.dtype)
        return scores, _softmax(scores.float(), sinks)
    if inplace:  # the same operations on the block's own logits, without a new tensor each
        scores = torch.matmul(q_blk.float(), key.float().transpose(-1, -2)).mul_(scaling)
        if softcap is not None:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        scores = scores if biased is None else biased(scores)
        if add is not None:
            scores = scores.add_(add)
        return scores, _softmax(scores, sinks)
    scores = torch.matmul(q_blk.float(), key.float().transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores if biased is None else biased(scores)
    if add is not None:
        scores = scores + add
    return scores, _softmax(scores, sinks)


def _full_mask(
    add: torch.Tensor | None,
    open_row: bool,
    causal: bool,
    rows: int,
    k_len: int,
    start: int,
    device: torch.device,
) -> torch.Tensor | None:
    """The block's additive mask as the explicit path uses it: None for open rows with no mask and
    no bias (every key visible: one decode row or a non-causal layer), a causal / zero mask where
    the model passed none, else `add` clamped at `MIN_LOGIT` (stacked biases on a masked key stay
    finite)."""
    if add is None:
        if open_row:
            return None
        if causal:
            return causal_additive(rows, k_len, start, device)
        return torch.zeros(1, 1, rows, k_len, device=device)
    return add.clamp(min=MIN_LOGIT)


def _pattern_fn(
    inputs: AttentionInputs, mask: Callable[[], torch.Tensor | None], eager_low: bool, inplace: bool
) -> Callable[..., torch.Tensor]:
    """`AttentionCall.pattern_of` of one block: the layer's own pattern (no edit, no bias) for
    other queries / keys over the block's mask (`mask()`: the explicit path's, or None; built
    only when an edit asks, so the readers' blocks keep one mask)."""

    def pattern_of(query: torch.Tensor, key: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        base = mask()
        if key.shape[1] != query.shape[1]:  # KV heads: each query head reads its group's
            key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        sinks = inputs.sinks
        if sinks is not None and heads is not None:
            sinks = sinks[heads.to(sinks.device)]
        _, probs = _logits_and_pattern(
            query, key, base, inputs, sinks=sinks, eager_low=eager_low, inplace=inplace
        )
        if base is None:
            return probs
        hidden = ~(base > MIN_LOGIT / 2)
        return probs.masked_fill_(hidden, 0.0) if inplace else probs.masked_fill(hidden, 0.0)

    return pattern_of


def _biased_sdpa(
    inputs: AttentionInputs, biases: list[LogitBias], head_masks: dict, layer: int
) -> torch.Tensor:
    """`[B, Q, H, d]` output of a layer whose only pattern edits are logit biases that do not read
    the logits (e.g. PASTA), through SDPA, without a mask as wide as the heads.

    The heads no bias touches in any row run once through the model's own SDPA (`own_sdpa`,
    the model's mask as given). The touched heads are grouped by which biases edit them in which
    batch rows; each group runs `bias_block_rows(B, K)` query rows at a time (about
    `BIAS_BLOCK_ELEMENTS` mask entries, at most `QUERY_BLOCK` rows) with one additive mask, the
    model's mask plus the group's biases, each zero on the rows it does not edit. A bias shared
    by its heads (PASTA's `[B|1, 1, 1, K]`, a server batch's per-row `[B, 1, 1, K]`, knockout's
    `[B, 1, Q_blk, K]`) thus gives a `[B, 1, Q_blk, K]` mask, whatever the head count and however
    many rows are steered; a per-head bias `[B|1, H, ., K]` gives `[B, H_group, Q_blk, K]`. A
    group of every head (knockout in every head) reads the query, key and value as they are
    (SDPA's own GQA), never an indexed copy.
    """
    query, key, value, mask = inputs.query, inputs.key, inputs.value, inputs.mask
    scaling, causal = inputs.scaling, inputs.causal
    batch, n_heads, q_len, _ = query.shape
    k_len = key.shape[2]
    groups = n_heads // key.shape[1]
    device = query.device
    offset = k_len - q_len if inputs.q_offset is None else inputs.q_offset
    # which rows each bias edits, per head: [n_biases, B, H] -> one signature per head
    rows = torch.stack([head_masks[id(ed)][:, :, 0, 0].expand(batch, n_heads) for ed in biases])
    signature = rows.permute(2, 0, 1).reshape(n_heads, -1).cpu()  # [H, n_biases * B]
    by_sig: dict[tuple[bool, ...], list[int]] = {}
    for h in range(n_heads):
        sig = tuple(signature[h].tolist())
        if any(sig):
            by_sig.setdefault(sig, []).append(h)
    touched = sorted(h for hs in by_sig.values() for h in hs)
    out = query.new_empty(batch, n_heads, q_len, value.shape[-1])
    rest = sorted(set(range(n_heads)) - set(touched))
    if rest:
        r = torch.tensor(rest, device=device)
        out[:, r] = own_sdpa(query[:, r], key[:, r // groups], value[:, r // groups], mask, scaling, causal)
    block = state.bias_block_rows(batch, k_len)  # read at call time (tests shrink it)
    every = list(range(n_heads))
    for s in range(0, q_len, block):
        e_ = min(q_len, s + block)
        call = AttentionCall(layer, batch, n_heads, e_ - s, k_len, offset + s, device, q_len > block)
        if mask is None:  # one decode row or a non-causal layer: every key is visible
            base = causal_additive(e_ - s, k_len, offset + s, device) if causal and q_len > 1 else None
        else:
            m = mask if mask.shape[-2] == 1 else mask[..., s:e_, :]
            base = additive_mask(m, e_ - s, k_len, device, causal, offset + s)
        bias_blk = [_as_4d(checked_bias(ed, call)) for ed in biases]
        for sig, hs in by_sig.items():
            idx = torch.tensor(hs, device=device)
            add = base
            for i, b in enumerate(bias_blk):
                on = sig[i * batch : (i + 1) * batch]  # the rows where bias i edits the group's heads
                if not any(on):
                    continue
                b = b[:, idx] if b.shape[1] > 1 else b
                b = torch.where(torch.tensor(on, device=device).reshape(-1, 1, 1, 1), b, 0.0)
                add = b if add is None else add + b
            assert add is not None and add is not base  # every group has a bias on some row
            add = add.clamp_(min=MIN_LOGIT)  # a fresh tensor: stacked biases on a masked key stay finite
            if hs == every:  # every head: no indexed copy of the query, key and value
                out[:, :, s:e_] = F.scaled_dot_product_attention(
                    query[:, :, s:e_],
                    key,
                    value,
                    attn_mask=mask_in_dtype(add, query.dtype),
                    scale=scaling,
                    enable_gqa=groups > 1,
                )
                continue
            out[:, idx, s:e_] = F.scaled_dot_product_attention(
                query[:, idx, s:e_],
                key[:, idx // groups],
                value[:, idx // groups],
                attn_mask=mask_in_dtype(add, query.dtype),
                scale=scaling,
            )
    return out.transpose(1, 2).contiguous()


def _block_base(
    mask: torch.Tensor | None,
    s: int,
    e: int,
    q_len: int,
    k_len: int,
    device: torch.device,
    causal: bool,
    offset: int,
) -> torch.Tensor | None:
    """The model's mask for query rows `s:e` as an fp32 additive mask `[B or 1, 1, e - s or 1, K]`,
    or None when every key is visible (one decode row or a non-causal layer, no mask)."""
    if mask is None:
        return None if (q_len == 1 or not causal) else causal_additive(e - s, k_len, offset + s, device)
    m = mask if mask.shape[-2] == 1 else mask[..., s:e, :]
    return additive_mask(m, e - s, k_len, device, causal, offset + s)


def blocked_attention(
    module: nn.Module,
    inputs: AttentionInputs,
    edits: LayerEdits,
    *,
    want_probs: bool = False,
    eager: bool = False,
    pattern_only: bool = False,
    own: Callable[[], torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The family's attention with the layer's logit and pattern edits.

    Returns `([B, Q, H, d]` output, the edited pattern `[B, H, Q, K]` in the value dtype if
    `want_probs` (`output_attentions=True`), else None).

    Args:
        inputs: the call's query `[B, H, Q, d]` (after QK-norm, RoPE and any query edit), key and
            value `[B, G, K, d]`, mask (bool or additive, `[B or 1, 1, Q, K]`, or None), logit
            scale, soft-cap (`c` of `c * tanh(s / c)` or None), `causal` (what a None mask
            means: the module's `is_causal`), sinks and q_offset (below).
        want_probs: also return the pattern (computes it explicitly).
        eager: the model's own attention is `eager`: compute the edited layer the same way
            (matmul, softmax) rather than with SDPA, so only the edit differs from the model's
            own arithmetic (and a TransformerLens bridge, which attends eagerly, agrees bitwise).
        inputs.sinks: learned attention sinks `[H]` (gpt-oss `s_aux`) or None: one extra logit per
            head joins each row's softmax and is dropped after it, so a row's probabilities
            sum to less than 1 (Xiao et al. 2024, "attention sinks"; OpenAI gpt-oss).
        inputs.q_offset: absolute position of the first query row (the cached positions before the
            call); None means `K - Q` (a dynamic cache). A static cache holds more key slots
            than positions, so the engine passes the real offset.
        own: the model's own attention output `[B, Q, H, d]` (a thunk): returned instead when
            no logit bias is active and every pattern edit returned its input unchanged (e.g.
            SpotLight with every row above its target), so such a call is bitwise the model's.
        pattern_only: compute the pattern and run the probs edits (read-only ones: the caller
            takes the output from the model's own attention), return `(None, pattern or None)`.

    Precision (bf16 / fp16): the explicit path follows the model's own order of operations.
    With `eager`, as transformers' `eager_attention_forward`: logits `q k^T * scaling` in the
    model's dtype (soft-capped in that dtype), the mask and any logit bias added in that dtype,
    softmax in fp32, the pattern rounded to the model's dtype before it multiplies the values.
    Otherwise as SDPA's kernels on bf16 / fp16 inputs: logits, softmax and the value product in
    fp32, the output rounded once. Pattern edits always see (and return) fp32 probabilities;
    logit biases are fp32 tensors. In fp32 both orders are the fp32 computation.
    """
    query, key, value, mask = inputs.query, inputs.key, inputs.value, inputs.mask
    scaling, softcap, causal = inputs.scaling, inputs.softcap, inputs.causal
    sinks, q_offset = inputs.sinks, inputs.q_offset
    batch, n_heads, q_len, _ = query.shape
    k_len = key.shape[2]
    groups = n_heads // key.shape[1]
    device = query.device
    biases = cast("list[LogitBias]", edits.get("logits"))  # the site's edits are its subclass
    probs_edits = cast("list[ProbEdit]", edits.get("probs"))
    head_masks = {
        id(e): e.head_mask(batch, n_heads, device)[:, :, None, None] for e in (*biases, *probs_edits)
    }
    check_window(edits, q_len, k_len)
    for e in (*biases, *probs_edits):
        e.calls += 1
    score_reads = edits.get("attn_scores")  # reads of the masked logits (`attn_scores` site)
    # SDPA cannot soft-cap or expose the pattern
    reading = [e for e in biases if e.reads_scores]  # biases that are functions of the logits
    biases = [e for e in biases if not e.reads_scores]
    explicit = (
        bool(probs_edits)
        or bool(reading)
        or softcap is not None
        or want_probs
        or eager
        or pattern_only
        or sinks is not None
        or bool(score_reads)
    )
    # A prompt (Q > 1) runs its biases by head group, never through a [B, H, Q, K] mask. A decode
    # step (Q = 1) keeps one SDPA call: its [B, H, 1, K] mask is smaller than the layer's KV cache,
    # and the per-group calls would cost more than they save (the steering-overhead benchmark).
    if not explicit and biases and q_len > 1:
        return _biased_sdpa(inputs, biases, head_masks, edits.layer), None
    if explicit and groups > 1:  # GQA: each query head reads its KV head; K/V are never edited
        key = key.repeat_interleave(groups, dim=1)
        if not pattern_only:  # a pattern that is only read never multiplies the values
            value = value.repeat_interleave(groups, dim=1)
    offset = k_len - q_len if q_offset is None else q_offset
    low = query.dtype != torch.float32
    outs, patterns = [], []
    same = not biases and not reading  # every pattern edit returned its input itself (changed nothing)
    block = state.QUERY_BLOCK  # read at call time (tests shrink it)
    first, stop = 0, q_len
    if pattern_only and not want_probs and not score_reads:  # only read: small blocks, only the rows read
        block = state.read_block_rows(batch, n_heads, k_len)
        wanted = [getattr(e, "query_range", None) for e in probs_edits]
        ranges = [r for r in wanted if r is not None]
        if ranges and len(ranges) == len(wanted):
            first = max(0, min(r[0] for r in ranges) - offset)
            stop = min(q_len, max(r[1] for r in ranges) - offset)
    # without autograd (the readers, steering under no_grad) each block's logits and pattern are
    # changed in place: bitwise the same values, 3 fewer block-sized tensors per block
    inplace = not torch.is_grad_enabled()
    eager_low = eager and low
    # an edit may cap the block's query rows (`ProbEdit.block_rows`)
    caps = [c for e in probs_edits if (c := e.block_rows(batch, n_heads, k_len)) is not None]
    if caps:
        block = max(1, min(block, *caps))
    open_rows = explicit and (q_len == 1 or not causal)
    asks = any(e.uses_pattern_of for e in probs_edits)
    for s in range(first, stop, block):
        e_ = min(stop, s + block)
        # the model's mask for this block only (never a [B, 1, Q, K] fp32 copy of the whole mask);
        # a single decode row or a non-causal layer with no mask sees every key: no base mask
        add = _block_base(mask, s, e_, q_len, k_len, device, causal, offset)
        pattern_of = None
        if asks:  # the layer's own pattern of other queries / keys, for the edits that ask
            rows, start = e_ - s, offset + s

            def own_mask(
                base: torch.Tensor | None = add, rows: int = rows, start: int = start
            ) -> torch.Tensor | None:
                return _full_mask(base, open_rows, causal, rows, k_len, start, device)

            pattern_of = _pattern_fn(inputs, own_mask, eager_low, inplace)
        call = AttentionCall(
            edits.layer, batch, n_heads, e_ - s, k_len, offset + s, device, q_len > block, pattern_of
        )
        for ed in biases:
            b = torch.where(head_masks[id(ed)], checked_bias(ed, call), 0.0)
            add = b if add is None else add + b
        # every key visible (one decode row or a non-causal layer, no mask, no bias): the explicit
        # path needs no mask (adding zeros and masking nothing would change no bit)
        add = _full_mask(add, open_rows, causal, e_ - s, k_len, offset + s, device)
        q_blk = query[:, :, s:e_]
        if not explicit:
            assert add is not None  # open rows are only skipped on the explicit path
            outs.append(
                F.scaled_dot_product_attention(
                    q_blk,
                    key,
                    value,
                    attn_mask=mask_in_dtype(add, query.dtype),
                    scale=scaling,
                    enable_gqa=groups > 1,
                )
            )
            continue

        def biased(x: torch.Tensor, call: AttentionCall = call) -> torch.Tensor:
            return _with_score_biases(x, reading, head_masks, call)

        scores, probs = _logits_and_pattern(
            q_blk, key, add, inputs, sinks=sinks, eager_low=eager_low, inplace=inplace, biased=biased
        )
        if score_reads:  # fp32, masked keys at the fp32 minimum (as TransformerLens' hook_attn_scores)
            apply_activation_edits(score_reads, scores.float().clamp(min=MIN_LOGIT), call)
        visible: torch.Tensor | None = None
        if add is not None:
            shown = add > MIN_LOGIT / 2  # [B or 1, 1, q, K]
            visible = shown.expand_as(scores)
            if inplace:  # fully masked rows: 0
                probs = probs.masked_fill_(~shown, 0.0)
            else:
                probs = torch.where(visible, probs, 0.0)
        for pe in probs_edits:
            new = pe.apply(probs, call)
            if new is probs:  # a reader (a recorder, a reduction) changed nothing: no pass over it
                continue
            same = False
            probs = torch.where(head_masks[id(pe)], checked_probs(pe, new, probs), probs)
            if visible is not None:
                probs = torch.where(visible, probs, 0.0)  # masked / future keys stay exactly 0
        if want_probs:
            patterns.append(probs.to(value.dtype))
        if pattern_only:
            continue
        if low and not eager:  # SDPA's kernels: the value product in fp32, rounded once
            outs.append(torch.matmul(probs, value.float()).to(value.dtype))
        else:
            outs.append(torch.matmul(probs.to(value.dtype), value))
    if pattern_only or (same and own is not None):  # nothing changed: the model's own output
        pattern = torch.cat(patterns, dim=2) if want_probs else None
        return (None if pattern_only or own is None else own()), pattern
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    pattern = torch.cat(patterns, dim=2) if want_probs else None
    return out.transpose(1, 2).contiguous(), pattern
