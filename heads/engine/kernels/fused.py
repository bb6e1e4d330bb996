"""Fused steered attention: one compiled `flex_attention` kernel for edits that are score
modifications (issue 13; used by `heads.engine.context`, `editing(..., kernel=...)`).

`flex_attention` (torch >= 2.5) computes `softmax(score_mod(q.k * scale) + mask) v` without
materialising the `[queries, keys]` matrix: compiled to C++ on CPU and to Triton on CUDA, so
memory grows linearly with the sequence. One kernel serves every fused edit:

    score = softcap(q.k * scale) + bias[b, h, k] + beta[b, h, q] * span[b, k]

masked by the model's own mask (a causal mask with a cache offset, or the model's dense
boolean mask for padded batches, sliding windows and bidirectional spans), with GQA.

* `bias`: the sum of the layer's column logit biases (`LogitBias.column_bias`, e.g. PASTA),
  each restricted to its (row, head) pairs.
* `beta * span`: a `SpanShareEdit` (SpotLight). Its per-row span share psi comes from a
  first pass whose values are the span indicator (column 0) and ones (column 1): the output
  of that pass is exactly `sum_k W[q, k] m[k]` and `sum_k W[q, k]` (so no pattern is ever
  materialised, and no log-sum-exp is needed: compiled CPU `flex_attention` has no
  `return_lse`); the edit turns the shares into a per-row bias beta and the second pass
  applies it as `softmax(S + beta m)`, which is the SpotLight rescale.

The engine runs only the edited heads of a layer through this kernel (their count padded to
`head_bucket`) and the other heads through the model's own SDPA, which is about twice as fast
per head on CPU. Compiled once per process and variant (causal or dense mask) and static
shape: lengths are padded to `bucket`, head counts to `head_bucket` (a dynamic head dimension
is specialised by the flex lowering anyway); the batch dimension is marked dynamic (a batch of
1 is specialised by torch and compiles once more). A compile takes ~15-40 s on a cold CPU
cache and a few seconds with inductor's on-disk cache warm; `warm_up` runs it ahead of time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["BLOCK", "available", "bucket", "fused_attention", "head_bucket", "warm_up"]

BLOCK = 128
"""flex_attention's block size (rows and columns) used for the block-sparse mask."""

RECOMPILE_LIMIT = 64
"""Compiled shapes kept per kernel variant (torch's default of 8 is too few for length buckets)."""

_LOCK = threading.Lock()
_COMPILED: dict[bool, Callable] = {}  # dense mask? -> compiled kernel


def available() -> bool:
    """True when this torch has `flex_attention` (torch >= 2.5)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - the pinned torch has it
        return False
    return True


def _score_mod(
    bias: torch.Tensor, beta: torch.Tensor, span: torch.Tensor, softcap: float | None
) -> Callable[..., torch.Tensor]:
    """The edit as a flex `score_mod`: optional soft-cap, then the per-column bias `[B, H, k]`
    and the per-row span bias `beta[B, H, q] * span[B, k]`."""

    def score_mod(s, b, h, q, k):
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        return s + bias[b, h, k] + beta[b, h, q] * span[b, k]

    return score_mod


def _flex(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Callable,
    mask_mod: Callable,
    blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """`flex_attention` over the block mask `blocks` (with `mask_mod` on partial blocks), GQA."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    block_mask = BlockMask.from_kv_blocks(
        *blocks, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(query.shape[2], key.shape[2])
    )
    return flex_attention(
        query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True
    )


def _kernel_causal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    beta: torch.Tensor,
    span: torch.Tensor,
    offset: torch.Tensor,
    k_real: torch.Tensor,
    blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    score_mod = _score_mod(bias, beta, span, softcap)

    def mask_mod(b, h, q, k):
        return (k <= q + offset) & (k < k_real)

    return _flex(query, key, value, score_mod, mask_mod, blocks, scale)


