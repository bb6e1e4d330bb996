"""The edit sites: one `Site` entry per `Edit.site`, and the hooks of the hook sites on a
Hugging Face model (`hf_hook_specs`). A backend with hook points of its own builds its hook
specs itself (`heads.backends`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from torch import nn

from heads._util.validation import short_repr
from heads.engine.edits import (
    AttentionCall,
    Edit,
)
from heads.engine.state import ACTIVE, OFFSETS, apply_head_edits, cast_result
from heads.errors import HeadsteerTypeError

if TYPE_CHECKING:
    from heads.model.adapter import HeadModel


__all__ = [
    "POSITIONS",
    "SITES",
    "HookSpec",
    "Site",
    "call_cache",
    "hf_hook_specs",
    "pre_hook",
    "pre_register",
    "residual_hook",
    "site_of",
]


# ------------------------------------------------------------------------------ hook sites
_CACHE_NAMES = ("past_key_values", "layer_past")
_CACHE_INDEX: dict[type, int | None] = {}


def _cache_index(module: nn.Module) -> int | None:
    """Position of the cache parameter among `module.forward`'s positional arguments, or None."""
    kind = type(module)
    if kind not in _CACHE_INDEX:
        try:
            params = list(inspect.signature(kind.forward).parameters)[1:]  # without self
        except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
            params = []
        _CACHE_INDEX[kind] = next((i for i, p in enumerate(params) if p in _CACHE_NAMES), None)
    return _CACHE_INDEX[kind]


def call_cache(module: nn.Module, args: tuple, kwargs: dict):
    """The KV cache a decoder block or attention module was called with, or None.

    Families name and pass it differently: `past_key_values` as a keyword (most), `layer_past`
    (GPT-NeoX, GPT-BigCode), or positionally (GPT-2's blocks get it as their second argument).
    Reading only the `past_key_values` keyword made every position-aware edit of those families
    start at column 0 after a cache (e.g. a prefix-reusing patch, a cached generation step)."""
    for name in _CACHE_NAMES:
        cache = kwargs.get(name)
        if cache is not None:
            return cache
    i = _cache_index(module)
    return args[i] if i is not None and i < len(args) else None


def _output_hook(key: int, model: HeadModel, layer: int):
    """o_proj pre-hook applying the calling context's head-output edits (none: untouched)."""
    n_heads, d_head = model.n_heads, model.d_head

    def hook(module, args):
        slot = ACTIVE.get().get(key)
        edits = slot.get("head_output") if slot is not None else []
        if not edits:
            return None
        x = args[0]
        offset = OFFSETS.get().get(key, 0)  # absolute position of the call's first row
        b, t = x.shape[0], x.shape[1]
        call = AttentionCall(slot.layer, b, n_heads, t, offset + t, offset, x.device)
        z = apply_head_edits(edits, x.reshape(*x.shape[:-1], n_heads, d_head), call)
        return (z.reshape(x.shape), *args[1:])

    return hook


def _offset_hook(key: int, model: HeadModel, layer: int):
    """Attention-module pre-hook recording the call's first absolute query position (the
    KV-cache length), for hook sites that run after attention (`head_output`)."""

    def hook(module, args, kwargs):
        cache = call_cache(module, args, kwargs)
        offsets = OFFSETS.get()
        if not offsets:  # a fresh dict per context, never the shared default
            offsets = {}
            OFFSETS.set(offsets)
        offsets[key] = int(cache.get_seq_length(layer)) if cache is not None else 0
        return None

    return hook


def residual_hook(key: int, model: HeadModel, layer: int):
    """Decoder-layer pre-hook giving residual edits the hidden state `[B, T, D]` entering it."""
    n_heads = model.n_heads

    def hook(module, args, kwargs):
        slot = ACTIVE.get().get(key)
        edits = slot.get("residual") if slot is not None else []
        if not edits:
            return None
        positional = bool(args)
        x = args[0] if positional else kwargs["hidden_states"]
        cache = call_cache(module, args, kwargs)
        offset = int(cache.get_seq_length(layer)) if cache is not None else 0
        call = AttentionCall(layer, x.shape[0], n_heads, x.shape[1], offset + x.shape[1], offset, x.device)
        for e in edits:
            e.calls += 1
            new = e.apply(x, call)
            if new is not None:  # cast to the stream's dtype and device (a user's fp32 / CPU tensor)
                x = cast_result(e, new, x)
        if positional:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    return hook


