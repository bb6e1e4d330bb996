"""The edit engine: applies `heads.edits` to a model inside a context manager.

Attention edits run in headsteer's attention function, registered in
`transformers`' `AttentionInterface` *and* `AttentionMaskInterface` (without the
mask registration the model would silently run with no causal mask). Layers with
no edit take the model's own backend path (SDPA, or eager); an edited layer builds
an additive fp32 mask (causal + padding + the edits' logit biases) and either calls
SDPA with it (bias-only edits) or computes the pattern eagerly so that `ProbEdit`s
and `Recorder`s can see it. Query rows are processed in blocks, so memory grows
linearly with context. Head-output edits run in forward pre-hooks on `o_proj`, query
edits in forward hooks on the q projection (the query slice of a fused QKV); a pre-hook on
the attention module reads the KV cache length so that those edits, like attention edits,
see absolute query positions (`AttentionCall.q_offset`) at prefill and at every decode step.

With `output_attentions=True` inside a context, every layer returns its attention pattern
`[B, H, q, k]` (the edited one where edits act), whatever the base backend (sdpa or eager).

Usage::

    with editing(model, [PastaBias(...), HeadScale(layer=3, heads=[1], factor=0)]):
        logits = model.model(input_ids).logits
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812

from .edits import AttentionCall, Edit, HeadOutputEdit, LogitBias, ProbEdit, QueryEdit
from .model import HeadModel

__all__ = ["QUERY_BLOCK", "EditNeverFired", "editing", "registered_name"]

QUERY_BLOCK = 1024
"""Query rows per block in edited layers (memory is O(QUERY_BLOCK x keys) per head)."""

_MIN = torch.finfo(torch.float32).min


class EditNeverFired(RuntimeError):
    """An edit was installed but the model never ran it (e.g. wrong layer, no forward)."""


@dataclass
class _LayerEdits:
    layer: int
    n_heads: int
    window: int | None = None  # sliding-window size of the layer, if any
    bias: list[LogitBias] = field(default_factory=list)
    probs: list[ProbEdit] = field(default_factory=list)
    outputs: list[HeadOutputEdit] = field(default_factory=list)
    queries: list[QueryEdit] = field(default_factory=list)


# id(attention module) -> its edits; a ContextVar so threads do not see each other's edits.
_ACTIVE: ContextVar[dict[int, _LayerEdits]] = ContextVar("headsteer_active_edits", default={})  # noqa: B039

_BASES = ("sdpa", "eager")


def registered_name(base: str) -> str:
    """Name of headsteer's attention function for a base backend (`sdpa` or `eager`)."""
    return f"headsteer_{base}"


def _causal_additive(q_len: int, k_len: int, q_offset: int, device: torch.device) -> torch.Tensor:
    """`[1, 1, q_len, k_len]` fp32 mask: 0 where key j <= query position, else min."""
    qpos = torch.arange(q_offset, q_offset + q_len, device=device)[:, None]
    kpos = torch.arange(k_len, device=device)[None, :]
    return torch.where(kpos <= qpos, 0.0, _MIN)[None, None]


def _additive(mask: torch.Tensor | None, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """The model's mask as an fp32 additive mask `[B or 1, 1, q_len, k_len]`."""
    if mask is None:
        return _causal_additive(q_len, k_len, k_len - q_len, device)
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, _MIN).to(device)
    return mask.float().clamp(min=_MIN)


