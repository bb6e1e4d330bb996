"""An edited layer on the fused kernel: the edited heads through `flex_attention`, the rest through SDPA."""

from __future__ import annotations

from typing import cast

import torch

from heads._util.validation import short_repr
from heads.engine.edits import (
    AttentionCall,
    LogitBias,
    SpanShareEdit,
)
from heads.engine.kernels import fused as _fused
from heads.engine.kernels.common import AttentionInputs, check_window, checked_bias, own_sdpa
from heads.engine.state import MIN_LOGIT, LayerEdits
from heads.errors import HeadsteerValueError

__all__ = ["fused_layer_attention"]


def fused_layer_attention(inputs: AttentionInputs, edits: LayerEdits) -> torch.Tensor:
    """`blocked_attention` on the fused kernel (`heads.engine.kernels.fused`): `[B, Q, H, d]` output.

    Only the heads some edit touches (in any batch row) run through the fused kernel; the
    others run through the model's own SDPA (`own_sdpa`; on CPU the fused kernel is about
    twice as slow per head as SDPA's flash kernel, and PASTA edits a few heads per layer).
    With a soft-cap (which SDPA lacks) every head runs fused. Column logit biases are summed
    into one `[B, H_edited, K]` table; a `SpanShareEdit` takes one extra pass for its per-row
    span shares. Rows with no visible key (left-padding query rows) give 0 on the fused heads
    and what SDPA gives on the others; no real token reads them.

    Learned sinks (`sinks` `[H]`, gpt-oss) run every head fused, with one extra key column
    appended: its key and value are zero (so its logit is 0 after scaling and soft-capping and it
    adds nothing to the output), its column bias is the head's sink logit and every row sees it,
    so it joins each row's normalisation exactly as the sink does in the model's own attention.
    """
    query, key, value, mask = inputs.query, inputs.key, inputs.value, inputs.mask
    scaling, softcap, causal = inputs.scaling, inputs.softcap, inputs.causal
    sinks, q_offset = inputs.sinks, inputs.q_offset

    batch, n_heads, q_len, _ = query.shape
    k_len = key.shape[2]
    groups = n_heads // key.shape[1]
    device = query.device
    check_window(edits, q_len, k_len)
    offset = k_len - q_len if q_offset is None else q_offset
    call = AttentionCall(edits.layer, batch, n_heads, q_len, k_len, offset, device)
    every_bias = cast("list[LogitBias]", edits.get("logits"))
    biases = [e for e in every_bias if e.per_column]
    rank_one = [e for e in every_bias if not e.per_column]  # `rank_one` (fusable): one per layer
    spans = cast("list[SpanShareEdit]", edits.get("probs"))
    touched = {h for ed in (*every_bias, *spans) for h in ed.head_list(n_heads)}
    n_fused = _fused.head_bucket(len(touched), n_heads)
    split = softcap is None and sinks is None and 0 < n_fused < n_heads
    # the edited heads, padded with unedited ones up to the compiled head count
    sel = sorted(touched | set(sorted(set(range(n_heads)) - touched)[: n_fused - len(touched)]))
    sel = sel if split else list(range(n_heads))
    index = torch.tensor(sel, device=device)
    if split:  # the edited heads only, each with its own KV head
        q_e, k_e, v_e = query[:, index], key[:, index // groups], value[:, index // groups]
    else:
        q_e, k_e, v_e = query, key, value
    bias = None
    for ed in biases:
        ed.calls += 1
        b = checked_bias(ed, call)
        if b.dim() != 4 or b.shape[-2] != 1:
            raise HeadsteerValueError(
                f"{short_repr(ed)} declares per_column but its bias has shape {tuple(b.shape)}, not "
                "[B|1, H|1, 1, K]"
            )
        b = torch.where(ed.head_mask(batch, n_heads, device)[:, :, None], b[:, :, 0].to(device), 0.0)
        bias = b if bias is None else bias + b
    if bias is not None:
        bias = bias.clamp(min=MIN_LOGIT)[:, index] if split else bias.clamp(min=MIN_LOGIT)
    bool_mask = None if mask is None or mask.dtype == torch.bool else mask > MIN_LOGIT / 2
    if mask is not None and mask.dtype == torch.bool:
        bool_mask = mask
    if sinks is not None:  # every head runs fused here (split is False)
        q_e, k_e, v_e, bool_mask, bias = _sink_column(q_e, k_e, v_e, bool_mask, bias, sinks, causal)
    kw: dict = dict(scale=scaling, mask=bool_mask, causal=causal, bias=bias, softcap=softcap, q_offset=offset)
    beta = span = None
    for rb in rank_one:  # beta[b, h, q] * cols[b, k] in the kernel's per-row span term
        rb.calls += 1
        row, cols = rb.row_column_bias(call)
        span = cols.to(device=device, dtype=torch.float32).expand(batch, k_len)
        row = row.to(device=device, dtype=torch.float32).clamp(min=MIN_LOGIT)  # -inf: blocked exactly
        heads = rb.head_mask(batch, n_heads, device)[:, :, None]
        beta = torch.where(heads, row.expand(batch, n_heads, q_len), 0.0)[:, index]
    for se in spans:
        se.calls += 1
        cols = se.span_columns(call).to(device)
        span = cols.float()
        indicator = torch.zeros_like(v_e)
        indicator[..., 0] = span[:, None, :].to(v_e.dtype)
        indicator[..., 1] = 1
        mass_e = _fused.fused_attention(q_e, k_e, indicator, **kw).float()
        mass = mass_e.new_zeros(batch, n_heads, q_len, mass_e.shape[-1])
        mass[:, index] = mass_e
        heads = se.head_mask(batch, n_heads, device)[:, :, None]
        num = torch.where(heads, mass[..., 0], 0.0)
        den = torch.where(heads, mass[..., 1], 0.0)
        got = se.span_beta(num, den, call)
        beta = None if got is None else torch.where(heads, got.float().expand_as(num), 0.0)[:, index]
    out_e = _fused.fused_attention(q_e, k_e, v_e, beta=beta, span=span, **kw)
    if not split:
        return out_e.transpose(1, 2).contiguous()
    out = out_e.new_empty(batch, q_len, n_heads, value.shape[-1])
    out[:, :, index] = out_e.transpose(1, 2)
    rest = torch.tensor(sorted(set(range(n_heads)) - set(sel)), device=device)
    kv = rest // groups
    own = own_sdpa(query[:, rest], key[:, kv], value[:, kv], mask, scaling, causal)
    out[:, :, rest] = own.transpose(1, 2)
    return out


def _sink_column(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    sinks: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Append the learned-sink column: zero key and value, bias = the head's sink logit `[H]`,
    visible from every row. Returns `(query, key, value, bool mask [B|1, 1, Q, K+1], bias
    [B|1, H, K+1])`."""
    batch, n_heads, q_len, _ = query.shape
    k_len = key.shape[2]
    device = query.device
    key = torch.cat([key, key.new_zeros(*key.shape[:2], 1, key.shape[-1])], dim=2)
    value = torch.cat([value, value.new_zeros(*value.shape[:2], 1, value.shape[-1])], dim=2)
    if mask is None:
        qpos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
        kpos = torch.arange(k_len, device=device)[None, :]
        mask = ((kpos <= qpos) | (not causal))[None, None]
    mask = mask.expand(-1, -1, q_len, k_len)
    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1, q_len, 1)], dim=-1)
    if bias is None:
        bias = torch.zeros(1, n_heads, k_len, device=device)
    sink = sinks.float().to(device).reshape(1, n_heads, 1).expand(bias.shape[0], -1, -1)
    bias = torch.cat([bias.expand(-1, n_heads, -1), sink], dim=-1)
    return query, key, value, mask, bias
