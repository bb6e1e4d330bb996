"""The Hugging Face backend: forwards call the `transformers` model; the sites are torch hooks on
its modules and headsteer's attention function (`heads.engine.attention`, registered in
`transformers`' `AttentionInterface` and `AttentionMaskInterface`).

Where each site goes (module paths from the family table, `heads.model.parts`):

| site | placement |
|---|---|
| `query`, `logits`, `probs`, `attn_scores` | the attention function (`_attn_implementation` switched) |
| `embed` / `pos_embed` | forward hook on the token / position embedding |
| `residual` | forward pre-hook on the block (also records the call's first position) |
| `q`, `k`, `v` | forward hook on `q_proj` / `k_proj` / `v_proj` (or the fused QKV, sliced) |
| `head_output` | forward pre-hook on `o_proj` |
| `attn_out` | forward hook on the post-attention norm (post-norm families), else the attention |
| `attn_out_pre_norm` | forward hook on the attention (post-norm families only) |
| `resid_mid` | forward pre-hook on the MLP's norm (or the MLP), the block's output recomputed |
| `mlp_out` | forward hook on the post-MLP norm (post-norm families), else the MLP |
| `mlp_out_pre_norm` | forward hook on the MLP (post-norm families only) |
| `resid_post` | forward hook on the block |
| `ln1.scale`, `ln2.scale`, `ln1_post.scale`, `ln2_post.scale` | forward hook on that norm |
| `ln_final.*` | forward hook on the final norm |

Clean-prefix reuse (`layer_skip`) puts a dispatching `forward` on the skipped blocks while any
thread uses it: the calling thread's forwards skip them, every other thread runs them as usual.
`attention_replaced` does the same for attention modules whose output is given (path patching
freezes every head above the sender: their attention need not run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, ClassVar

import torch
from torch import nn

from heads._util.validation import short_repr
from heads.backends import hf_sites as hs
from heads.backends.base import Backend, Placement
from heads.engine.attention import BASES, registered_name
from heads.engine.edits import Edit
from heads.engine.sites import site_of
from heads.errors import HeadsteerValueError
from heads.model.parts import unwrap

__all__ = ["HFBackend", "forward_hook", "pre_hook"]


def pre_hook(
    module: nn.Module, fn: Callable, *, with_kwargs: bool = False
) -> Callable[[], Callable[[], None]]:
    """An install function adding a forward pre-hook (its remover removes only it)."""
    return lambda: module.register_forward_pre_hook(fn, with_kwargs=with_kwargs).remove


def forward_hook(module: nn.Module, fn: Callable) -> Callable[[], Callable[[], None]]:
    """An install function adding a forward hook."""
    return lambda: module.register_forward_hook(fn).remove


def _residual_multiplier(config: object) -> float | None:
    """The factor a family multiplies each sub-layer's output by before adding it to the stream
    (Granite, HyperCLOVA X: `residual_multiplier`; MiniCPM3: `scale_depth / sqrt(n_layers)`)."""
    value = getattr(config, "residual_multiplier", None)
    depth = getattr(config, "scale_depth", None)
    if depth is not None:
        value = float(depth) / float(getattr(config, "num_hidden_layers", 1)) ** 0.5
    return None if value in (None, 1, 1.0) else float(value)


# id(block) -> the residual to feed it (the last skipped block) or None (pass the input through)
_SKIP: ContextVar[dict[int, torch.Tensor | None]] = ContextVar("headsteer_layer_skip", default={})  # noqa: B039


def _skip_wrapper(block: nn.Module) -> Callable[[], Callable[[], None]]:
    """Install a dispatching `forward` on `block`: this thread's `layer_skip` entry, else the block's
    own forward (the class's, or one accelerate put on the instance)."""

    def install() -> Callable[[], None]:
        saved = block.__dict__.get("forward")
        own = saved if saved is not None else type(block).forward.__get__(block)
        me = id(block)

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            plan = _SKIP.get()
            if me not in plan:
                return own(*args, **kwargs)
            hidden = args[0] if args else kwargs["hidden_states"]
            residual = plan[me]
            if residual is None:
                return hidden
            if hidden.shape != residual.shape:
                want, got = tuple(residual.shape), tuple(hidden.shape)
                raise HeadsteerValueError(f"cached residual {want} does not match the batch {got}")
            return residual.to(hidden.device, hidden.dtype)

        block.forward = dispatch

        def remove() -> None:
            if saved is None:
                del block.forward  # the class method shows through again
            else:
                block.forward = saved

        return remove

    return install


# id(attention module) -> the output it returns instead of running (`attention_replaced`)
_ATTN: ContextVar[dict[int, torch.Tensor]] = ContextVar("headsteer_attention_out", default={})  # noqa: B039


def _attention_wrapper(attn: nn.Module) -> Callable[[], Callable[[], None]]:
    """Install a dispatching `forward` on an attention module: this thread's `attention_replaced`
    entry (returned as `(output, None)`, as the decoder blocks unpack it, without computing the
    attention), else the module's own forward."""

    def install() -> Callable[[], None]:
        saved = attn.__dict__.get("forward")
        own = saved if saved is not None else type(attn).forward.__get__(attn)
        me = id(attn)

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            out = _ATTN.get().get(me)
            if out is None:
                return own(*args, **kwargs)
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.shape[:-1] != out.shape[:-1]:
                want, got = tuple(out.shape), tuple(hidden.shape)
                raise HeadsteerValueError(f"attention output {want} does not match the batch {got}")
            return out.to(hidden.device, hidden.dtype), None

        attn.forward = dispatch

        def remove() -> None:
            if saved is None:
                del attn.forward
            else:
                attn.forward = saved

        return remove

    return install


class HFBackend(Backend):
    """The Hugging Face backend (see the module docstring)."""

    kind: ClassVar[str] = "hf"

    @classmethod
    def detect(cls, obj: object) -> bool:
        return isinstance(obj, nn.Module) and hasattr(obj, "config")

    @classmethod
    def unwrap(cls, obj: object) -> tuple[nn.Module, Any]:
        return obj, None  # type: ignore[return-value]

    # ---------------------------------------------------------------- placements
    def _key(self, layer: int) -> int:
        return id(self.parts.attentions[layer])

    def _switch(self) -> list[Placement]:
        """Switch every attention config to headsteer's attention function (refused for a base
        other than `sdpa` / `eager`, before anything changes)."""
        out = []
        seen: dict[int, Any] = {}
        for a in self.parts.attentions:
            cfg = getattr(unwrap(a), "config", None) or getattr(self.module, "config", None)
            seen.setdefault(id(cfg), cfg)
        for cfg in seen.values():
            base = cfg._attn_implementation
            if base not in BASES and base not in {registered_name(b) for b in BASES}:
                raise HeadsteerValueError(
                    f"attention backend {short_repr(base)} is not supported for attention edits; load the "
                    "model with attn_implementation='sdpa' or 'eager'"
                )

            def install(cfg: Any = cfg) -> Callable[[], None]:
                base = cfg._attn_implementation
                cfg._attn_implementation_internal = registered_name(base)
                return lambda: setattr(cfg, "_attn_implementation_internal", base)

            out.append(Placement(("attn_impl", id(cfg)), install))
        return out

    def _layer_in(self, layer: int) -> Placement:
        block = self.parts.layers[layer]
        fn = hs.layer_in(self._key(layer), layer, self.parts)
        return Placement((id(block), "layer_in"), pre_hook(block, fn, with_kwargs=True))

    def _attention_in(self, layer: int) -> Placement:
        attn = self.parts.attentions[layer]
        fn = hs.attention_in(self._key(layer), layer)
        return Placement((id(attn), "attention_in"), pre_hook(attn, fn, with_kwargs=True))

    def _model_in(self) -> Placement:
        dec = self.parts.decoder
        return Placement((id(dec), "model_in"), pre_hook(dec, hs.model_in(id(dec)), with_kwargs=True))

    def _out(self, module: nn.Module, layer: int, site: str, tag: str | None = None) -> Placement:
        fn = hs.stream_out(self._key(layer), layer, self.parts, site)
        return Placement((id(module), tag or site), forward_hook(module, fn))

    def _check_stream(self, site: str) -> None:
        mult = _residual_multiplier(self.parts.config)
        if mult is not None and site in (
            "attn_out",
            "resid_mid",
            "mlp_out",
            "attn_out_pre_norm",
            "mlp_out_pre_norm",
        ):
            raise HeadsteerValueError(
                f"site {site!r}: model_type {short_repr(self.family.model_type)} scales each sub-layer's "
                "output "
                f"by residual_multiplier={mult:g} before adding it, which this site does not reproduce"
            )

    def _parallel(self) -> bool:
        fam, cfg = self.family, self.parts.config
        if fam.model_type in ("gpt_neox", "stablelm"):  # parallel or not by the config
            return bool(getattr(cfg, "use_parallel_residual", fam.model_type == "gpt_neox"))
        return "parallel_block" in fam.features

    def _mlp_added_module(self, layer: int) -> nn.Module:
        fam = self.family
        if fam.mlp_out_norm is not None:
            return self.parts.part(layer, fam.mlp_out_norm, "post-MLP norm")
        return self.parts.mlp(layer)

    def _site_placements(self, e: Edit) -> list[Placement]:
        site, layer, parts, fam = site_of(e), e.layer, self.parts, self.family
        name, key = site.name, self._key(e.layer)
        self._check_stream(name)
        if site.attention:
            return [*self._switch(), self._attention_in(layer)]
        if name == "head_output":
            o = parts.out_projs[layer]
            return [
                self._attention_in(layer),
                Placement((id(o), name), pre_hook(o, hs.heads_in(key, layer, parts))),
            ]
        if name == "residual":
            return [self._layer_in(layer)]
        if name in ("embed", "pos_embed", "ln_final.scale", "ln_final.normalized"):
            dec = parts.decoder
            if name.startswith("ln_final"):
                norm = parts.final_norm
                fn = hs.norm_out(key, parts, id(dec))
                return [self._model_in(), Placement((id(norm), "ln_final"), forward_hook(norm, fn))]
            module = parts.embed if name == "embed" else parts.pos_embed
            fn = hs.stream_out(key, 0, parts, name, offset_key=id(dec))
            return [self._model_in(), Placement((id(module), name), forward_hook(module, fn))]
        need = [self._layer_in(layer)]
        if name in ("ln1.scale", "ln2.scale", "ln1_post.scale", "ln2_post.scale"):
            prefix = name.split(".")[0]
            norm = parts.norm(layer, prefix)
            if prefix == "ln2" and fam.attn_norm == fam.mlp_norm:
                raise HeadsteerValueError(
                    f"site 'ln2.scale': model_type {short_repr(fam.model_type)} feeds attention and MLP from "
                    "one norm (use ln1.scale)"
                )
            fn = hs.norm_out(key, parts, key, prefix, layer)
            return [*need, Placement((id(norm), prefix), forward_hook(norm, fn))]
        if name in ("q", "k", "v"):
            proj = parts.projection(layer, name)
            which = ("q", "k", "v") if fam.fused_qkv else (name,)
            fn = hs.qkv_out(key, layer, parts, which)
            return [*need, Placement((id(proj), "qkv"), forward_hook(proj, fn))]
        if name in ("attn_out", "attn_out_pre_norm"):
            if fam.attn_out_norm is None and name == "attn_out_pre_norm":
                raise HeadsteerValueError(
                    f"site 'attn_out_pre_norm': model_type {short_repr(fam.model_type)} has no norm on the "
                    "attention output (use attn_out)"
                )
            post = name == "attn_out" and fam.attn_out_norm is not None
            module = (
                parts.part(layer, fam.attn_out_norm, "post-attention norm")
                if post
                else parts.attentions[layer]
            )
            return [*need, self._out(module, layer, name)]
        if name in ("mlp_out", "mlp_out_pre_norm"):
            if fam.mlp_out_norm is None and name == "mlp_out_pre_norm":
                raise HeadsteerValueError(
                    f"site 'mlp_out_pre_norm': model_type {short_repr(fam.model_type)} has no norm on the "
                    "MLP output (use mlp_out)"
                )
            module = self._mlp_added_module(layer) if name == "mlp_out" else parts.mlp(layer)
            fn = hs.mlp_added(key, layer, parts, name)
            return [*need, Placement((id(module), name), forward_hook(module, fn))]
        if name == "resid_mid":
            if self._parallel():
                raise HeadsteerValueError(
                    f"site 'resid_mid': model_type {short_repr(fam.model_type)} runs attention and MLP in "
                    "parallel on the same input, so there is no stream between them"
                )
            target = parts.mlp_norm(layer) or parts.mlp(layer)
            added = self._mlp_added_module(layer)
            block = parts.layers[layer]
            return [
                *need,
                Placement(
                    (id(target), "resid_mid"),
                    pre_hook(target, hs.resid_mid(key, layer, parts), with_kwargs=True),
                ),
                Placement(
                    (id(added), "mlp_out"), forward_hook(added, hs.mlp_added(key, layer, parts, "mlp_out"))
                ),
                Placement((id(block), "resid_post"), forward_hook(block, hs.resid_post(key, layer, parts))),
            ]
        if name == "resid_post":
            block = parts.layers[layer]
            return [
                *need,
                Placement((id(block), name), forward_hook(block, hs.resid_post(key, layer, parts))),
            ]
        raise HeadsteerValueError(f"the {self.kind} backend has no placement for site {short_repr(name)}")

    def placements(self, active: Sequence[Edit]) -> list[Placement]:
        """Every hook and switch the active edits need on this model, each once."""
        out: dict[Any, Placement] = {}
        for e in active:
            for p in self._site_placements(e):
                out.setdefault(p.key, p)
        return list(out.values())

    # ---------------------------------------------------------------- attention outputs given
    def attention_placements(self, layers: Sequence[int]) -> list[Placement]:
        """The dispatching wrappers `attention_replaced` needs on the attention of `layers`."""
        return [
            Placement(
                (id(self.parts.attentions[la]), "attention_out"),
                _attention_wrapper(self.parts.attentions[la]),
            )
            for la in layers
        ]

    @contextlib.contextmanager
    def attention_replaced(self, outputs: dict[int, torch.Tensor]) -> Iterator[None]:
        """This thread's forwards do not compute the attention of the layers in `outputs`: each
        returns its `[B, T, D]` tensor (the wrappers must be installed: `attention_placements`)."""
        plan = {**_ATTN.get(), **{id(self.parts.attentions[la]): out for la, out in outputs.items()}}
        token = _ATTN.set(plan)
        try:
            yield
        finally:
            _ATTN.reset(token)

    # ---------------------------------------------------------------- prefix reuse
    def skip_placements(self, layer: int) -> list[Placement]:
        """The dispatching wrappers `layer_skip` needs on blocks `0 .. layer - 1`."""
        return [Placement((id(b), "skip"), _skip_wrapper(b)) for b in self.parts.layers[:layer]]

    @contextlib.contextmanager
    def layer_skip(self, layer: int, residual: torch.Tensor) -> Iterator[None]:
        """This thread's forwards skip blocks `< layer`: blocks `0 .. layer-2` pass their input
        through, block `layer-1` returns `residual` (the wrappers must be installed:
        `skip_placements`)."""
        blocks = self.parts.layers[:layer]
        plan: dict[int, torch.Tensor | None] = {**_SKIP.get(), **{id(b): None for b in blocks[:-1]}}
        plan[id(blocks[-1])] = residual
        token = _SKIP.set(plan)
        try:
            yield
        finally:
            _SKIP.reset(token)