@dataclass(frozen=True)
class Site:
    """How the engine installs the edits of one site (see the module docstring).

    Attributes:
        name: the value of `Edit.site` this entry serves.
        attention: applied inside headsteer's attention function (the model's attention
            implementation is switched while such an edit is active).
        pattern_site: the layer must compute its attention itself (logits / probs), not
            call the model's own function.
        module: for a hook site, `(model, layer) -> module` to hook.
        hook: `(key, model, layer) -> hook function`; `key` is the layer's slot in the
            active-edit table (the id of its attention module).
        with_kwargs: register the forward pre-hook with `with_kwargs=True`.
        positions: the hook runs after attention and needs the call's absolute positions:
            the engine also hooks the layer's attention module to record them.
    """

    name: str
    attention: bool = False
    pattern_site: bool = False
    module: Callable[[HeadModel, int], nn.Module] | None = None
    hook: Callable[[int, HeadModel, int], Callable] | None = None
    with_kwargs: bool = False
    positions: bool = False

    def target(self, model: HeadModel, layer: int) -> nn.Module:
        """The module this hook site hooks in `layer` (TypeError for a site without one)."""
        if self.module is None:
            raise HeadsteerTypeError(f"site {short_repr(self.name)} hooks no module")
        return self.module(model, layer)


POSITIONS = Site("positions", module=lambda m, la: m.attentions[la], hook=_offset_hook, with_kwargs=True)
"""Internal companion of the sites with `positions=True` (no edit targets it)."""


SITES: dict[str, Site] = {
    s.name: s
    for s in (
        Site("query", attention=True),
        Site("logits", attention=True, pattern_site=True),
        Site("probs", attention=True, pattern_site=True),
        Site("head_output", module=lambda m, la: m.out_projs[la], hook=_output_hook, positions=True),
        Site("residual", module=lambda m, la: m.layers[la], hook=residual_hook, with_kwargs=True),
    )
}
"""Every edit site, keyed by `Edit.site`."""


def site_of(e: Edit) -> Site:
    """The `SITES` entry of a validated edit (`_validate` checked its `site` is a key)."""
    return SITES[cast(str, e.site)]


def pre_hook(module: nn.Module, fn: Callable, with_kwargs: bool) -> Callable[[], None]:
    return module.register_forward_pre_hook(fn, with_kwargs=with_kwargs).remove


# (module, site name, layer, hook factory (key, model, layer) -> fn, register (module, fn) -> remover)
HookSpec = tuple[nn.Module, str, int, Callable[[int, "HeadModel", int], Callable], Callable]


def hf_hook_specs(model: HeadModel, active: Sequence[Edit]) -> list[HookSpec]:
    """Every hook the active edits need on a Hugging Face model (the `hf` and `nnsight` backends)."""
    sites: dict[tuple[str, int], HookSpec] = {}
    for e in active:
        site = site_of(e)
        if site.hook is not None:
            reg = pre_register(site.with_kwargs)
            sites[(site.name, e.layer)] = (site.target(model, e.layer), site.name, e.layer, site.hook, reg)
        if site.positions or site.attention:  # attention edits see real positions (static caches)
            p = POSITIONS
            reg = pre_register(True)
            sites[(p.name, e.layer)] = (
                p.target(model, e.layer),
                p.name,
                e.layer,
                cast(Callable, p.hook),
                reg,
            )
    return list(sites.values())


def pre_register(with_kwargs: bool) -> Callable[[nn.Module, Callable], Callable[[], None]]:
    """A register function adding a forward pre-hook."""
    return lambda module, fn: pre_hook(module, fn, with_kwargs)
