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
is `heads.scorers.circuits.graph`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel

__all__ = ["ATTN_NORMS", "Graph", "attn_norm", "check_family", "first_patched_layer", "graph_of"]

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


@dataclass(frozen=True)
class Graph:
    """The node / edge layout of a model with L layers, H query heads and G KV heads.

    Attributes:
        n_layers: L.
        n_heads: H.
        n_kv_heads: G.
        model: the model name (recorded in saved circuits).
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    model: str = ""

    # ---------------------------------------------------------------- sizes and indices
    @property
    def per_layer(self) -> int:
        """S = H + 2 G + 1 downstream inputs per layer."""
        return self.n_heads + 2 * self.n_kv_heads + 1

    @property
    def n_upstream(self) -> int:
        """U = 1 + L (H + 1) nodes that write to the residual stream."""
        return 1 + self.n_layers * (self.n_heads + 1)

    @property
    def n_downstream(self) -> int:
        """Dn = L S + 1 inputs that read it."""
        return self.n_layers * self.per_layer + 1

    def head_node(self, layer: int, head: int) -> int:
        return 1 + layer * (self.n_heads + 1) + head

    def mlp_node(self, layer: int) -> int:
        return 1 + layer * (self.n_heads + 1) + self.n_heads

    def q_input(self, layer: int, head: int) -> int:
        return layer * self.per_layer + head

    def k_input(self, layer: int, kv: int) -> int:
        return layer * self.per_layer + self.n_heads + kv

    def v_input(self, layer: int, kv: int) -> int:
        return layer * self.per_layer + self.n_heads + self.n_kv_heads + kv

    def mlp_input(self, layer: int) -> int:
        return layer * self.per_layer + self.n_heads + 2 * self.n_kv_heads

    @property
    def logits_input(self) -> int:
        return self.n_layers * self.per_layer

    def n_before(self) -> torch.Tensor:
        """`[Dn]` long: how many upstream nodes precede each downstream input (its possible sources)."""
        H, S = self.n_heads, self.per_layer
        out = torch.empty(self.n_downstream, dtype=torch.long)
        for la in range(self.n_layers):
            out[la * S : (la + 1) * S - 1] = 1 + la * (H + 1)
            out[la * S + S - 1] = 1 + la * (H + 1) + H
        out[-1] = self.n_upstream
        return out

    @property
    def valid(self) -> torch.Tensor:
        """`[U, Dn]` bool: the edges of the graph (u upstream of v)."""
        return torch.arange(self.n_upstream)[:, None] < self.n_before()[None, :]

    @property
    def n_edges(self) -> int:
        return int(self.valid.sum())

    # ---------------------------------------------------------------- names
    def upstream_names(self) -> list[str]:
        names = ["input"]
        for la in range(self.n_layers):
            names += [f"a{la}.h{h}" for h in range(self.n_heads)] + [f"m{la}"]
        return names

    def downstream_names(self) -> list[str]:
        H, G = self.n_heads, self.n_kv_heads
        names: list[str] = []
        for la in range(self.n_layers):
            names += [f"a{la}.h{h}<q>" for h in range(H)]
            kv = "h" if G == H else "g"
            names += [f"a{la}.{kv}{g}<k>" for g in range(G)] + [f"a{la}.{kv}{g}<v>" for g in range(G)]
            names.append(f"m{la}")
        return [*names, "logits"]

    def edge_names(self, index: torch.Tensor) -> list[str]:
        """Names `"u->v"` of edges `index [E, 2]` (upstream, downstream)."""
        up, down = self.upstream_names(), self.downstream_names()
        return [f"{up[u]}->{down[d]}" for u, d in index.tolist()]

    def parse_edge(self, name: str) -> tuple[int, int]:
        """`(u, v)` of an edge name `"a0.h1->m2"`.

        Raises:
            ValueError: an unknown node name or a pair that is not an edge.
        """
        if not isinstance(name, str) or "->" not in name:
            raise HeadsteerValueError(f"edge name must look like 'a0.h1->m2', got {short_repr(name)}")
        a, b = name.split("->", 1)
        up, down = self.upstream_names(), self.downstream_names()
        if a not in up or b not in down:
            raise HeadsteerValueError(f"edge {short_repr(name)} names a node this graph does not have")
        u, d = up.index(a), down.index(b)
        if not bool(self.valid[u, d]):
            raise HeadsteerValueError(f"{short_repr(name)} is not an edge: {a} is not upstream of {b}")
        return u, d

    # ---------------------------------------------------------------- node maps
    def upstream_layer(self) -> torch.Tensor:
        """`[U]` the layer of each upstream node (-1 for input)."""
        out = torch.full((self.n_upstream,), -1, dtype=torch.long)
        for la in range(self.n_layers):
            s = 1 + la * (self.n_heads + 1)
            out[s : s + self.n_heads + 1] = la
        return out

    def down_to_node(self) -> torch.Tensor:
        """`[Dn, U + 1]` bool: which nodes each downstream input belongs to (column U = logits);
        a KV input belongs to every query head of its group."""
        H, G = self.n_heads, self.n_kv_heads
        m = torch.zeros(self.n_downstream, self.n_upstream + 1, dtype=torch.bool)
        grp = H // G
        for la in range(self.n_layers):
            for h in range(H):
                m[self.q_input(la, h), self.head_node(la, h)] = True
                m[self.k_input(la, h // grp), self.head_node(la, h)] = True
                m[self.v_input(la, h // grp), self.head_node(la, h)] = True
            m[self.mlp_input(la), self.mlp_node(la)] = True
        m[self.logits_input, self.n_upstream] = True
        return m

    def check_model(self, model: HeadModel) -> None:
        """ValueError when `model`'s geometry is not this graph's."""
        got = (model.n_layers, model.n_heads, model.n_kv_heads)
        want = (self.n_layers, self.n_heads, self.n_kv_heads)
        if got != want:
            raise HeadsteerValueError(
                f"the circuit is for (n_layers, n_heads, n_kv_heads) = {want}, the model has {got}"
            )


def graph_of(model: HeadModel) -> Graph:
    """The `Graph` of `model` (refuses families it cannot decompose, see `check_family`)."""
    check_family(model)
    return Graph(model.n_layers, model.n_heads, model.n_kv_heads, model.name)


def first_patched_layer(graph: Graph, patch: torch.Tensor) -> int:
    """The lowest layer with a patched input in `patch [R, U, Dn]` (L: only the logits or nothing)."""
    down = torch.nonzero(patch.any(dim=0).any(dim=0))
    return graph.n_layers if len(down) == 0 else int(down[0, 0]) // graph.per_layer