def _in_dtype(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 additive mask cast to `dtype` without overflowing to -inf (fp16) or NaN."""
    if dtype == torch.float32:
        return mask
    return mask.clamp(min=torch.finfo(dtype).min).to(dtype)


def _edited_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    edits: _LayerEdits,
    want_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of one edited layer: `([B, q, H, d], probs)`, with `probs` the edited pattern
    `[B, H, q, k]` in the query dtype when `want_probs` (`output_attentions=True`), else None."""
    batch, n_heads, q_len, _ = query.shape
    k_len = key.shape[2]
    groups = n_heads // key.shape[1]
    device = query.device
    head_masks = {
        id(e): e.head_mask(batch, n_heads, device)[:, :, None, None] for e in (*edits.bias, *edits.probs)
    }
    if edits.window is not None and k_len >= edits.window - 1:
        raise ValueError(
            f"layer {edits.layer} uses sliding-window attention (window {edits.window}) and the sequence "
            f"reached {k_len} keys: the KV cache no longer holds absolute positions, so attention edits "
            "cannot be placed; shorten the prompt or edit only full-attention layers"
        )
    for e in (*edits.bias, *edits.probs):
        e.calls += 1
    eager = bool(edits.probs) or want_probs  # compute the pattern (else SDPA with the bias)
    if eager and groups > 1:  # GQA: each query head reads its KV head; K/V are never edited
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    # A single decode row with no padding mask sees every key: no base mask needed.
    base = None if (mask is None and q_len == 1) else _additive(mask, q_len, k_len, device)
    outs, patterns = [], []
    for s in range(0, q_len, QUERY_BLOCK):
        e_ = min(q_len, s + QUERY_BLOCK)
        call = AttentionCall(edits.layer, batch, n_heads, e_ - s, k_len, k_len - q_len + s, device)
        add = base if base is None or base.shape[-2] == 1 else base[..., s:e_, :]
        for ed in edits.bias:
            b = torch.where(head_masks[id(ed)], ed.bias(call).float(), 0.0)
            add = b if add is None else add + b
        if add is None:
            add = _causal_additive(e_ - s, k_len, k_len - q_len + s, device)
        else:
            add = add.clamp(min=_MIN)  # stacked biases on a masked key must not overflow to -inf
        q_blk = query[:, :, s:e_]
        if not eager:
            outs.append(
                F.scaled_dot_product_attention(
                    q_blk,
                    key,
                    value,
                    attn_mask=_in_dtype(add, query.dtype),
                    scale=scaling,
                    enable_gqa=groups > 1,
                )
            )
            continue
        scores = torch.matmul(q_blk.float(), key.float().transpose(-1, -2)) * scaling + add
        visible = add > _MIN / 2
        probs = torch.where(visible, torch.softmax(scores, dim=-1), 0.0)  # fully masked rows: all 0
        for ed in edits.probs:
            probs = torch.where(head_masks[id(ed)], ed.apply(probs, call), probs)
            probs = torch.where(visible, probs, 0.0)  # masked / future keys stay exactly 0
        outs.append(torch.matmul(probs.to(value.dtype), value))
        if want_probs:
            patterns.append(probs.to(query.dtype))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    pattern = (patterns[0] if len(patterns) == 1 else torch.cat(patterns, dim=2)) if want_probs else None
    return out.transpose(1, 2).contiguous(), pattern


def _make_attention(base: str):
    if base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as fallback
    else:
        fallback = None

    def headsteer_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        edits = _ACTIVE.get().get(id(module))
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        # output_attentions=True: every layer returns its (edited) pattern, whatever the base
        config = getattr(module, "config", None)
        want = bool(kw.get("output_attentions", getattr(config, "output_attentions", False)))
        if edits is None or not (edits.bias or edits.probs):
            if fallback is not None and not want:
                return fallback(
                    module,
                    query,
                    key,
                    value,
                    attention_mask,
                    dropout=dropout,
                    scaling=scaling,
                    **kw,
                )
            edits = _LayerEdits(getattr(module, "layer_idx", -1), query.shape[1])
            edits.probs.append(_IDENTITY)
        return _edited_attention(module, query, key, value, attention_mask, scaling, edits, want)

    return headsteer_attention


class _Identity(ProbEdit):
    def apply(self, probs, call):
        return probs


_IDENTITY = _Identity(layer=-1)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    for base, mask_fn in (("sdpa", sdpa_mask), ("eager", eager_mask)):
        name = registered_name(base)
        AttentionInterface.register(name, _make_attention(base))
        AttentionMaskInterface.register(name, mask_fn)


_register()


def _validate(hm: HeadModel, edits: Sequence[Edit]) -> None:
    for e in edits:
        if not isinstance(e, (LogitBias, ProbEdit, HeadOutputEdit, QueryEdit)):
            raise TypeError(f"not a headsteer edit: {e!r}")
        e.validate()
        hm.check_head(e.layer)
        if e.heads is not None:
            for h in e.heads:
                hm.check_head(e.layer, h)
        if e.row_heads is not None and (e.row_heads.ndim != 2 or e.row_heads.shape[1] != hm.n_heads):
            raise ValueError(
                f"row_heads must be [batch, {hm.n_heads}] bool, got shape {tuple(e.row_heads.shape)}"
            )


# Absolute position of the first query row of the running call, per attention module (set by
# a pre-hook on the module from the KV cache; read by the head-output and query hooks). A
# forward runs in one thread, so a thread-local is enough.
_OFFSETS = threading.local()


def _offset_hook(layer: int):
    """Attention-module pre-hook: record the call's first absolute query position (cached keys)."""

    def hook(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        n = 0 if cache is None else int(cache.get_seq_length(layer))
        offsets = getattr(_OFFSETS, "d", None)
        if offsets is None:
            offsets = _OFFSETS.d = {}
        offsets[id(module)] = n

    return hook


def _q_offset(key: int) -> int:
    return getattr(_OFFSETS, "d", {}).get(key, 0)


def _head_edit(
    slot_edits, x: torch.Tensor, layer: int, n_heads: int, d_head: int, q_offset: int = 0
) -> torch.Tensor:
    """Apply per-head edits to `x` `[B, T, n_heads * d_head]` (query rows at absolute positions
    `q_offset ..`); returns the same shape. An edit that does not act on the call is skipped."""
    z = x.reshape(*x.shape[:-1], n_heads, d_head)
    q_len = x.shape[1]
    call = AttentionCall(layer, x.shape[0], n_heads, q_len, q_offset + q_len, q_offset, x.device)
    for e in slot_edits:
        if not e.acts_on(call):
            continue
        e.calls += 1
        mask = e.head_mask(x.shape[0], n_heads, x.device)[:, None, :, None]
        z = torch.where(mask, e.apply(z, call), z)
    return z.reshape(x.shape)


def _output_hook(key: int, n_heads: int, d_head: int):
    """o_proj pre-hook that applies the calling context's head-output edits (none: untouched)."""

    def hook(module, args):
        slot = _ACTIVE.get().get(key)
        if slot is None or not slot.outputs:
            return None
        z = _head_edit(slot.outputs, args[0], slot.layer, n_heads, d_head, _q_offset(key))
        return (z, *args[1:])

    return hook


def _query_hook(key: int, n_heads: int, d_head: int):
    """q_proj forward hook (query slice of a fused QKV projection) applying query edits."""
    width = n_heads * d_head

    def hook(module, args, output):
        slot = _ACTIVE.get().get(key)
        if slot is None or not slot.queries:
            return None
        q = _head_edit(slot.queries, output[..., :width], slot.layer, n_heads, d_head, _q_offset(key))
        return q if output.shape[-1] == width else torch.cat([q, output[..., width:]], dim=-1)

    return hook


# Shared model state, reference-counted across contexts and threads:
# id(config) -> [count, original attn implementation]; id(module) -> [count, hook handle].
_LOCK = threading.Lock()
_SWITCHED: dict[int, list] = {}
_HOOKED: dict[int, list] = {}


def _hook_sites(model: HeadModel, active: Sequence[Edit]) -> list[tuple[torch.nn.Module, str, int]]:
    """(module, kind, layer) for every hook the active edits need."""
    sites = {}
    for e in active:
        if isinstance(e, HeadOutputEdit):
            sites[("out", e.layer)] = (model.out_projs[e.layer], "out", e.layer)
        elif isinstance(e, QueryEdit):
            sites[("q", e.layer)] = (model.q_projs[e.layer], "q", e.layer)
        if isinstance(e, (HeadOutputEdit, QueryEdit)):  # they need the call's absolute positions
            sites[("pos", e.layer)] = (model.attentions[e.layer], "pos", e.layer)
    return list(sites.values())


def _acquire(model: HeadModel, switch: bool, sites) -> None:
    with _LOCK:
        if switch:
            for c in model.attention_configs:  # check all before changing any
                if id(c) not in _SWITCHED and c._attn_implementation not in _BASES:
                    raise ValueError(
                        f"attention backend {c._attn_implementation!r} is not supported for attention "
                        "edits; load the model with attn_implementation='sdpa' or 'eager'"
                    )
            for c in model.attention_configs:
                slot = _SWITCHED.get(id(c))
                if slot is None:
                    base = c._attn_implementation
                    slot = _SWITCHED[id(c)] = [0, base]
                    c._attn_implementation_internal = registered_name(base)
                slot[0] += 1
        for module, kind, layer in sites:
            slot = _HOOKED.get(id(module))
            if slot is None:
                key = id(model.attentions[layer])
                if kind == "out":
                    handle = module.register_forward_pre_hook(_output_hook(key, model.n_heads, model.d_head))
                elif kind == "pos":
                    handle = module.register_forward_pre_hook(_offset_hook(layer), with_kwargs=True)
                else:
                    handle = module.register_forward_hook(_query_hook(key, model.n_heads, model.d_head))
                slot = _HOOKED[id(module)] = [0, handle]
            slot[0] += 1


def _release(model: HeadModel, switch: bool, sites) -> None:
    with _LOCK:
        if switch:
            for c in model.attention_configs:
                slot = _SWITCHED.get(id(c))
                if slot is not None:
                    slot[0] -= 1
                    if slot[0] == 0:
                        c._attn_implementation_internal = slot[1]
                        del _SWITCHED[id(c)]
        for module, _, _ in sites:
            slot = _HOOKED.get(id(module))
            if slot is not None:
                slot[0] -= 1
                if slot[0] == 0:
                    slot[1].remove()
                    del _HOOKED[id(module)]


@contextlib.contextmanager
def editing(
    model: HeadModel, edits: Edit | Sequence[Edit], *, require_fired: bool = True
) -> Iterator[list[Edit]]:
    """Apply `edits` to `model` for the duration of the `with` block.

    Args:
        model: the `HeadModel` to edit.
        edits: one edit or a list: any mix of `LogitBias`, `ProbEdit` (incl.
            `Recorder`), `HeadOutputEdit` and `QueryEdit`. Identity edits (`is_identity()`) are
            skipped, so alpha = 1 / factor = 1 is a bitwise no-op. Contexts nest.
        require_fired: on normal exit, raise `EditNeverFired` if an active edit was
            never run by the model (default True).

    Yields:
        the list of active (non-identity) edits; their `calls` count runs.

    A forward with `output_attentions=True` inside the block returns, for every layer, the
    pattern the model actually used (after the edits; `[B, H, q, k]` in the query dtype, fully
    masked padding rows all 0), also on an SDPA-loaded model (whose unedited layers then take
    the eager path for that call).

    Edits are seen only by the thread (and `contextvars` context) that entered the
    block: another thread running the same model meanwhile gets the unedited model.
    On exit — normal or by exception — the attention backend and every hook are
    restored (when the last context using them exits), so the model's logits are
    bitwise what they were before.

    Raises:
        ValueError: unknown layer/head, a row mask of the wrong shape, a bad edit
            parameter, or a model whose attention backend is neither `sdpa` nor
            `eager` (e.g. FlashAttention-2). Nothing is changed on the model then.
            Also, from the forward pass, an attention edit on a sliding-window
            layer once the sequence reaches the window.
        TypeError: an object that is not an edit.
        EditNeverFired: see `require_fired`.
    """
    if not isinstance(model, HeadModel):
        raise TypeError(f"editing() needs a HeadModel, got {type(model).__name__}")
    edits = [edits] if isinstance(edits, Edit) else list(edits)
    _validate(model, edits)
    active = [e for e in edits if not e.is_identity()]
    switch = any(isinstance(e, (LogitBias, ProbEdit)) for e in active)
    sites = _hook_sites(model, active)

    table: dict[int, _LayerEdits] = {}
    for key, v in _ACTIVE.get().items():  # nested contexts: keep the outer edits
        table[key] = _LayerEdits(
            v.layer, v.n_heads, v.window, list(v.bias), list(v.probs), list(v.outputs), list(v.queries)
        )
    for e in active:
        key = id(model.attentions[e.layer])
        slot = table.setdefault(key, _LayerEdits(e.layer, model.n_heads, model.sliding_window(e.layer)))
        if isinstance(e, LogitBias):
            slot.bias.append(e)
        elif isinstance(e, ProbEdit):
            slot.probs.append(e)
        elif isinstance(e, QueryEdit):
            slot.queries.append(e)
        else:
            slot.outputs.append(e)

    _acquire(model, switch, sites)
    token = _ACTIVE.set(table)
    try:
        yield active
    finally:
        _ACTIVE.reset(token)
        _release(model, switch, sites)
    if require_fired:
        idle = [e for e in active if e.calls == 0]
        if idle:
            raise EditNeverFired(f"these edits never ran: {idle}")
