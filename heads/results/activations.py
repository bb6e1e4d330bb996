"""`ActivationCache`: the activations of one forward, keyed by TransformerLens hook names.

Built by `heads.record` (`heads.engine.hooks.record`); the methods follow TransformerLens'
`ActivationCache` (same names, arguments and semantics where they apply): `accumulated_resid`,
`decompose_resid`, `stack_head_results`, `apply_ln_to_stack`. Every tensor has the batch first,
as TransformerLens gives it; `blocks.{l}.attn.hook_k` / `hook_v` keep the KV heads (`[B, T, G,
d]`) under grouped-query attention, as the bridge does.

Where it differs from a TransformerLens cache on the same weights:

* the rows of left padding: `hook_pattern` is all zero there (TransformerLens: uniform);
* `hook_pos_embed` exists only for learned absolute positions (GPT-2, OPT); a TransformerLens
  bridge of a rotary model names its rotary table so;
* `hook_attn_scores` holds the scores as the engine computes them in fp32 (masked keys at the
  fp32 minimum, as the bridge's).
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, Sequence, ValuesView
from typing import TYPE_CHECKING

import torch

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.model.parts import centred, norm_stats

if TYPE_CHECKING:
    from heads.model.adapter import HeadModel

__all__ = ["ActivationCache", "PosSlice", "act_name"]

PosSlice = int | slice | Sequence[int] | torch.Tensor | None
"""Positions to keep (TransformerLens' `pos_slice`): an int (the dimension is kept), a slice, a
list of ints or an index tensor; None keeps them all."""

_SHORT = {
    "embed": "hook_embed",
    "pos_embed": "hook_pos_embed",
    "resid_pre": "blocks.{l}.hook_resid_pre",
    "resid_mid": "blocks.{l}.hook_resid_mid",
    "resid_post": "blocks.{l}.hook_resid_post",
    "attn_out": "blocks.{l}.hook_attn_out",
    "mlp_out": "blocks.{l}.hook_mlp_out",
    "q": "blocks.{l}.attn.hook_q",
    "k": "blocks.{l}.attn.hook_k",
    "v": "blocks.{l}.attn.hook_v",
    "rot_q": "blocks.{l}.attn.hook_rot_q",
    "z": "blocks.{l}.attn.hook_z",
    "pattern": "blocks.{l}.attn.hook_pattern",
    "attn_scores": "blocks.{l}.attn.hook_attn_scores",
    "scale": "ln_final.hook_scale",
    "ln1_scale": "blocks.{l}.ln1.hook_scale",
    "ln2_scale": "blocks.{l}.ln2.hook_scale",
    "normalized": "ln_final.hook_normalized",
}


def act_name(name: str, layer: int | None = None) -> str:
    """The full hook name of a short one (TransformerLens' `utils.get_act_name`): `("resid_pre", 3)`
    -> `blocks.3.hook_resid_pre`; a full name is returned as it is."""
    template = _SHORT.get(name)
    if template is None:
        return name
    if "{l}" in template:
        if layer is None:
            raise HeadsteerValueError(f"{short_repr(name)} needs a layer, e.g. ({name!r}, 0)")
        return template.replace("{l}", str(int(layer)))
    return template


def _pos(x: torch.Tensor, pos_slice: PosSlice, dim: int) -> torch.Tensor:
    if pos_slice is None:
        return x
    if isinstance(pos_slice, int):
        return x.narrow(dim, pos_slice % x.shape[dim], 1).squeeze(dim)
    if isinstance(pos_slice, slice):
        index = [slice(None)] * x.dim()
        index[dim] = pos_slice
        return x[tuple(index)]
    idx = torch.as_tensor(pos_slice, device=x.device)
    return x.index_select(dim % x.dim(), idx)


class ActivationCache:
    """A mapping of TransformerLens hook name -> tensor (batch first), plus the decompositions.

    Args:
        cache: the recorded tensors by hook name.
        model: the `HeadModel` they come from (its weights and norms for the methods).

    `cache["blocks.3.hook_resid_pre"]`, `cache["resid_pre", 3]` (short name and layer, as in
    TransformerLens) and `"blocks.3.hook_resid_pre" in cache` work; `keys()`, `values()`,
    `items()`, `len()` and iteration go over the names.

    Raises:
        KeyError: a name that was not recorded (the message lists what was).
    """

    def __init__(self, cache: dict[str, torch.Tensor], model: HeadModel):
        self.cache_dict = dict(cache)
        self.model = model
        self.logits: torch.Tensor | None = None  # the forward's logits [B, T, V] (set by `record`)

    # ------------------------------------------------------------------ mapping
    def __getitem__(self, key: str | tuple) -> torch.Tensor:
        name = act_name(*key) if isinstance(key, tuple) else act_name(key)
        if name not in self.cache_dict:
            shown = ", ".join(sorted(self.cache_dict)[:8])
            raise KeyError(f"{name!r} was not recorded (names= decides what is kept); recorded: {shown}, ...")
        return self.cache_dict[name]

    def __contains__(self, key: object) -> bool:
        return (
            isinstance(key, str | tuple)
            and (act_name(*key) if isinstance(key, tuple) else key) in self.cache_dict
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self.cache_dict)

    def __len__(self) -> int:
        return len(self.cache_dict)

    def keys(self) -> KeysView[str]:
        return self.cache_dict.keys()

    def values(self) -> ValuesView[torch.Tensor]:
        return self.cache_dict.values()

    def items(self) -> ItemsView[str, torch.Tensor]:
        return self.cache_dict.items()

    def to(self, device: str | torch.device) -> ActivationCache:
        """A cache with every tensor on `device`."""
        return ActivationCache({k: v.to(device) for k, v in self.cache_dict.items()}, self.model)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations of {self.model.name!r})"

    def _layers(self, layer: int | None) -> int:
        n = self.model.n_layers
        if layer is None or layer == -1:
            return n
        if not 0 <= layer <= n:
            raise HeadsteerValueError(f"layer must be 0..{n} (or None / -1 for all), got {short_repr(layer)}")
        return int(layer)

    # ------------------------------------------------------------------ decompositions
    def apply_ln_to_stack(
        self,
        residual_stack: torch.Tensor,
        layer: int | None = None,
        mlp_input: bool = False,
        pos_slice: PosSlice = None,
        batch_slice: PosSlice = None,
        has_batch_dim: bool = True,
        recompute_ln: bool = False,
    ) -> torch.Tensor:
        """Scale a stack of residual components `[..., B, T, D]` as the norm read by `layer` scales
        their sum (`layer` None or `n_layers`: the final norm; else block `layer`'s `ln1`, or its
        `ln2` with `mlp_input`): centred (LayerNorm), divided by that norm's `hook_scale` `[B, T,
        1]` (recorded, or computed from the stream it reads); the norm's weight and bias are not
        applied (as TransformerLens). The scale is the run's own (frozen), so the scaled
        components add up to the normalised stream. `recompute_ln=True` at the final layer
        instead applies the final norm itself (weight and bias included) to each component with
        its own statistics (the logit lens; TransformerLens' `accumulated_resid(apply_ln=True)`
        at the final layer does this).

        Raises:
            ValueError: `mlp_input` at the final layer; a norm the family does not have.
        """
        n = self.model.n_layers
        layer = self._layers(layer)
        if layer == n:
            if mlp_input:
                raise HeadsteerValueError("mlp_input applies to a block's input (layer < n_layers)")
            norm, name, stream = self.model.final_norm, "ln_final.hook_scale", ("resid_post", n - 1)
        else:
            which = "ln2" if mlp_input else "ln1"
            norm = self.model.backend.parts.norm(layer, which)
            name, stream = (
                f"blocks.{layer}.{which}.hook_scale",
                ("resid_mid" if mlp_input else "resid_pre", layer),
            )
        if recompute_ln and layer == n:
            return torch.stack([norm(c) for c in residual_stack])
        if centred(norm):
            residual_stack = residual_stack - residual_stack.mean(-1, keepdim=True)
        if name in self.cache_dict:
            scale = self.cache_dict[name]
        else:
            scale = norm_stats(norm, self[stream])[0]
        scale = _pos(scale, pos_slice, -2)
        if has_batch_dim and batch_slice is not None:
            scale = _pos(scale, batch_slice, 0)
        return residual_stack / scale.to(residual_stack.dtype)

    def accumulated_resid(
        self,
        layer: int | None = None,
        incl_mid: bool = False,
        apply_ln: bool = False,
        pos_slice: PosSlice = None,
        mlp_input: bool = False,
        return_labels: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
        """The residual stream before each block up to `layer` `[n, B, T, D]` (`layer` None: every
        block and the final stream, labelled `final_post`); `incl_mid` adds each `resid_mid`,
        `mlp_input` the `resid_mid` of `layer` itself. Labels as TransformerLens (`"3_pre"`,
        `"3_mid"`, `"final_post"`). `apply_ln` at the final layer applies the final norm to each
        stream with its own statistics (the logit lens, as TransformerLens 4)."""
        n = self.model.n_layers
        layer = self._layers(layer)
        parts, labels = [], []
        for la in range(layer + 1):
            if la == n:
                parts.append(self[("resid_post", n - 1)])
                labels.append("final_post")
                continue
            parts.append(self[("resid_pre", la)])
            labels.append(f"{la}_pre")
            if (incl_mid and la < layer) or (mlp_input and la == layer):
                parts.append(self[("resid_mid", la)])
                labels.append(f"{la}_mid")
        stack = torch.stack([_pos(p, pos_slice, -2) for p in parts])
        if apply_ln:  # at the final layer each stream is normalised on its own (the logit lens)
            recompute = layer == n
            stack = self.apply_ln_to_stack(
                stack, layer, pos_slice=pos_slice, mlp_input=mlp_input, recompute_ln=recompute
            )
        return (stack, labels) if return_labels else stack

    def decompose_resid(
        self,
        layer: int | None = None,
        mlp_input: bool = False,
        mode: str = "all",
        apply_ln: bool = False,
        pos_slice: PosSlice = None,
        incl_embeds: bool = True,
        return_labels: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
        """The residual stream entering `layer` as the sum of its parts `[n, B, T, D]`: the
        embeddings (`embed`, `pos_embed` where recorded), then each block's `attn_out` and
        `mlp_out` (`mode`: `"all"`, `"attn"` or `"mlp"`); `mlp_input` adds `layer`'s own
        `attn_out`. Labels as TransformerLens (`"embed"`, `"3_attn_out"`, `"3_mlp_out"`)."""
        if mode not in ("all", "attn", "mlp"):
            raise HeadsteerValueError(f"mode must be 'all', 'attn' or 'mlp', got {short_repr(mode)}")
        layer = self._layers(layer)
        parts, labels = [], []
        if incl_embeds:
            for name, label in (("hook_embed", "embed"), ("hook_pos_embed", "pos_embed")):
                if name in self.cache_dict:
                    parts.append(self.cache_dict[name])
                    labels.append(label)
        for la in range(layer):
            if mode != "mlp":
                parts.append(self[("attn_out", la)])
                labels.append(f"{la}_attn_out")
            if mode != "attn":
                parts.append(self[("mlp_out", la)])
                labels.append(f"{la}_mlp_out")
        if mlp_input and mode != "mlp":
            parts.append(self[("attn_out", layer)])
            labels.append(f"{layer}_attn_out")
        stack = torch.stack([_pos(p, pos_slice, -2) for p in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice, mlp_input=mlp_input)
        return (stack, labels) if return_labels else stack

    def stack_head_results(
        self,
        layer: int = -1,
        return_labels: bool = False,
        incl_remainder: bool = False,
        pos_slice: PosSlice = None,
        apply_ln: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
        """Each head's output in the residual stream, `z[l, h] @ W_O[l, h]` (no `o_proj` bias, as
        TransformerLens' `hook_result`), for the blocks below `layer` `[L' * H, B, T, D]`, labels
        `"L{l}H{h}"`; `incl_remainder` adds `resid_post` of block `layer - 1` minus their sum."""
        layer = self._layers(layer)
        m = self.model
        parts, labels = [], []
        for la in range(layer):
            z = _pos(self[("z", la)], pos_slice, -3)  # [B, T, H, d]
            w_o = m.layer_weights(la)["W_O"].to(z.dtype)  # [H, d, D]
            parts.append(torch.einsum("...hd,hdm->h...m", z, w_o))
            labels += [f"L{la}H{h}" for h in range(m.n_heads)]
        if not parts:
            raise HeadsteerValueError("stack_head_results(layer=0) has no heads below layer 0")
        stack = torch.cat(parts)
        if incl_remainder:
            rest = _pos(self[("resid_post", layer - 1)], pos_slice, -2) - stack.sum(0)
            stack = torch.cat([stack, rest[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack
