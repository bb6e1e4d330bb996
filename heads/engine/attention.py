"""headsteer's attention function, registered with `transformers`' attention and mask interfaces.

A layer with no pattern edit calls the model's own attention (SDPA or the family's eager
function); a layer with logit or pattern edits runs the blocked or the fused kernel
(`use_fused` chooses)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from heads.engine import state
from heads.engine.activations import apply_activation_edits
from heads.engine.edits import (
    AttentionCall,
    Edit,
    LogitBias,
    ProbEdit,
    SpanShareEdit,
)
from heads.engine.kernels.blocked import blocked_attention
from heads.engine.kernels.common import AttentionInputs, check_kwargs
from heads.engine.kernels.fused_layer import fused_layer_attention
from heads.engine.sites import SITES
from heads.engine.state import ACTIVE, KERNEL, OFFSETS, LayerEdits
from heads.errors import HeadsteerValueError
from heads.model.families import family_of

__all__ = ["BASES", "check_fusable", "fusable", "read_only", "registered_name", "row_terms", "use_fused"]

BASES = ("sdpa", "eager")


def fusable(edit: Edit) -> bool:
    """True when `edit` can run with `kernel="fused"`: a query, head-output, residual or other
    activation edit (these never need the pattern; not a read of `attn_scores`), a `LogitBias`
    with `per_column` (e.g. PASTA) or a `SpanShareEdit` (e.g. SpotLight). Other pattern edits
    (recorders, ACT, VAR, attribution's linearised scale) read the whole pattern and run on the
    blocked path."""
    if isinstance(edit, LogitBias):
        return edit.per_column or edit.rank_one
    if isinstance(edit, ProbEdit):
        return isinstance(edit, SpanShareEdit)
    return edit.site != "attn_scores"  # a read of the explicit logits


def row_terms(edits: list[Edit]) -> int:
    """How many of `edits` need the fused kernel's one per-row term (`beta[q] * span[k]`): span
    shares (SpotLight) and rank-one logit biases that are not per column (knockout)."""
    return sum(
        isinstance(e, SpanShareEdit) or (isinstance(e, LogitBias) and e.rank_one and not e.per_column)
        for e in edits
    )


def _layer_fusable(edits: LayerEdits) -> bool:
    probs = edits.get("probs")
    if edits.get("attn_scores"):  # a scores read needs the explicit logits
        return False
    pattern = [*edits.get("logits"), *probs]
    return all(fusable(e) for e in pattern) and len(probs) <= 1 and row_terms(pattern) <= 1


def check_fusable(table: dict[int, LayerEdits]) -> None:
    """ValueError unless every layer's attention edits (this context's and any outer one's)
    can run on the fused kernel."""
    for slot in table.values():
        pattern = [*slot.get("logits"), *slot.get("probs")]
        bad = [e for e in pattern if not fusable(e)] + slot.get("attn_scores")
        shares = row_terms(pattern)
        if bad or shares > 1:
            what: list = bad or [
                f"{shares} span-share edits in layer {slot.layer} (span shares and row-by-column biases "
                "such as knockout share one per-row term)"
            ]
            raise HeadsteerValueError(
                f"kernel='fused' cannot run {what}: they read the whole attention pattern; "
                "use kernel='auto' or 'blocked'"
            )


def use_fused(edits: LayerEdits, want_probs: bool, query: torch.Tensor) -> bool:
    kernel = KERNEL.get()
    if kernel == "fused" and want_probs:
        raise HeadsteerValueError(
            f"layer {edits.layer}: kernel='fused' never builds the attention pattern, so it cannot "
            "return it (output_attentions=True); use kernel='auto' or 'blocked'"
        )
    if kernel == "blocked" or want_probs or not _layer_fusable(edits):
        return False
    if query.device.type == "cpu" and torch.is_grad_enabled() and query.requires_grad:
        if kernel == "fused":
            raise HeadsteerValueError(
                f"layer {edits.layer}: kernel='fused' on CPU has no backward pass (flex_attention); "
                "run under torch.no_grad() / inference_mode() or use kernel='auto' or 'blocked'"
            )
        return False
    if kernel == "fused":
        return True
    q_len = query.shape[2]
    if query.device.type == "cuda":
        return q_len > 1
    if q_len > state.QUERY_BLOCK and edits.get("probs"):  # blocked would split a pooled span share
        return True
    return q_len >= state.FUSED_MIN_ROWS_CPU


def registered_name(base: str) -> str:
    """Name of headsteer's attention function for a base backend (`sdpa` or `eager`)."""
    return f"headsteer_{base}"


_EAGER: dict[type, tuple[Callable, tuple[str, str] | None]] = {}


_SDPA: list[Callable] = []  # transformers' SDPA attention function, set by _register()


def _own_attention(module: nn.Module, base: str) -> Callable:
    """The attention function the model itself would run for `module` under `base`."""
    if base == "sdpa":
        return _SDPA[0]
    cached = _EAGER.get(type(module))
    if cached is None:
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise HeadsteerValueError(
                f"{type(module).__name__} has no eager_attention_forward to fall back to"
            )
        config = getattr(module, "config", None)
        variant = family_of(config).eager_variant if config is not None else None
        cached = _EAGER[type(module)] = (fn, variant)
    fn, variant = cached
    if variant is not None and getattr(module, variant[0], False):  # e.g. GPT-2's upcast path
        method = getattr(module, variant[1])
        return lambda m, q, k, v, mask, **kw: method(q, k, v, mask)
    return fn


def read_only(edits: LayerEdits) -> bool:
    """True when the layer's pattern edits only read the pattern (`ProbEdit.reads_only`, e.g.
    `Recorder`) and no logit bias is active: the layer's output is then the model's own
    attention, bitwise, in every dtype; the pattern is computed beside it for the readers."""
    return not edits.get("logits") and all(getattr(e, "reads_only", False) for e in edits.get("probs"))


def _make_attention(base: str) -> Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]]:
    def headsteer_attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kw: Any,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        edits = ACTIVE.get().get(id(module))
        k_len, q_len = key.shape[2], query.shape[2]
        # the call's first absolute position: the cached positions before it (recorded by the
        # attention module's pre-hook); a static cache holds more key slots than positions
        position = OFFSETS.get().get(id(module), k_len - q_len) if edits is not None else k_len - q_len
        q_offset = position
        if q_offset + q_len > k_len:  # a sliding cache shorter than the positions, or a stale record
            q_offset = k_len - q_len
        queries = edits.get("query") if edits is not None else []
        keys = edits.get("rot_k") if edits is not None else []
        if (queries or keys) and edits is not None:  # row t is absolute position `position + t`
            b, h = query.shape[:2]
            call = AttentionCall(edits.layer, b, h, q_len, k_len, position, query.device)
            if queries:
                query = apply_activation_edits(queries, query.transpose(1, 2), call, head_axis=2)
                query = query.transpose(1, 2)
            if keys:  # read only: a copy of this call's new keys (not the cache's)
                new_keys = key[:, :, q_offset : q_offset + q_len].transpose(1, 2).clone()
                apply_activation_edits(keys, new_keys, call, head_axis=2)
        want = bool(
            kw.get("output_attentions", getattr(getattr(module, "config", None), "output_attentions", False))
        )
        if edits is None or not any(SITES[s].pattern_site and edits.get(s) for s in edits.sites):
            if not (want and base == "sdpa"):
                own = _own_attention(module, base)
                result: tuple[torch.Tensor | None, torch.Tensor | None] = own(
                    module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw
                )
                return result
            # SDPA returns no pattern: compute it explicitly (no edit) so output_attentions holds it.
            edits = edits or LayerEdits(int(getattr(module, "layer_idx", -1)), query.shape[1])
        check_kwargs(edits.layer, dropout, kw)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        is_causal = kw.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        own = _own_attention(module, base)
        kw_own = {k: v for k, v in kw.items() if k != "output_attentions"}

        def own_out() -> torch.Tensor:
            out: torch.Tensor = own(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw_own
            )[0]
            return out

        # Read-only edits: the model's own output, with the pattern beside it for the readers.
        only_read = read_only(edits)
        inputs = AttentionInputs(
            query, key, value, attention_mask, scaling, kw.get("softcap"), causal, kw.get("s_aux"), q_offset
        )
        if not only_read and use_fused(edits, want, query):
            return fused_layer_attention(inputs, edits), None
        out, pattern = blocked_attention(
            module,
            inputs,
            edits,
            want_probs=want,
            eager=base == "eager",
            pattern_only=only_read,
            own=None if only_read else own_out,
        )
        # the readers first, then the model's own output: a reader that stops the forward once
        # it has its rows (the explorer's pattern window) saves the layer's whole attention
        return (own_out(), pattern) if only_read else (out, pattern)

    return headsteer_attention


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    _SDPA[:] = [sdpa_attention_forward]
    for base, mask_fn in (("sdpa", sdpa_mask), ("eager", eager_mask)):
        name = registered_name(base)
        AttentionInterface.register(name, _make_attention(base))
        AttentionMaskInterface.register(name, mask_fn)


_register()