def _kernel_dense(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    beta: torch.Tensor,
    span: torch.Tensor,
    dense: torch.Tensor,
    blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    score_mod = _score_mod(bias, beta, span, softcap)

    def mask_mod(b, h, q, k):
        return dense[b, q, k]

    return _flex(query, key, value, score_mod, mask_mod, blocks, scale)


def _compiled(dense: bool) -> Callable:
    with _LOCK:
        fn = _COMPILED.get(dense)
        if fn is None:
            kernel = _kernel_dense if dense else _kernel_causal
            fn = _COMPILED[dense] = torch.compile(kernel, dynamic=False, fullgraph=True)
        return fn


_LADDER = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)


def bucket(n: int) -> int:
    """The compiled length for `n` rows or keys: 1 stays 1 (decoding); otherwise `n` rounded up
    to BLOCK times a number of the ladder 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, ... (at most a third
    of padding above 256 tokens; 1k, 2k, 4k and 8k are exact), then BLOCK-multiples beyond."""
    if n <= 1:
        return n
    blocks = -(-n // BLOCK)
    for b in _LADDER:
        if b >= blocks:
            return b * BLOCK
    return blocks * BLOCK


def head_bucket(n: int, n_heads: int) -> int:
    """Heads to run through the kernel for `n` edited heads of `n_heads`: the ladder value
    1, 2, 3, 4, 5, 6, 8, 10, 12, 16, ... at or above `n`, at most `n_heads`. flex_attention
    compiles per head count (a dynamic head dimension is specialised), so bucketing bounds
    the compiles of a model whose layers edit different numbers of heads."""
    for b in _LADDER:
        if b >= n:
            return min(b, n_heads)
    return n_heads


def _block_mask(partial: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)` of a flex BlockMask
    from `[B, 1, nQ, nK]` bool maps of the blocks with any / all keys visible."""
    partial = partial & ~full

    def indices(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = x.sum(-1, dtype=torch.int32)
        order = torch.argsort((~x).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts, order

    return (*indices(partial), *indices(full))


_CAUSAL_CACHE: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _causal_blocks(
    q_len: int, k_len: int, offset: int, k_real: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Block mask of `key <= query + offset` and `key < k_real` (cached per shape: it is the same in
    every layer)."""
    key = (q_len, k_len, offset, k_real, str(device))
    hit = _CAUSAL_CACHE.get(key)
    if hit is not None:
        return hit
    n_q, n_k = -(-q_len // BLOCK), -(-k_len // BLOCK)
    q_first = torch.arange(n_q, device=device) * BLOCK
    q_last = torch.clamp(q_first + BLOCK - 1, max=q_len - 1)
    k_first = torch.arange(n_k, device=device) * BLOCK
    k_last = torch.clamp(k_first + BLOCK - 1, max=k_len - 1)
    partial = (k_first[None, :] <= q_last[:, None] + offset) & (k_first[None, :] < k_real)
    full = (k_last[None, :] <= q_first[:, None] + offset) & (k_last[None, :] < k_real)
    mask = _block_mask(partial[None, None], full[None, None])
    if len(_CAUSAL_CACHE) > 16:
        _CAUSAL_CACHE.clear()
    _CAUSAL_CACHE[key] = mask
    return mask


def _dense_blocks(dense: torch.Tensor, q_len: int, k_len: int) -> tuple[torch.Tensor, ...]:
    """Block mask from the model's `[B, Q, K]` bool mask."""
    n_q, n_k = -(-q_len // BLOCK), -(-k_len // BLOCK)
    pad = (0, n_k * BLOCK - k_len, 0, n_q * BLOCK - q_len)
    batch = dense.shape[0]
    anyv = torch.nn.functional.pad(dense, pad, value=False).view(batch, n_q, BLOCK, n_k, BLOCK)
    allv = torch.nn.functional.pad(dense, pad, value=True).view(batch, n_q, BLOCK, n_k, BLOCK)
    partial = anyv.any(4).any(2)[:, None]
    full = allv.all(4).all(2)[:, None]
    return _block_mask(partial, full)


def fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None,
    causal: bool = True,
    bias: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    span: torch.Tensor | None = None,
    softcap: float | None = None,
    q_offset: int | None = None,
) -> torch.Tensor:
    """`[B, H, Q, d_v]` attention output of the fused kernel (see the module docstring).

    Args:
        query: `[B, H, Q, d]`; key `[B, G, K, d]`; value `[B, G, K, d_v]` (H a multiple of G).
        scale: the logit scale.
        mask: the model's mask: None (causal, or every key if not `causal`), or a bool
            `[B or 1, 1, Q, K]` mask (True = visible).
        bias: fp32 `[B or 1, H or 1, K]` column bias added to the logits, or None.
        beta: fp32 `[B or 1, H or 1, Q]` per-row span bias and `span` fp32 `[B or 1, K]`
            (1.0 on span columns), or None.
        softcap: `c` of `c * tanh(s / c)` applied to the scaled logits, or None.
        q_offset: absolute position of the first query row for a causal None mask (None:
            `K - Q`; a static KV cache holds more key slots than positions).

    Rows with no visible key give 0.
    """
    batch, n_heads, q_real, _ = query.shape
    k_real = key.shape[2]
    device = query.device
    q_len, k_len = bucket(q_real), bucket(k_real)
    bias_t = torch.zeros(batch, n_heads, k_len, device=device)
    if bias is not None:
        bias_t[..., :k_real] = bias
    beta_t = torch.zeros(batch, n_heads, q_len, device=device)
    span_t = torch.zeros(batch, k_len, device=device)
    if beta is not None and span is not None:
        beta_t[..., :q_real] = beta
        span_t[..., :k_real] = span
    if mask is None:
        offset = (k_real - q_real if q_offset is None else q_offset) if causal else k_real
        blocks = _causal_blocks(q_len, k_len, offset, k_real, device)
        dense = None
    else:
        dense = torch.zeros(batch, q_len, k_len, dtype=torch.bool, device=device)
        dense[:, :q_real, :k_real] = mask[:, 0]
        blocks = _dense_blocks(dense, q_len, k_len)
        offset = 0
    if q_len != q_real:
        query = torch.nn.functional.pad(query, (0, 0, 0, q_len - q_real))
    if k_len != k_real:
        key = torch.nn.functional.pad(key, (0, 0, 0, k_len - k_real))
        value = torch.nn.functional.pad(value, (0, 0, 0, k_len - k_real))
    for t in (query, key, value, bias_t, beta_t, span_t):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    if dense is not None:
        torch._dynamo.maybe_mark_dynamic(dense, 0)
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        if dense is None:
            off, kr = torch.tensor(offset, device=device), torch.tensor(k_real, device=device)
            out = _compiled(False)(query, key, value, bias_t, beta_t, span_t, off, kr, blocks, scale, softcap)
        else:
            out = _compiled(True)(query, key, value, bias_t, beta_t, span_t, dense, blocks, scale, softcap)
    result: torch.Tensor = out[:, :, :q_real] if q_len != q_real else out
    return result


def warm_up(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """Compile the fused kernels for `device` / `dtype` ahead of time (causal and padded
    variants, batch > 1), so a later steered call does not pay the compile."""
    # fixed values, not torch.randn: warming up must not move the caller's global generator
    q = torch.linspace(-1, 1, 2 * 4 * 130 * 16, device=device, dtype=dtype).reshape(2, 4, 130, 16)
    kv = q[:, :2].flip(-1).contiguous()
    fused_attention(q, kv, kv, scale=0.25, mask=None)
    mask = torch.ones(2, 1, 130, 130, dtype=torch.bool, device=device).tril()
    fused_attention(q, kv, kv, scale=0.25, mask=mask)
