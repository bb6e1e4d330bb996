"""The TransformerLens backend: a `TransformerBridge`'s hook points carry the engine's sites.

Booting a bridge (TransformerLens 4.x) rewires the Hugging Face model in place: its layers,
attention and projections become bridge components carrying hook points, and the bridge
computes attention itself (the `transformers` attention function is never called). Forwards run
through that rewired module tree (every hook point fires, the user's own hooks included), and
each site is a hook on the hook point of its TransformerLens name (`HookPoint.add_hook`):

| site | hook point (`{l}` the layer) |
|---|---|
| `embed`, `pos_embed` | `hook_embed`, `hook_pos_embed` |
| `residual` | `blocks.{l}.hook_resid_pre` |
| `q`, `k`, `v` | `blocks.{l}.attn.hook_q`, `hook_k`, `hook_v` (KV heads at k / v) |
| `query` | `blocks.{l}.attn.hook_rot_q` (`hook_q` without rotary embeddings) |
| `rot_k` | `blocks.{l}.attn.hook_rot_k` (`hook_k` without rotary embeddings) |
| `logits`, `attn_scores` | `blocks.{l}.attn.hook_attn_scores` |
| `probs` | `blocks.{l}.attn.hook_pattern` |
| `head_output` | `blocks.{l}.attn.hook_z` |
| `attn_out`, `mlp_out` | `blocks.{l}.hook_attn_out`, `blocks.{l}.hook_mlp_out` |
| `resid_mid` | `blocks.{l}.hook_resid_mid`, the block output recomputed at `hook_resid_post` |
| `resid_post` | `blocks.{l}.hook_resid_post` |
| `ln_final.scale`, `ln_final.normalized` | `ln_final.hook_scale`, `ln_final.hook_normalized` |

The bridge's scores already carry the model's mask (masked keys at the fp32 minimum) and any
soft-capping, so a logit bias is added and clamped exactly as the HF engine does; a pattern edit
re-zeroes masked keys. Each call's first absolute position (the KV-cache length) is read by a
forward pre-hook on the block. Not reproduced here, so refused with a `ValueError`: query edits
on a family with QK-norm (the bridge has no hook point after it), and the stream sites of the
post-norm families (`attn_out`, `mlp_out`, `resid_mid`, `*_pre_norm`). Weight processing
(`process_weights`: LayerNorm folding, centering) must be off: a processed bridge is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, ClassVar, cast

import torch
from torch import nn

from heads._util.validation import short_repr
from heads.backends import hf_sites as hs
from heads.backends.base import Placement
from heads.backends.hf import HFBackend, pre_hook
from heads.engine.activations import apply_activation_edits
from heads.engine.edits import AttentionCall, Edit, LogitBias, ProbEdit
from heads.engine.sites import site_of, tl_hook_name
from heads.engine.state import ACTIVE, MIN_LOGIT
from heads.errors import HeadsteerValueError

__all__ = ["TransformerLensBackend", "tl_add_hook"]

# key -> first absolute position of the current call / visible-key mask / pending resid_mid
_OFFSETS: ContextVar[dict[int, int]] = ContextVar("headsteer_tl_offsets", default={})  # noqa: B039
_VISIBLE: ContextVar[dict[int, torch.Tensor]] = ContextVar("headsteer_tl_visible", default={})  # noqa: B039
_MID: ContextVar[dict[int, torch.Tensor]] = ContextVar("headsteer_tl_mid", default={})  # noqa: B039
_ADDED: ContextVar[dict[int, torch.Tensor]] = ContextVar("headsteer_tl_added", default={})  # noqa: B039

_HEAD_SITES = {"q", "k", "v", "query", "rot_k", "head_output"}
_POST_NORM_SITES = {"attn_out", "mlp_out", "resid_mid", "attn_out_pre_norm", "mlp_out_pre_norm"}
_POST_NORM_SITES |= {"ln1_post.scale", "ln2_post.scale"}


def tl_add_hook(module: nn.Module, fn: Callable) -> Callable[[], Callable[[], None]]:
    """An install function adding `fn` to a TransformerLens hook point; the remover takes out only it."""

    def install() -> Callable[[], None]:
        handle = cast(Callable, module.add_hook)(fn)

        def remove() -> None:
            handle.hook.remove()
            hooks = cast(list, getattr(module, "fwd_hooks", []))
            if handle in hooks:
                hooks.remove(handle)

        return remove

    return install


def _edits(key: int, site: str) -> list[Edit]:
    slot = ACTIVE.get().get(key)
    return slot.get(site) if slot is not None else []


def _tensor_hook(key: int, layer: int, n_heads: int, site: str, offset_key: int) -> Callable:
    """`fn(x, hook)` applying `site` edits (per head on axis 2 for the head sites)."""
    axis = 2 if site in _HEAD_SITES else None
    offsets = hs._LAYER_OFFSET if offset_key != key else _OFFSETS

    def hook(x: torch.Tensor, hook: Any) -> torch.Tensor | None:
        edits = _edits(key, site)
        pending = site == "mlp_out" and key in _MID.get()
        if not edits and not pending:
            return None
        y = x
        if edits:
            offset = offsets.get().get(offset_key, 0)
            t = x.shape[1] if x.dim() > 1 else 1
            call = AttentionCall(layer, x.shape[0], n_heads, t, offset + t, offset, x.device)
            y = apply_activation_edits(edits, x, call, head_axis=axis)
        if pending:
            hs.fresh(_ADDED)[key] = y
        if site == "resid_mid" and y is not x:
            hs.fresh(_MID)[key] = y
        return None if y is x else y

    return hook


def _resid_post_hook(key: int, layer: int, n_heads: int) -> Callable:
    inner = _tensor_hook(key, layer, n_heads, "resid_post", key)

    def hook(x: torch.Tensor, hook: Any) -> torch.Tensor | None:
        mid = _MID.get().pop(key, None)
        if mid is not None:
            x = mid + _ADDED.get().pop(key)
        new = inner(x, hook)
        return new if new is not None else (x if mid is not None else None)

    return hook


def _scores_hook(key: int, layer: int) -> Callable:
    def hook(scores: torch.Tensor, hook: Any) -> torch.Tensor | None:
        slot = ACTIVE.get().get(key)
        if slot is None:
            return None
        biases = cast("list[LogitBias]", slot.get("logits"))
        probs, readers = slot.get("probs"), slot.get("attn_scores")
        if not biases and not probs and not readers:
            return None
        b, h, q_len, k_len = scores.shape
        window = slot.window
        if window is not None and q_len < k_len and k_len >= window - 1:
            raise HeadsteerValueError(
                f"layer {layer} uses sliding-window attention (window {window}) and the sequence reached "
                f"{k_len} keys: attention edits cannot be placed once the KV cache rolls"
            )
        out = scores
        call = AttentionCall(layer, b, h, q_len, k_len, k_len - q_len, scores.device)
        if biases:
            add = torch.zeros((), device=scores.device)
            for e in biases:
                e.calls += 1
                mask = e.head_mask(b, h, scores.device)[:, :, None, None]
                b_e = e.score_bias(scores.float(), call) if e.reads_scores else e.bias(call)
                add = add + torch.where(mask, b_e.float(), 0.0)
            out = (scores.float() + add).clamp(min=MIN_LOGIT).to(scores.dtype)
        if readers:
            apply_activation_edits(readers, out.float().clamp(min=MIN_LOGIT), call)
        if probs:
            hs.fresh(_VISIBLE)[key] = out > MIN_LOGIT / 2
        return out if biases else None

    return hook


def _pattern_hook(key: int, layer: int) -> Callable:
    def hook(probs: torch.Tensor, hook: Any) -> torch.Tensor | None:
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

    return hook


def _block_in(key: int, layer: int) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hs.fresh(_OFFSETS)[key] = hs.cache_length(args, kwargs, layer)

    return hook


class TransformerLensBackend(HFBackend):
    """Forwards through a `TransformerBridge`'s rewired module tree; sites on its hook points."""

    kind: ClassVar[str] = "transformer_lens"
    attention_via_hooks: ClassVar[bool] = True

    def __init__(self, module: nn.Module, family: Any, native: object | None = None):
        super().__init__(module, family, native)
        self.bridge: Any = native
        self.check()

    @classmethod
    def detect(cls, obj: object) -> bool:
        return type(obj).__module__.startswith("transformer_lens") and hasattr(obj, "original_model")

    @classmethod
    def unwrap(cls, obj: object) -> tuple[nn.Module, Any]:
        bridge: Any = obj
        return bridge.original_model, getattr(bridge, "tokenizer", None)

    def check(self) -> None:
        """ValueError once the bridge's weights were processed (LayerNorm folding, centering)."""
        if getattr(self.bridge, "_weights_processed", False):
            raise HeadsteerValueError(
                "this TransformerBridge has processed weights (process_weights(): LayerNorm folding / "
                "centering), so its weights and logits are no longer the model's own; boot it without "
                "process_weights() to use it with headsteer"
            )

    def run(self, **inputs: Any) -> Any:
        self.check()
        return super().run(**inputs)

    def generate(self, **inputs: Any) -> Any:
        self.check()
        return super().generate(**inputs)

    def hook_point(self, name: str) -> nn.Module:
        """The bridge's hook point `name` (e.g. `blocks.3.attn.hook_pattern`).

        Raises:
            ValueError: the bridge has no such hook point (the edit needing it cannot run here).
        """
        obj: Any = self.bridge
        for part in name.split("."):
            obj = (
                obj[int(part)]
                if part.isascii() and part.isdigit() and len(part) <= 6 and isinstance(obj, nn.ModuleList)
                else getattr(obj, part, None)
            )
            if obj is None:
                break
        if not isinstance(obj, nn.Module) or not hasattr(obj, "add_hook"):
            raise HeadsteerValueError(
                f"the TransformerLens bridge has no hook point {name}; this edit cannot run on the "
                "transformer_lens backend for this model"
            )
        return obj

    def _tl(self, name: str, fn: Callable) -> Placement:
        point = self.hook_point(name)
        return Placement((id(point), name), tl_add_hook(point, fn))

    def _site_placements(self, e: Edit) -> list[Placement]:
        site, layer, parts, fam = site_of(e), e.layer, self.parts, self.family
        name, key, n_heads = site.name, self._key(e.layer), parts.n_heads
        block = self.bridge.blocks[layer]
        positions = Placement(
            (id(block), "positions"), pre_hook(block, _block_in(key, layer), with_kwargs=True)
        )
        if name in _POST_NORM_SITES and fam.attn_out_norm is not None:
            raise HeadsteerValueError(
                f"site {name!r} on a post-norm family ({short_repr(fam.model_type)}) is not placed on the "
                "transformer_lens backend; use the hf or nnsight backend"
            )
        self._check_stream(name)
        if name in ("embed", "pos_embed", "ln_final.scale", "ln_final.normalized"):
            if name == "pos_embed":
                parts.pos_embed  # noqa: B018  (ValueError for rotary families: the bridge aliases the rotary module)
            dec = parts.decoder
            fn = _tensor_hook(key, 0, n_heads, name, id(dec))
            return [self._model_in(), self._tl(tl_hook_name(name, 0), fn)]
        if name in ("query", "rot_k"):
            what = "queries" if name == "query" else "keys"
            if fam.qk_norm != "none":
                raise HeadsteerValueError(
                    f"{short_repr(fam.model_type)} normalises {what} per head (QK-norm): the bridge has no "
                    f"hook point after it, so {name!r} edits cannot run on the transformer_lens backend"
                )
            fn = _tensor_hook(key, layer, n_heads, name, key)
            rot, plain = ("hook_rot_q", "hook_q") if name == "query" else ("hook_rot_k", "hook_k")
            try:
                return [positions, self._tl(f"blocks.{layer}.attn.{rot}", fn)]
            except HeadsteerValueError:  # no rotary embeddings
                return [positions, self._tl(f"blocks.{layer}.attn.{plain}", fn)]
        if name in ("logits", "attn_scores"):
            return [self._tl(f"blocks.{layer}.attn.hook_attn_scores", _scores_hook(key, layer))]
        if name == "probs":
            return [
                self._tl(f"blocks.{layer}.attn.hook_attn_scores", _scores_hook(key, layer)),
                self._tl(f"blocks.{layer}.attn.hook_pattern", _pattern_hook(key, layer)),
            ]
        if name == "resid_mid":
            if self._parallel():
                raise HeadsteerValueError(
                    f"site 'resid_mid': model_type {short_repr(fam.model_type)} runs attention and MLP in "
                    "parallel on the same input, so there is no stream between them"
                )
            return [
                positions,
                self._tl(tl_hook_name("resid_mid", layer), _tensor_hook(key, layer, n_heads, name, key)),
                self._tl(tl_hook_name("mlp_out", layer), _tensor_hook(key, layer, n_heads, "mlp_out", key)),
                self._tl(tl_hook_name("resid_post", layer), _resid_post_hook(key, layer, n_heads)),
            ]
        if name == "resid_post":
            return [positions, self._tl(tl_hook_name(name, layer), _resid_post_hook(key, layer, n_heads))]
        if name in ("ln1.scale", "ln2.scale", "ln1_post.scale", "ln2_post.scale"):
            prefix = name.split(".")[0]
            parts.norm(layer, prefix)  # ValueError for a norm the family lacks
            if prefix == "ln2" and fam.attn_norm == fam.mlp_norm:
                raise HeadsteerValueError(
                    f"site 'ln2.scale': model_type {short_repr(fam.model_type)} feeds attention and MLP "
                    "from one norm (use ln1.scale)"
                )
        if name in ("attn_out_pre_norm", "mlp_out_pre_norm", "ln1_post.scale", "ln2_post.scale"):
            raise HeadsteerValueError(
                f"site {name!r}: model_type {short_repr(fam.model_type)} has no norm on the sub-layer output"
            )
        return [positions, self._tl(tl_hook_name(name, layer), _tensor_hook(key, layer, n_heads, name, key))]

    def placements(self, active: Sequence[Edit]) -> list[Placement]:
        """Every hook the active edits need on the bridge (its hook points), each once."""
        return super().placements(active)
