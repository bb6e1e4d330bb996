"""The computational graph of a model: its nodes, edges and the families it covers.

Nodes (Conmy et al. 2023; Hanna et al. 2024, Sec. 2): `input` (the residual entering layer
0: token plus position embeddings, scaled as the model scales them), every attention head
`a{l}.h{h}`, every MLP `m{l}` and `logits`. The *upstream* nodes are those that write to the
residual stream (input, heads, MLPs), U = 1 + L (H + 1) of them, indexed

    input = 0,   head (l, h) = 1 + l (H + 1) + h,   MLP l = 1 + l (H + 1) + H.

The *downstream inputs* are what reads the residual stream, Dn = L (H + 2 G + 1) + 1 of them,
indexed with S = H + 2 G + 1 per layer:

    q of head (l, h) = l S + h,   k of KV head (l, g) = l S + H + g,
    v of KV head (l, g) = l S + H + G + g,   MLP l input = l S + H + 2 G,   logits = L S.

Under grouped-query attention (G < H) the keys and values are computed once per KV head, so
edges into k / v go to the KV head `a{l}.g{g}` shared by its group. An edge u -> v exists when
u is upstream of v (`Graph.valid`, `[U, Dn]` bool).

A node's output is what it adds to the residual stream. In the post-norm families (Gemma 2 / 3,
OLMo 2) each sub-layer's output is normalised before it joins the stream; there a head's output
is its share of the normalised attention output with the norm's scale frozen at its value in the
run, per position (`gain * z_h W_O[h] / s`), and an MLP's output is its post-norm's output, so
the shares still add up to the stream exactly (the caveat: a patched edge changes the scale of
its own run, which the shares of that run then use). The decomposed forward that patches edges
is `heads.scorers.circuits.graph`. The `Graph` class (indices, names, pruning) lives with the
circuit results (`heads.results.graph`) and is imported here under the same name.
"""

from __future__ import annotations

import torch
from torch import nn

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.results.graph import Graph

__all__ = [
    "ATTN_NORMS",
    "Graph",
    "attn_norm",
    "check_family",
    "first_patched_layer",
    "graph_of",
    "plan_geometry",
]

ATTN_NORMS = ("input_layernorm", "ln_1")
"""Attribute names of the norm applied to the residual before the attention (Llama-like, GPT-2)."""

_REFUSED_FEATURES = {
    "parallel_block": "attention and MLP read the same residual (parallel block)",
    "latent_attention": "multi-head latent attention has no per-head q/k/v projections",
}


def attn_norm(block: nn.Module) -> nn.Module | None:
    """The norm applied to the residual before block `block`'s attention, or None."""
    for name in ATTN_NORMS:
        m = getattr(block, name, None)
        if isinstance(m, nn.Module):
            return m
    return None


def check_family(model: HeadModel) -> None:
    """Raise a one-line `ValueError` naming the family when its forward is not a sum of node outputs.

    Refused: parallel attention + MLP blocks (GPT-J, GPT-NeoX, Phi, Cohere, StableLM), latent
    attention, fused per-head QKV layouts, MLPs that are not one module, a norm on the MLP
    output without one on the attention output, a post-attention norm after an `o_proj` with a
    bias, sub-layer outputs scaled by a residual multiplier (Granite), vision-language wrappers,
    blocks without a recognised attention norm (unless the family normalises sub-layer outputs
    instead, as OLMo 2), post-norm families on the `transformer_lens` backend (the bridge has no
    hook point for the post-norm's input) and nnsight with `remote=True`.
    """
    fam = model.family
    name = fam.model_type

    def refuse(why: str) -> HeadsteerValueError:
        return HeadsteerValueError(f"circuit graphs do not support model_type {short_repr(name)}: {why}")

    for feat, why in _REFUSED_FEATURES.items():
        if feat in fam.features:
            raise refuse(why)
    if fam.mlp is None:
        raise refuse("its MLP is not one module")
    post = fam.attn_out_norm is not None
    if fam.mlp_out_norm is not None and not post:
        raise refuse("a norm on the MLP output without one on the attention output")
    if fam.fused_qkv and fam.qkv_layout != "blocks":
        raise refuse(f"fused QKV layout {short_repr(fam.qkv_layout)}")
    if fam.vlm is not None:
        raise HeadsteerValueError(
            f"circuit graphs do not support vision-language model {short_repr(fam.vlm)} (text decoders only)"
        )
    cfg = getattr(model.model.config, "text_config", None) or model.model.config
    if getattr(cfg, "residual_multiplier", None) not in (None, 1, 1.0):
        raise refuse("sub-layer outputs are scaled by residual_multiplier before they join the stream")
    if post and getattr(model.out_projs[0], "bias", None) is not None:
        raise refuse("a post-attention norm after an o_proj with a bias (the bias is not a constant share)")
    kind = model.backend.kind
    if kind not in ("hf", "transformer_lens", "nnsight"):
        raise HeadsteerValueError(f"circuit graphs do not run on backend {short_repr(kind)}")
    if post and kind == "transformer_lens":
        raise refuse(
            "the post-norm families need the post-attention norm's input, which the transformer_lens "
            "backend does not place (use the hf or nnsight backend)"
        )
    if getattr(model.backend, "remote", False):
        raise HeadsteerValueError(
            "circuit graphs with nnsight remote=True: the edits and the backward run locally "
            "(use remote=False)"
        )
    if attn_norm(model.layers[0]) is None and not post:
        raise refuse(f"no attention norm among {ATTN_NORMS}")


def graph_of(model: HeadModel) -> Graph:
    """The `Graph` of `model` (refuses families it cannot decompose, see `check_family`)."""
    check_family(model)
    return Graph(model.n_layers, model.n_heads, model.n_kv_heads, model.name)


def plan_geometry(graph: Graph, d_model: int, d_head: int | None = None) -> dict[str, int]:
    """`graph`'s geometry as the memory plans read it (`heads.planning.plan.geometry`'s keys):
    layers, heads, KV heads, `d_head` (default `d_model / H`) and `d_model`."""
    return {
        "n_layers": graph.n_layers,
        "n_heads": graph.n_heads,
        "n_kv_heads": graph.n_kv_heads,
        "d_head": d_head or d_model // graph.n_heads,
        "d_model": d_model,
    }


def first_patched_layer(graph: Graph, patch: torch.Tensor) -> int:
    """The lowest layer with a patched input in `patch [R, U, Dn]` (L: only the logits or nothing)."""
    down = torch.nonzero(patch.any(dim=0).any(dim=0))
    return graph.n_layers if len(down) == 0 else int(down[0, 0]) // graph.per_layer
