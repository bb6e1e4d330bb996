"""Where a model keeps its parts, read through the family table: a leaf the adapter and the backends share.

`ModelParts(module, family)` resolves, once, every module the engine's sites are placed on (the
decoder blocks, their attention modules and projections, MLPs and the norms around them, the
embeddings, the final norm, the unembedding) and the head geometry read from the real weights.
`heads.model.adapter.HeadModel` and every backend (`heads.backends`) build on it, so the
backends never import the adapter. Inside a TransformerLens bridge the paths lead through the
bridge's components to the Hugging Face modules they wrap (`unwrap`).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.model.families import Family

__all__ = ["ModelParts", "centred", "get_path", "norm_stats", "submodule", "unwrap"]


def get_path(obj: object, dotted: str) -> object:
    """`obj.a.b.c` for `dotted = "a.b.c"` (AttributeError if a part is missing)."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def unwrap(module: nn.Module) -> nn.Module:
    """The HF module inside a TransformerLens bridge component (itself otherwise)."""
    if type(module).__module__.startswith("transformer_lens"):
        inner = getattr(module, "original_component", None)
        if isinstance(inner, nn.Module):
            return inner
    return module


def submodule(obj: object, dotted: str) -> nn.Module:
    """The submodule of `obj` at the dotted path `dotted` (e.g. `"self_attn.q_proj"`, a family-table
    path), unwrapped to the Hugging Face module also inside a TransformerLens bridge.

    Raises:
        AttributeError: a part of the path is missing.
    """
    for part in dotted.split("."):
        obj = unwrap(cast(nn.Module, getattr(obj, part)))
    return cast(nn.Module, obj)


def _weight(module: nn.Module) -> torch.Tensor:
    return cast(torch.Tensor, module.weight)


