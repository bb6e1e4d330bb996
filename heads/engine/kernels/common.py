"""What both kernels share: the model's mask as an additive mask, the keyword and sliding-window
checks, and the model's own SDPA for the heads no edit touches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from heads._util.validation import short_repr
from heads.engine.edits import AttentionCall, Edit
from heads.engine.state import MIN_LOGIT, LayerEdits
from heads.errors import HeadsteerTypeError, HeadsteerValueError

__all__ = [
    "AttentionInputs",
    "additive_mask",
    "causal_additive",
    "check_kwargs",
    "check_window",
    "checked_bias",
    "checked_probs",
    "checked_score_bias",
    "mask_in_dtype",
    "own_sdpa",
]


@dataclass(frozen=True)
class AttentionInputs:
    """One attention call's inputs, as the registered attention function hands them to a kernel.

    Attributes:
        query: `[B, H, Q, d]` (after QK-norm, RoPE and any query edit).
        key: `[B, G, K, d]` keys (H a multiple of G).
        value: `[B, G, K, d]` values.
        mask: the model's mask (bool or additive, `[B or 1, 1, Q, K]`) or None.
        scaling: the module's logit scale.
        softcap: `c` of `c * tanh(s / c)` (Gemma 2) or None (default).
        causal: what a None mask means (the module's `is_causal`; default True).
        sinks: learned attention sinks `[H]` (gpt-oss `s_aux`) or None (default).
        q_offset: absolute position of the first query row, or None (default: `K - Q`).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    scaling: float
    softcap: float | None = None
    causal: bool = True
    sinks: torch.Tensor | None = None
    q_offset: int | None = None


def checked_bias(edit: Edit, call: AttentionCall) -> torch.Tensor:
    """`edit.bias(call)` as an fp32 tensor on the call's device (a user's bias may be built in
    another dtype or on the CPU); HeadsteerTypeError for anything that is not a tensor."""
    b = edit.bias(call)  # type: ignore[attr-defined]
    if not isinstance(b, torch.Tensor):
        raise HeadsteerTypeError(f"{short_repr(edit)}.bias returned {type(b).__name__}, not a torch.Tensor")
    return b.to(device=call.device, dtype=torch.float32)


def checked_score_bias(edit: Edit, scores: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """`edit.score_bias(scores, call)` as an fp32 tensor on the call's device (HeadsteerTypeError
    for anything that is not a tensor)."""
    b = edit.score_bias(scores, call)  # type: ignore[attr-defined]
    if not isinstance(b, torch.Tensor):
        raise HeadsteerTypeError(
            f"{short_repr(edit)}.score_bias returned {type(b).__name__}, not a torch.Tensor"
        )
    return b.to(device=call.device, dtype=torch.float32)


def checked_probs(edit: Edit, new: object, probs: torch.Tensor) -> torch.Tensor:
    """A pattern edit's result as fp32 on the pattern's device, with the pattern's shape
    (HeadsteerTypeError / HeadsteerValueError naming the edit otherwise)."""
    if not isinstance(new, torch.Tensor):
        raise HeadsteerTypeError(
            f"{short_repr(edit)}.apply returned {type(new).__name__}, not a torch.Tensor"
        )
    if new.shape != probs.shape:
        raise HeadsteerValueError(
            f"{short_repr(edit)}.apply returned shape {tuple(new.shape)}; a pattern edit returns the "
            f"pattern's shape {tuple(probs.shape)}"
        )
    return new.to(device=probs.device, dtype=torch.float32)


def causal_additive(q_len: int, k_len: int, q_offset: int, device: torch.device) -> torch.Tensor:
    """`[1, 1, q_len, k_len]` fp32 mask: 0 where key j <= query position, else min."""
    qpos = torch.arange(q_offset, q_offset + q_len, device=device)[:, None]
    kpos = torch.arange(k_len, device=device)[None, :]
    return torch.where(kpos <= qpos, 0.0, MIN_LOGIT)[None, None]


def additive_mask(
    mask: torch.Tensor | None,
    q_len: int,
    k_len: int,
    device: torch.device,
    causal: bool = True,
    q_offset: int | None = None,
) -> torch.Tensor:
    """The model's mask as an fp32 additive mask `[B or 1, 1, q_len, k_len]`.

    `mask=None` means "every key" for a non-causal module and "causal" otherwise (as SDPA's
    `is_causal` does), the first query row at absolute position `q_offset` (None: `k_len - q_len`).
    """
    if mask is None:
        if not causal:
            return torch.zeros(1, 1, q_len, k_len, device=device)
        return causal_additive(q_len, k_len, k_len - q_len if q_offset is None else q_offset, device)
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, MIN_LOGIT).to(device)
    return mask.float().clamp(min=MIN_LOGIT)


def mask_in_dtype(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 additive mask cast to `dtype` without overflowing to -inf (fp16) or NaN."""
    if dtype == torch.float32:
        return mask
    return mask.clamp(min=torch.finfo(dtype).min).to(dtype)


# Keywords transformers 5.23 passes to attention functions that the SDPA / eager paths ignore
# too (positions are already in the rotated q/k, the mask carries windows and padding):
_IGNORED_KW = frozenset(
    {
        "position_ids",
        "use_cache",
        "cache_position",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "token_type_ids",
        "sliding_window",  # the registered mask function already applies it
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "output_router_logits",  # a mixture-of-experts model flag forwarded with the layer's kwargs
    }
)


# ... and those the edited path reproduces itself.
_REPRODUCED_KW = frozenset({"softcap", "is_causal", "s_aux"})  # s_aux: learned sinks


def check_kwargs(layer: int, dropout: float, kw: dict) -> None:
    """ValueError for anything the edited path would otherwise silently drop."""
    unknown = sorted(k for k, v in kw.items() if v is not None and k not in _IGNORED_KW | _REPRODUCED_KW)
    if unknown:
        raise HeadsteerValueError(
            f"layer {layer}: the model passes {unknown} to its attention function; headsteer's edited "
            "attention does not reproduce it, so it refuses rather than compute a different attention"
        )
    if dropout:
        raise HeadsteerValueError(
            f"layer {layer}: attention dropout {dropout} is active (training mode); call model.eval() "
            "before editing attention"
        )


def check_window(edits: LayerEdits, q_len: int, k_len: int) -> None:
    # Keys beyond the queries come from the KV cache; a sliding-window cache keeps only the last
    # window - 1 of them, so key column j is no longer absolute position j.
    if edits.window is not None and q_len < k_len and k_len >= edits.window - 1:
        raise HeadsteerValueError(
            f"layer {edits.layer} uses sliding-window attention (window {edits.window}) and the sequence "
            f"reached {k_len} keys: the KV cache no longer holds absolute positions, so attention edits "
            "cannot be placed; shorten the prompt or edit only full-attention layers"
        )


def own_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    causal: bool,
) -> torch.Tensor:
    """`[B, H, Q, d_v]` SDPA as transformers' `sdpa_attention_forward` runs it (the model's own
    attention): `is_causal` only for a prefill with no mask, the mask passed as given. `key` and
    `value` have one head per query head (no GQA)."""
    q_len, k_len = query.shape[2], key.shape[2]
    is_causal = q_len > 1 and mask is None and causal
    if is_causal and k_len > q_len:  # top-left causal alignment: only the first q_len keys
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling
    )
