"""The `Family` record: every family-specific fact headsteer relies on, as fields (where a
family keeps its modules, the attention features the edit engine must reproduce), and
`FEATURES`, the attention features an entry may name. The table of entries is
`heads.model.families.FAMILIES`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FEATURES", "Family"]


@dataclass(frozen=True)
class Family:
    """Facts about one model family (one `config.model_type`).

    Paths are dotted attribute paths. `decoder` starts at the loaded top model (the causal
    LM, or the vision-language model); `layers` and `final_norm` start at the decoder;
    `attention`, `mlp`, `mlp_norm`, `mlp_out_norm` at one decoder block; the projections at
    the attention module; `unembed` at the top model.

    Attributes:
        model_type: the `config.model_type` this entry describes.
        decoder: the text decoder stack (`LlamaModel`, GPT-2's `transformer`, a VLM's
            `model.language_model`).
        layers: the `ModuleList` of decoder blocks, `[L]`.
        attention: a block's attention module.
        q_proj: the separate query projection (None with a fused QKV).
        k_proj: the separate key projection (None with a fused QKV).
        v_proj: the separate value projection (None with a fused QKV).
        qkv_proj: a fused projection whose output is Q `[H*d]` | K `[G*d]` | V `[G*d]`
            (GQA widths: G KV heads), or None.
        conv1d: projections store their weight as `[in, out]` (GPT-2 `Conv1D`) rather
            than `nn.Linear`'s `[out, in]`.
        o_proj: the output projection; its input is the heads' outputs `[H*d]`.
        mlp: a block's MLP.
        attn_norm: the norm applied to the residual before the attention, or None (post-norm
            families such as OLMo 2, whose attention reads the raw stream).
        mlp_norm: the norm applied to the residual before the MLP, or None when the MLP
            reads the raw residual (post-norm families such as OLMo 2).
        mlp_out_norm: a norm on the MLP output before it joins the residual, or None.
        attn_out_norm: a norm on the attention output before it joins the residual (post-norm
            families: Gemma 2 / 3, OLMo 2 / 3), or None.
        final_norm: the norm before the unembedding.
        unembed: the LM head `[V, D]`.
        gqa: the family may have fewer KV heads than query heads (`num_key_value_heads`).
        sliding_window: `"none"`; `"all"` (every layer uses `config.sliding_window` when
            set); or `"layer_types"` (the layers whose `config.layer_types` entry is
            `"sliding_attention"`).
        softcap: the config field of attention-logit soft-capping (`c * tanh(s / c)` on the
            scaled logits before the mask), passed to the attention function as `softcap`.
        final_softcap: the config field of soft-capping on the output logits (Gemma 2 / 3,
            NanoChat), applied by the model after the unembedding; None if the family has none.
        logit_scale: `(config field, op)` of a constant the model applies to its output logits:
            `"mul"` (Cohere `logit_scale`, HyperCLOVA X `logits_scaling`), `"div"` (Granite
            `logits_scaling`) or `"div_hidden"` (MiniCPM3: the final normed state divided before
            the unembedding); None if the family has none.
        residual_scale: the decoder block's attribute scaling each sub-layer output before it
            joins the residual stream (Granite / HyperCLOVA X `residual_multiplier`, MiniCPM3
            `residual_scale`); None if the outputs join unscaled.
        qk_norm: `"none"`, `"per_head"` (RMSNorm over each head's `d` features) or
            `"all_heads"` (RMSNorm over the whole `[H*d]` query / `[G*d]` key).
        qk_norm_before_rope: the QK-norm is applied before RoPE (every family here).
        scaling: how the module's attention scale is set (the engine uses the `scaling`
            the module passes; this records the rule).
        eager_variant: `(flag, method)`: when the attention module's boolean attribute
            `flag` is true, the family's eager path is the module's own `method(q, k, v,
            mask)` instead of the module-level `eager_attention_forward` (GPT-2's
            `reorder_and_upcast_attn`).
        bidirectional_images: image tokens attend to each other in both directions
            (the model's mask carries it).
        text_config: vision-language entries only: the sub-config of the text model
            (`"text_config"`); `family_of` then returns the text model's family with this
            entry's `decoder`.
        vlm: set by `family_of` on a resolved vision-language family: the wrapper's
            `model_type`.
        unsupported: `(config field, reason)` pairs: a model whose config has a truthy
            value there is refused at `HeadModel(...)` with the reason.
        qkv_layout: how a fused QKV output is laid out: `"blocks"` (all Q rows, then K, then V:
            Phi-3, GPT-2) or `"per_head"` (head by head, each `[q | k | v]` of `d` rows: GPT-NeoX,
            Persimmon, GPT-BigCode without multi-query).
        head_dim_attr: the attention module's attribute holding the per-head width of the
            `o_proj` input (`head_dim`; GPT-NeoX `head_size`; latent attention `v_head_dim`).
        moe: the MLP is a mixture of experts (a router plus expert MLPs). Attention is
            unchanged; `heads.scorers.maps` runs the block's routed MLP on a batch of rows.
        attn_implementation: the kernel `load_model` picks when the caller names none and the
            family's own SDPA path is refused by `transformers` (soft-capping, learned sinks):
            `"eager"`; None keeps `"sdpa"`.
        features: the attention features the engine reproduces for this family, by name (see
            `FEATURES`); shown in the generated support table.
        attention_only: the family's config may set `intermediate_size: 0`: an attention-only
            model (Elhage et al. 2021; the organism of `headsteer build organism`). Its MLP
            projections then have no rows, so the MLP adds exactly 0 to the residual stream and
            every analysis sees a zero MLP term; the loader refuses `intermediate_size: 0` for
            the other families (their MLPs may carry biases or norms that do not vanish).
    """

    model_type: str
    decoder: str = "model"
    layers: str = "layers"
    attention: str = "self_attn"
    q_proj: str | None = "q_proj"
    k_proj: str | None = "k_proj"
    v_proj: str | None = "v_proj"
    qkv_proj: str | None = None
    conv1d: bool = False
    o_proj: str = "o_proj"
    mlp: str | None = "mlp"
    attn_norm: str | None = "input_layernorm"
    mlp_norm: str | None = "post_attention_layernorm"
    mlp_out_norm: str | None = None
    attn_out_norm: str | None = None
    final_norm: str = "norm"
    unembed: str = "lm_head"
    gqa: bool = True
    sliding_window: str = "none"
    softcap: str | None = None
    final_softcap: str | None = None
    logit_scale: tuple[str, str] | None = None
    residual_scale: str | None = None
    qk_norm: str = "none"
    qk_norm_before_rope: bool = True
    scaling: str = "head_dim ** -0.5"
    eager_variant: tuple[str, str] | None = None
    bidirectional_images: bool = False
    text_config: str | None = None
    vlm: str | None = None
    unsupported: tuple[tuple[str, str], ...] = ()
    qkv_layout: str = "blocks"
    head_dim_attr: str = "head_dim"
    moe: bool = False
    attn_implementation: str | None = None
    features: tuple[str, ...] = ()
    attention_only: bool = False

    @property
    def latent(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): no per-head W_Q/W_K/W_V weights."""
        return "latent_attention" in self.features

    @property
    def fused_qkv(self) -> bool:
        """True when Q, K and V come from one projection (`qkv_proj`)."""
        return self.qkv_proj is not None


FEATURES: dict[str, str] = {
    "gqa": "grouped-query attention (fewer KV heads than query heads)",
    "multi_query": "multi-query attention (one KV head)",
    "sliding_window": "sliding-window attention on some or all layers",
    "softcap": "attention-logit soft-capping",
    "qk_norm": "QK-norm (per head or over all heads)",
    "partial_rotary": "rotary embedding on part of each head's features",
    "parallel_block": "attention and MLP read the same residual (parallel block)",
    "post_norm": "norms on the sub-layer outputs (the MLP reads the raw residual)",
    "nope_layers": "layers without positional encoding",
    "chunked_attention": "chunked local attention layers (Llama 4)",
    "learned_sinks": "learned per-head attention sinks (an extra softmax logit)",
    "latent_attention": "multi-head latent attention (decompressed per-head q/k/v)",
    "gated_output": "a learned gate on each head's output before o_proj",
    "moe": "mixture-of-experts MLP (attention unchanged)",
    "logit_scaling": "non-default attention scale or output-logit scaling",
}
"""Every feature a `Family.features` may name, with what it means."""
