"""The hook functions that place the engine's sites on a Hugging Face model (`heads.backends.hf`).

Each factory takes the layer's key in the active-edit table (`id` of its attention module), the
layer and the model's parts, and returns a `torch` hook that reads the calling context's edits
(`heads.engine.state.ACTIVE`, a `ContextVar`: another thread sees none) and applies them with
`heads.engine.activations.apply_activation_edits`. With no edit of its site active in the
calling context a hook returns None: the module's own value flows on bit for bit.

Per call, the absolute position of the first row (`AttentionCall.q_offset`, the KV-cache length)
is recorded by a pre-hook on the block (`layer_in`) or on the decoder (`model_in`) and read by
the hooks that run later in the same block.

`resid_mid` (the stream between the attention and the MLP) is not a tensor any module returns:
a replacement goes in as the input of the MLP's norm (or of the MLP when it reads the raw
stream), and the block's output is recomputed as `new_mid + mlp_added`, the same two operands the
block adds (`mlp_added` is what the MLP sub-block adds: the MLP's output, or its post-norm's).
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from heads.engine.activations import apply_activation_edits
from heads.engine.edits import AttentionCall, Edit
from heads.engine.state import ACTIVE, OFFSETS
from heads.errors import HeadsteerValueError
from heads.model.parts import ModelParts, norm_stats

__all__ = ["Hook", "cache_length", "fresh"]

Hook = Callable[..., Any]

# key -> absolute position of the current call's first row, per layer (key = id(attention)) and
# for the model-level sites (key = id(decoder)); key -> replaced resid_mid / the MLP's added value.
_LAYER_OFFSET: ContextVar[dict[int, int]] = ContextVar("headsteer_layer_offsets", default={})  # noqa: B039
_MID: ContextVar[dict[int, torch.Tensor]] = ContextVar("headsteer_resid_mid", default={})  # noqa: B039
_ADDED: ContextVar[dict[int, torch.Tensor]] = ContextVar("headsteer_mlp_added", default={})  # noqa: B039
# key -> (B, T) of the stream entering the block (an MoE block may return its output as [B * T, D])
_SHAPE: ContextVar[dict[int, tuple[int, int]]] = ContextVar("headsteer_stream_shape", default={})  # noqa: B039


def _as_stream(key: int, x: torch.Tensor) -> torch.Tensor:
    """`x` as `[B, T, D]` when a module returned it flattened to `[B * T, D]` (Llama 4's MoE)."""
    shape = _SHAPE.get().get(key)
    if x.dim() == 2 and shape is not None and x.shape[0] == shape[0] * shape[1]:
        return x.view(*shape, x.shape[-1])
    return x


def fresh(var: ContextVar[dict[int, Any]]) -> dict[int, Any]:
    """The context's dict in `var`, made fresh on first use (never the shared default)."""
    d: dict[int, Any] = var.get()
    if not d:
        d = {}
        var.set(d)
    return d


def cache_length(args: tuple, kwargs: dict, layer: int = 0) -> int:
    """Cached positions before this call: the KV cache among a module's arguments, under any
    name (`past_key_values`; `layer_past` in GPT-BigCode's attention; positional as GPT-2's
    blocks take it), else `cache_position[0]`, else 0."""
    cache = kwargs.get("past_key_values")
    if cache is None:
        cache = next((a for a in (*args, *kwargs.values()) if hasattr(a, "get_seq_length")), None)
    if cache is None:
        position = kwargs.get("cache_position")
        return int(position[0]) if isinstance(position, torch.Tensor) and position.numel() else 0
    return int(cache.get_seq_length(layer))


def _edits(key: int, site: str) -> list[Edit]:
    slot = ACTIVE.get().get(key)
    return slot.get(site) if slot is not None else []


def _call(layer: int, x: torch.Tensor, n_heads: int, offset: int) -> AttentionCall:
    t = x.shape[1] if x.dim() > 1 else 1
    return AttentionCall(layer, x.shape[0], n_heads, t, offset + t, offset, x.device)


def _first(output: Any) -> torch.Tensor:
    first: torch.Tensor = output[0] if isinstance(output, tuple) else output
    return first


def _with_first(output: Any, x: torch.Tensor) -> Any:
    return (x, *output[1:]) if isinstance(output, tuple) else x


# ---------------------------------------------------------------------------------- positions
def layer_in(key: int, layer: int, parts: ModelParts) -> Hook:
    """Block pre-hook (`with_kwargs`): records the call's offset, applies `residual` edits to the
    stream entering the block `[B, T, D]`."""
    n_heads = parts.n_heads

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        offset = cache_length(args, kwargs, layer)
        fresh(_LAYER_OFFSET)[key] = offset
        positional = bool(args)
        x = args[0] if positional else kwargs["hidden_states"]
        fresh(_SHAPE)[key] = (x.shape[0], x.shape[1])
        edits = _edits(key, "residual")
        if not edits:
            return None
        x = apply_activation_edits(edits, x, _call(layer, x, n_heads, offset))
        if positional:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    return hook


def model_in(key: int) -> Hook:
    """Decoder pre-hook (`with_kwargs`): the call's offset for the model-level sites."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        fresh(_LAYER_OFFSET)[key] = cache_length(args, kwargs)

    return hook


def attention_in(key: int, layer: int) -> Hook:
    """Attention-module pre-hook (`with_kwargs`): the offset for the attention and `z` sites."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        fresh(OFFSETS)[key] = cache_length(args, kwargs, layer)

    return hook


# ---------------------------------------------------------------------------------- outputs
def stream_out(key: int, layer: int, parts: ModelParts, site: str, offset_key: int | None = None) -> Hook:
    """Forward hook applying `site` edits to a module's output `[B, T, D]` (first element of a
    tuple output). `offset_key`: where the call's offset was recorded (default `key`)."""
    n_heads, where = parts.n_heads, key if offset_key is None else offset_key

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        edits = _edits(key, site)
        if not edits:
            return None
        raw = _first(output)
        x = _as_stream(key, raw)
        offset = _LAYER_OFFSET.get().get(where, 0)
        y = apply_activation_edits(edits, x, _call(layer, x, n_heads, offset))
        return None if y is x else _with_first(output, y.reshape(raw.shape))

    return hook


def mlp_added(key: int, layer: int, parts: ModelParts, site: str) -> Hook:
    """Forward hook on the module whose output the MLP sub-block adds to the stream: `site` edits
    (`mlp_out`, or `mlp_out_pre_norm` on the MLP inside a post-norm), and, while a `resid_mid`
    replacement is pending in this block, the value kept for the block's recomputed output."""
    inner = stream_out(key, layer, parts, site)

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        new = inner(module, args, output)
        if key in _MID.get() and site == "mlp_out":
            fresh(_ADDED)[key] = _as_stream(key, _first(output if new is None else new))
        return new

    return hook


def resid_mid(key: int, layer: int, parts: ModelParts) -> Hook:
    """Pre-hook on the MLP's norm (or the MLP): `resid_mid` edits on its input `[B, T, D]`."""
    n_heads = parts.n_heads

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        edits = _edits(key, "resid_mid")
        if not edits:
            return None
        positional = bool(args)
        name = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs), "hidden_states")
        x = args[0] if positional else kwargs[name]
        y = apply_activation_edits(edits, x, _call(layer, x, n_heads, _LAYER_OFFSET.get().get(key, 0)))
        if y is x:
            return None
        fresh(_MID)[key] = y
        if positional:
            return (y, *args[1:]), kwargs
        return args, {**kwargs, name: y}

    return hook


