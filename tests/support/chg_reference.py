"""The reference Causal Head Gating forward and log-probability, re-implemented as a test oracle.

Source: the code accompanying Nam et al. 2025, "Causal Head Gating" (arXiv:2505.13737),
https://github.com/jonhanke/nam_causal-head-gating at commit
17176da4b0264a9677f42d912ac5f5deb80dc3d5 (MIT licence, (c) 2025 Andrew Nam, Jonathan Hanke):

* `src/causal_head_gating/core/chg.py`: `CHG.register_mask_hooks` (a forward pre-hook on each
  layer's attention output projection that views its input as `[B, T, H, hidden // H]` and
  multiplies head h by `masks[:, layer, h]`), `CHG.forward` (the input repeated once per mask,
  `"b s -> (b k) s"`, the masks `"k l h -> (b k) l h"`, logits viewed `[B, K, T, V]`, `[:, 0]`
  for a single `[L, H]` mask) and `CHG.get_logp` (the logits of `input_ids[:, :-1]`, targets
  `input_ids[:, 1:]`, loss mask `loss_masks[:, 1:]`, log-probability `-cross_entropy * mask`
  summed over tokens, and for `agg="mean"` divided by the mask's count clamped at 1);
* `src/causal_head_gating/models/adapters.py`: `LlamaAdapter` (layers `model.model.layers`,
  projection `layer.self_attn.o_proj`) and `ModelAdapter.head_dim` (`hidden_size // heads`);
* `src/causal_head_gating/utils/helpers.py`: `cross_entropy` (class dimension last).

The lines are rewritten here (no `einops`, plain torch hooks: tests may hook modules); nothing is
copied into headsteer. The reference runs without an attention mask, so the oracle takes rows
without padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gated_logits(model, input_ids: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """`CHG.forward`: logits `[B, K, T, V]` of a Llama-style HF model with head gates
    `masks` `[K, L, H]` (values in [0, 1]) on each head's input to `o_proj`."""
    cfg = model.config
    n_heads = cfg.num_attention_heads
    head_dim = cfg.hidden_size // n_heads
    batch, k = input_ids.shape[0], masks.shape[0]
    ids = input_ids.repeat_interleave(k, 0)  # "b s -> (b k) s"
    rows = masks.repeat(batch, 1, 1)  # "k l h -> (b k) l h"
    handles = []
    for layer_idx, layer in enumerate(model.model.layers):

        def pre_hook(module, args, layer_idx=layer_idx):
            x = args[0]
            b, t, hidden = x.shape
            gate = rows[:, layer_idx].view(-1, 1, n_heads, 1).to(x.device, dtype=x.dtype)
            return ((x.view(b, t, n_heads, head_dim) * gate).view(b, t, hidden),)

        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(pre_hook))
    try:
        logits = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    return logits.view(batch, k, *logits.shape[1:])


def reference_forward(model, input_ids: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """`CHG(model)(input_ids, masks)`: `[B, T, V]` for masks `[L, H]`, `[B, K, T, V]` for `[K, L, H]`."""
    if masks.ndim == 2:
        return _gated_logits(model, input_ids, masks[None])[:, 0]
    return _gated_logits(model, input_ids, masks)


def reference_logp(
    model, masks: torch.Tensor, input_ids: torch.Tensor, loss_masks: torch.Tensor, agg: str = "sum"
) -> torch.Tensor:
    """`CHG(model).get_logp(masks, input_ids, loss_masks, agg)`: `[B]` for masks `[L, H]`,
    `[B, K]` for `[K, L, H]` (`agg` "sum" or "mean"; "none" keeps the token axis)."""
    single = masks.ndim == 2
    masks = masks[None] if single else masks
    k = masks.shape[0]
    logits = _gated_logits(model, input_ids[:, :-1], masks)
    targets = input_ids[:, 1:, None].expand(-1, -1, k).transpose(1, 2)  # "b l -> b m l"
    keep = loss_masks[:, 1:, None].expand(-1, -1, k).transpose(1, 2)
    nll = F.cross_entropy(logits.permute(0, -1, *range(1, logits.ndim - 1)), targets, reduction="none")
    logp = -(nll * keep)
    if agg != "none":
        logp = logp.sum(-1)
    if agg == "mean":
        logp = logp / keep.sum(-1).clamp(min=1)
    return logp.squeeze(1) if single else logp
