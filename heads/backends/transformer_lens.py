"""The edit sites on a TransformerLens `TransformerBridge`: hooks on its hook points.

A bridge computes attention itself (its attention components never call the `transformers`
attention function), so on the `"transformer_lens"` backend the backend installs
each site as a TransformerLens hook (`tl_hook_specs`) (`HookPoint.add_hook`) instead:

| site          | hook point (per layer `l`)          | tensor the hook sees        |
|---------------|-------------------------------------|-----------------------------|
| `query`       | `blocks.l.attn.hook_rot_q`          | `[B, T, H, d]` (after RoPE) |
| `logits`      | `blocks.l.attn.hook_attn_scores`    | `[B, H, T, K]` scaled, masked |
| `probs`       | `blocks.l.attn.hook_pattern`        | `[B, H, T, K]`              |
| `head_output` | `blocks.l.attn.hook_z`              | `[B, T, H, d]`              |
| `residual`    | `blocks.l.hook_resid_pre`           | `[B, T, D]`                 |

The bridge's scores already carry the model's mask (masked keys at the fp32 minimum) and any
soft-capping, so a logit bias is added and clamped exactly as the HF engine does; a pattern edit
re-zeroes masked keys. Each call's absolute first position (the KV-cache length) is read by a
forward pre-hook on the block (`past_key_values`) for the sites that do not see the keys.
A family whose queries are normalised after `hook_rot_q` (QK-norm) cannot take query edits here:
that is a `ValueError`, not a silent difference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from heads._util.validation import short_repr
from heads.engine.edits import AttentionCall, Edit, HeadOutputEdit, LogitBias, ProbEdit, QueryEdit
from heads.engine.sites import HookSpec, pre_register, residual_hook, site_of
from heads.engine.state import ACTIVE, MIN_LOGIT, apply_head_edits
from heads.errors import HeadsteerValueError

if TYPE_CHECKING:
    from heads.model.adapter import HeadModel

__all__ = ["TL_HOOK_POINTS", "hook_point_for", "tl_add_hook", "tl_hook", "tl_hook_specs"]

TL_HOOK_POINTS = {
    "query": "attn.hook_rot_q",
    "logits": "attn.hook_attn_scores",
    "probs": "attn.hook_pattern",
    "head_output": "attn.hook_z",
    "residual": "hook_resid_pre",
    "positions": "",  # the block itself (forward pre-hook, reads past_key_values)
}
"""Site name -> hook point under `blocks.{layer}` (TransformerLens names)."""

# id(attention module) -> first absolute position of the current call / visible-key mask.
_OFFSETS: ContextVar[dict[int, int]] = ContextVar("headsteer_tl_offsets", default={})  # noqa: B039
_VISIBLE: ContextVar[dict[int, torch.Tensor]] = ContextVar("headsteer_tl_visible", default={})  # noqa: B039


def _fresh(var: ContextVar) -> dict:
    d = var.get()
    if not d:  # a fresh dict per context, never the shared default
        d = {}
        var.set(d)
    return d


def hook_point_for(model: HeadModel, site: str, layer: int) -> nn.Module:
    """The module the engine hooks for `site` in `layer` (ValueError if the bridge lacks it)."""
    backend: Any = model.backend
    if site == "positions":
        return cast("nn.Module", backend.bridge.blocks[layer])
    if site == "query":
        if model.family.qk_norm != "none":
            raise HeadsteerValueError(
                f"{short_repr(model.family.model_type)} normalises queries per head (QK-norm): the "
                "bridge has no hook "
                "point after it, so query edits (UA ablation) cannot run on the transformer_lens backend"
            )
        try:
            return cast("nn.Module", backend.hook_point(layer, TL_HOOK_POINTS["query"]))
        except ValueError:
            return cast("nn.Module", backend.hook_point(layer, "attn.hook_q"))  # no rotary embeddings
    return cast("nn.Module", backend.hook_point(layer, TL_HOOK_POINTS[site]))


def tl_hook(site: str, key: int, model: HeadModel, layer: int):
    """The hook function for `site` (TransformerLens form `fn(tensor, hook)` or a block pre-hook)."""
    n_heads = model.n_heads

    if site == "positions":

        def positions(module, args, kwargs):
            cache = kwargs.get("past_key_values")
            _fresh(_OFFSETS)[key] = int(cache.get_seq_length(layer)) if cache is not None else 0
            return None

        return positions

    if site == "query" or site == "head_output":

        def heads_hook(z: torch.Tensor, hook: Any) -> torch.Tensor | None:
            slot = ACTIVE.get().get(key)
            edits = slot.get(site) if slot is not None else []
            if not edits:
                return None
            offset = _OFFSETS.get().get(key, 0)
            b, t = z.shape[0], z.shape[1]
            call = AttentionCall(layer, b, n_heads, t, offset + t, offset, z.device)
            return apply_head_edits(cast("list[QueryEdit | HeadOutputEdit]", edits), z, call)

        return heads_hook

    if site == "logits":

        def scores_hook(scores: torch.Tensor, hook: Any) -> torch.Tensor | None:
            slot = ACTIVE.get().get(key)
            if slot is None:
                return None
            biases = cast("list[LogitBias]", slot.get("logits"))
            probs = slot.get("probs")
            if not biases and not probs:
                return None
            b, h, q_len, k_len = scores.shape
            window = slot.window
            if window is not None and q_len < k_len and k_len >= window - 1:
                raise HeadsteerValueError(
                    f"layer {layer} uses sliding-window attention (window {window}) and the sequence reached "
                    f"{k_len} keys: attention edits cannot be placed once the KV cache rolls"
                )
            out = scores
            if biases:
                call = AttentionCall(layer, b, h, q_len, k_len, k_len - q_len, scores.device)
                add = torch.zeros((), device=scores.device)
                for e in biases:
                    e.calls += 1
                    mask = e.head_mask(b, h, scores.device)[:, :, None, None]
                    b_e = e.score_bias(scores.float(), call) if e.reads_scores else e.bias(call)
                    add = add + torch.where(mask, b_e.float(), 0.0)
                out = (scores.float() + add).clamp(min=MIN_LOGIT).to(scores.dtype)
            if probs:
                _fresh(_VISIBLE)[key] = out > MIN_LOGIT / 2
            return out if biases else None

        return scores_hook

    if site == "probs":

        def pattern_hook(probs: torch.Tensor, hook: Any) -> torch.Tensor | None:
            slot = ACTIVE.get().get(key)
            edits = cast("list[ProbEdit]", slot.get("probs") if slot is not None else [])
            if not edits:
                return None
            b, h, q_len, k_len = probs.shape
            visible = _VISIBLE.get()[key]
            call = AttentionCall(layer, b, h, q_len, k_len, k_len - q_len, probs.device)
            p = torch.where(visible, probs.float(), 0.0)
            for e in edits:
                e.calls += 1
                mask = e.head_mask(b, h, probs.device)[:, :, None, None]
                p = torch.where(mask, e.apply(p, call), p)
                p = torch.where(visible, p, 0.0)
            return p.to(probs.dtype)

        return pattern_hook

    if site == "residual":
        inner = residual_hook(key, model, layer)

        def resid_hook(x: torch.Tensor, hook: Any) -> torch.Tensor | None:
            cache = _Offset(_OFFSETS.get().get(key, 0))
            out = inner(None, (x,), {"past_key_values": cache})
            return None if out is None else out[0][0]

        return resid_hook

    raise HeadsteerValueError(f"no TransformerLens hook for site {short_repr(site)}")


class _Offset:
    """Stands in for a KV cache that only reports its length (for the residual hook)."""

    def __init__(self, n: int):
        self.n = n

    def get_seq_length(self, layer: int = 0) -> int:
        return self.n


def tl_add_hook(module: nn.Module, fn: Callable) -> Callable[[], None]:
    """Add `fn` to a TransformerLens hook point; the remover takes out only this hook."""
    handle = cast(Callable, module.add_hook)(fn)

    def remove() -> None:
        handle.hook.remove()
        hooks = cast(list, getattr(module, "fwd_hooks", []))
        if handle in hooks:
            hooks.remove(handle)

    return remove


def tl_hook_specs(model: HeadModel, active: Sequence[Edit]) -> list[HookSpec]:
    """Every hook the active edits need on a TransformerLens bridge: its hook points."""
    sites: dict[tuple[str, int], HookSpec] = {}
    for e in active:
        name = site_of(e).name
        need = [name]
        if name in ("query", "head_output", "residual"):
            need.append("positions")
        if name == "probs":
            need.append("logits")  # records which keys are visible
        for n in need:
            module = hook_point_for(model, n, e.layer)
            register: Callable = pre_register(True) if n == "positions" else tl_add_hook
            sites[(n, e.layer)] = (module, n, e.layer, partial(tl_hook, n), register)
    return list(sites.values())