def resid_post(key: int, layer: int, parts: ModelParts) -> Hook:
    """Block forward hook: the recomputed output after a `resid_mid` replacement, then
    `resid_post` edits on the stream leaving the block `[B, T, D]`."""
    inner = stream_out(key, layer, parts, "resid_post")

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        mid = _MID.get().pop(key, None)
        if mid is not None:
            added = _ADDED.get().pop(key, None)
            if added is None:
                raise HeadsteerValueError(
                    f"layer {layer}: resid_mid was replaced but the MLP's output was not seen; this block "
                    "does not add its MLP output to the stream as the family entry says"
                )
            output = _with_first(output, mid + added)
        new = inner(module, args, output)
        return new if new is not None else (output if mid is not None else None)

    return hook


def heads_in(key: int, layer: int, parts: ModelParts) -> Hook:
    """o_proj pre-hook: `head_output` edits on the heads' outputs `z` `[B, T, H, d]`."""
    n_heads, d_head = parts.n_heads, parts.d_head

    def hook(module: nn.Module, args: tuple) -> Any:
        edits = _edits(key, "head_output")
        if not edits:
            return None
        x = args[0]
        offset = OFFSETS.get().get(key, 0)
        z = x.reshape(*x.shape[:-1], n_heads, d_head)
        z = apply_activation_edits(edits, z, _call(layer, x, n_heads, offset), head_axis=2)
        return (z.reshape(x.shape), *args[1:])

    return hook