class ModelParts:
    """The modules and head geometry of one Hugging Face causal LM (or VLM) of `family`.

    Attributes:
        module: the Hugging Face model (`PreTrainedModel`).
        family: its `heads.model.families.Family` entry.
        decoder: as on `HeadModel`.
        layers: as on `HeadModel`.
        attentions: as on `HeadModel` (the modules that run: a bridge's attention components
            inside one).
        out_projs: as on `HeadModel`.
        q_projs: as on `HeadModel`.
        unembed: as on `HeadModel`.
        n_layers: L, read from the weights (as the rest of the geometry).
        n_heads: H.
        n_kv_heads: G.
        d_head: d.
        d_model: D.

    Raises:
        ValueError: the model does not have the modules its family entry names, or an o_proj
            width that is not a multiple of the head width.
    """

    def __init__(self, module: nn.Module, family: Family):
        fam = family
        cfg = getattr(module, "config", None)
        try:
            decoder = submodule(module, fam.decoder)
            layers = [unwrap(b) for b in cast(nn.ModuleList, get_path(decoder, fam.layers))]
            attentions = [cast(nn.Module, get_path(b, fam.attention)) for b in layers]
            out_projs = [submodule(a, fam.o_proj) for a in attentions]
            q_projs = [submodule(a, cast(str, fam.qkv_proj or fam.q_proj)) for a in attentions]
            d_head = getattr(unwrap(attentions[0]), fam.head_dim_attr)
            unembed = submodule(module, fam.unembed)
        except AttributeError as e:
            raise HeadsteerValueError(
                f"model_type {short_repr(getattr(cfg, 'model_type', None))} ({type(module).__name__}) does "
                f"not have the modules its family entry names ({e}); load it with its causal-LM or "
                "image-text-to-text class"
            ) from None
        self.module = module
        self.family = fam
        self.decoder: nn.Module = decoder
        self.layers: list[nn.Module] = layers
        self.attentions: list[nn.Module] = attentions
        self.out_projs: list[nn.Module] = out_projs
        self.q_projs: list[nn.Module] = q_projs
        self.unembed: nn.Module = unembed
        self.d_head = int(cast(int, d_head))
        self.n_layers = len(layers)
        in_o = self.o_weight(0).shape[0]
        if in_o % self.d_head:
            raise HeadsteerValueError(
                f"o_proj input width {in_o} is not a multiple of head_dim {self.d_head}"
            )
        self.n_heads = in_o // self.d_head
        a0 = unwrap(attentions[0])
        self.n_kv_heads = self.n_heads // int(getattr(a0, "num_key_value_groups", 1))
        self.d_model = int(self.o_weight(0).shape[1])

    def o_weight(self, layer: int) -> torch.Tensor:
        """Output projection as `[n_heads * d_head, d_model]` (input rows, output columns)."""
        w = _weight(self.out_projs[layer])
        return w if self.family.conv1d else w.T  # Conv1D stores [in, out]

    @property
    def config(self) -> object:
        """The text model's config (a VLM's `text_config`)."""
        cfg = getattr(self.module, "config", None)
        return getattr(cfg, "text_config", None) or cfg

    def part(self, layer: int, dotted: str | None, what: str) -> nn.Module:
        """The submodule `dotted` of block `layer` (ValueError naming `what` when the family has none)."""
        module = None if dotted is None else getattr(self.layers[layer], dotted.split(".")[0], None)
        if dotted is None or module is None:  # e.g. StableLM's post-attention norm with a parallel block
            raise HeadsteerValueError(f"model_type {short_repr(self.family.model_type)} has no {what}")
        return submodule(self.layers[layer], dotted)

    def mlp(self, layer: int) -> nn.Module:
        """The MLP of block `layer` (ValueError when the family's MLP is not one module)."""
        return self.part(layer, self.family.mlp, "MLP module (fc1 / fc2 sit in the block)")

    def mlp_norm(self, layer: int) -> nn.Module | None:
        """The norm on the MLP's input in block `layer`, or None."""
        name = self.family.mlp_norm
        return None if name is None else submodule(self.layers[layer], name)

    def projection(self, layer: int, which: str) -> nn.Module:
        """`which` in `q`, `k`, `v`: the module whose output holds it (the fused QKV for all three)."""
        fam = self.family
        path = fam.qkv_proj or {"q": fam.q_proj, "k": fam.k_proj, "v": fam.v_proj}[which]
        if path is None or fam.latent:
            raise HeadsteerValueError(
                f"model_type {short_repr(fam.model_type)} has no per-head {which} projection (multi-head "
                "latent attention decompresses it from a low-rank latent)"
            )
        return submodule(self.attentions[layer], path)

    def norm(self, layer: int, which: str) -> nn.Module:
        """A block's norm by its TransformerLens name: `ln1` (before the attention), `ln2` (before
        the MLP), `ln1_post` / `ln2_post` (on the attention / MLP output, post-norm families).

        Raises:
            ValueError: the family has no such norm.
        """
        fam = self.family
        path = {
            "ln1": fam.attn_norm,
            "ln2": fam.mlp_norm,
            "ln1_post": fam.attn_out_norm,
            "ln2_post": fam.mlp_out_norm,
        }[which]
        return self.part(layer, path, f"{which} norm")

    @property
    def final_norm(self) -> nn.Module:
        """The norm applied to the residual stream before the unembedding."""
        return submodule(self.decoder, self.family.final_norm)

    @property
    def embed(self) -> nn.Module:
        """The token embedding (`get_input_embeddings()`)."""
        return unwrap(cast(nn.Module, self.module.get_input_embeddings()))  # type: ignore[operator]

    @property
    def pos_embed(self) -> nn.Module:
        """The learned absolute position embedding (GPT-2 `wpe`, OPT / BioGPT `embed_positions`).

        Raises:
            ValueError: the family has none (rotary or no positional encoding).
        """
        for name in ("wpe", "embed_positions"):
            m = getattr(self.decoder, name, None)
            if isinstance(m, nn.Module):
                return unwrap(m)
        raise HeadsteerValueError(
            f"model_type {short_repr(self.family.model_type)} has no absolute position embedding "
            "(hook_pos_embed exists only for learned absolute positions, e.g. GPT-2)"
        )


def centred(module: nn.Module) -> bool:
    """True for a LayerNorm (it subtracts the mean), False for an RMSNorm (by its class)."""
    name = type(module).__name__.lower()
    return isinstance(module, nn.LayerNorm) or ("layernorm" in name and "rms" not in name)


def norm_stats(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(scale [.., 1], normalized [.., D])` of a norm's input `x`, in fp32 (as TransformerLens'
    `hook_scale` / `hook_normalized`): `scale = sqrt(mean(x_c ** 2) + eps)`, `normalized = x_c /
    scale`, where `x_c` is `x` centred for a LayerNorm and `x` itself for an RMSNorm."""
    x32 = x.float()
    if centred(module):
        x32 = x32 - x32.mean(-1, keepdim=True)
    eps = next(
        (
            getattr(module, a)
            for a in ("eps", "variance_epsilon", "epsilon")
            if getattr(module, a, None) is not None
        ),
        1e-5,
    )
    scale = (x32.pow(2).mean(-1, keepdim=True) + float(eps)).sqrt()
    return scale, x32 / scale