def qkv_out(key: int, layer: int, parts: ModelParts, which: tuple[str, ...]) -> Hook:
    """Forward hook on a q / k / v projection (or the fused QKV: `which` all three): edits of
    sites `q` `[B, T, H, d]`, `k` and `v` `[B, T, G, d]` on its output, before QK-norm and RoPE."""
    fam, d = parts.family, parts.d_head
    n = {"q": parts.n_heads, "k": parts.n_kv_heads, "v": parts.n_kv_heads}
    layout = fam.qkv_layout
    if layout == "bigcode":
        layout = "blocks" if getattr(parts.config, "multi_query", False) else "per_head"

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        edits = {w: _edits(key, w) for w in which}
        if not any(edits.values()):
            return None
        y = _first(output)
        b, t = y.shape[0], y.shape[1]
        if len(which) == 1:
            pieces = [y.reshape(b, t, n[which[0]], d)]
        elif layout == "per_head":
            per = y.reshape(b, t, parts.n_heads, 3, d)
            pieces = [per[:, :, :, i] for i in range(3)]
        else:
            split = y.split([n[w] * d for w in which], -1)
            pieces = [p.reshape(b, t, n[w], d) for p, w in zip(split, which, strict=True)]
        offset = _LAYER_OFFSET.get().get(key, 0)
        call = _call(layer, y, parts.n_heads, offset)
        pieces = [
            apply_activation_edits(edits[w], p, call, head_axis=2) for p, w in zip(pieces, which, strict=True)
        ]
        if len(which) == 1:
            new = pieces[0].reshape(y.shape)
        elif layout == "per_head":
            new = torch.stack(pieces, dim=3).reshape(y.shape)
        else:
            new = torch.cat([p.reshape(b, t, -1) for p in pieces], -1)
        return _with_first(output, new)

    return hook


# ---------------------------------------------------------------------------------- the final norm
def norm_out(key: int, parts: ModelParts, offset_key: int, prefix: str = "ln_final", layer: int = 0) -> Hook:
    """Forward hook on a norm (`prefix`: `ln_final`, or a block's `ln1`, `ln2`, `ln1_post`,
    `ln2_post`): `{prefix}.scale` `[B, T, 1]` and `ln_final.normalized` `[B, T, D]` (read only)
    edits. A replaced scale `s'` gives the output `b + (out - b) * s / s'` (the norm's own weight
    and bias, the new denominator)."""
    n_heads = parts.n_heads

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        scales, normals = _edits(key, f"{prefix}.scale"), _edits(key, f"{prefix}.normalized")
        if not scales and not normals:
            return None
        x = args[0]
        scale, normalized = norm_stats(module, x)
        call = _call(layer, x, n_heads, _LAYER_OFFSET.get().get(offset_key, 0))
        apply_activation_edits(normals, normalized, call)  # read only: a replacement raises
        new = apply_activation_edits(scales, scale, call)
        if new is scale:
            return None
        out = _first(output)
        bias = getattr(module, "bias", None)
        b = bias.float() if isinstance(bias, torch.Tensor) else 0.0
        return _with_first(output, (b + (out.float() - b) * (scale / new)).to(out.dtype))

    return hook
