"""The model-family table: every family-specific fact headsteer relies on, in one place.

One frozen `Family` per `transformers` `model_type` holds where a family keeps its decoder
layers, attention and its q/k/v/o projections (or a fused QKV and how it splits), its MLP and
the norms around it, the final norm and the unembedding, and the attention features the edit
engine must reproduce exactly while it stands in for the model's attention function: GQA,
sliding-window layers, attention-logit soft-capping, QK-norm (per head or over all heads,
before RoPE), the scale the module passes, bidirectional attention over image tokens. A
vision-language entry names only where its text model lives and which sub-config describes it;
`family_of` resolves it to the text model's own entry.

The engine reads the attention features from what `transformers` 5.23 hands its attention
function (`scaling`, `softcap`, `sliding_window`, the mask, `module.is_causal`): the table
records them so that a reader sees in one place what each family does, and so that a feature
the engine does not reproduce (`unsupported`) is refused when `HeadModel` is built.

Adding a family
---------------
1. Read `transformers/models/<family>/modeling_<family>.py`: the attention module's
   `forward` (projections, any `q_norm`/`k_norm` and its width, what it passes to
   `attention_interface(...)`) and the decoder layer's `forward` (which norm feeds the MLP).
2. Add one entry to `FAMILIES` below: `_llama_like(model_type, *features, **fields)` for a
   family whose modules sit where Llama's do, else `Family(...)`; only the fields that differ
   from the Llama defaults need a value. A config flag the engine cannot reproduce goes in
   `unsupported` so that such a model is refused at load.
3. If the family's config needs fields beyond the shared tiny ones (experts, latent ranks, a
   window), add them to `EXTRA` in `tests/support/families.py`: the family matrix
   (`tests/heads/test_family_matrix.py`) then checks the family on a tiny random model
   (recorder read-only on eager and SDPA, PASTA's closed form, UA ablation, cache, padding).
4. Or, when the engine cannot reproduce it, add it to `REFUSED` with the missing feature, and
   regenerate the support page (`python docs/scripts/gen_families.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypedDict

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError

__all__ = ["FAMILIES", "FEATURES", "REFUSED", "Family", "family_of", "supported_model_types"]


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
        q_proj, k_proj, v_proj: separate projections (None with a fused QKV).
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


class _GemmaFields(TypedDict):
    """The `Family` fields Gemma 2 and Gemma 3 share."""

    mlp_norm: str
    mlp_out_norm: str
    attn_out_norm: str
    sliding_window: str
    scaling: str
    final_softcap: str


_GEMMA: _GemmaFields = {
    "mlp_norm": "pre_feedforward_layernorm",
    "mlp_out_norm": "post_feedforward_layernorm",
    "attn_out_norm": "post_attention_layernorm",
    "sliding_window": "layer_types",
    "scaling": "query_pre_attn_scalar ** -0.5",
    "final_softcap": "final_logit_softcapping",
}

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


def _llama_like(model_type: str, *features: str, **fields: Any) -> Family:
    """A family whose modules sit where Llama's do (`model.layers[i].self_attn.{q,k,v,o}_proj`).

    `features` are the `FEATURES` it has besides `"gqa"` (which every such family may use);
    `moe` is set when `"moe"` is among them; `fields` are the other `Family` fields that
    differ from the defaults.
    """
    moe = "moe" in features
    return Family(model_type, moe=moe, features=("gqa", *features), **fields)


_POST_NORM: dict = {
    "attn_norm": None,
    "mlp_norm": None,
    "mlp_out_norm": "post_feedforward_layernorm",
    "attn_out_norm": "post_attention_layernorm",
}
_GRANITE: dict = {"logit_scale": ("logits_scaling", "div"), "residual_scale": "residual_multiplier"}
_COHERE_SCALE = ("logit_scale", "mul")
# GPT-2's module names (`transformer.h[i].attn.c_attn` fused q/k/v, `ln_2`, `ln_f`), shared by
# GPT-BigCode
_GPT2_LAYOUT: dict = {
    "decoder": "transformer",
    "layers": "h",
    "attention": "attn",
    "q_proj": None,
    "k_proj": None,
    "v_proj": None,
    "qkv_proj": "c_attn",
    "o_proj": "c_proj",
    "mlp_norm": "ln_2",
    "attn_norm": "ln_1",
    "final_norm": "ln_f",
}

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        _llama_like("llama", attention_only=True),
        _llama_like("mistral", "sliding_window", sliding_window="all"),
        _llama_like("qwen2", "sliding_window", sliding_window="layer_types"),
        _llama_like("qwen2_vl_text", "sliding_window", sliding_window="layer_types"),
        _llama_like("gemma"),
        Family(
            "phi3",
            q_proj=None,
            k_proj=None,
            v_proj=None,
            qkv_proj="qkv_proj",
            sliding_window="all",
            features=("gqa", "sliding_window", "partial_rotary"),
        ),
        Family(
            "gpt2",
            **_GPT2_LAYOUT,
            conv1d=True,
            gqa=False,
            scaling="head_dim ** -0.5 (scale_attn_weights), / (layer + 1) (scale_attn_by_inverse_layer_idx)",
            eager_variant=("reorder_and_upcast_attn", "_upcast_and_reordered_attn"),
            unsupported=(("add_cross_attention", "cross-attention layers"),),
        ),
        _llama_like(
            "gemma2",
            "sliding_window",
            "softcap",
            "post_norm",
            softcap="attn_logit_softcapping",
            attn_implementation="eager",
            **_GEMMA,
        ),
        _llama_like("gemma3_text", "sliding_window", "qk_norm", "post_norm", qk_norm="per_head", **_GEMMA),
        _llama_like("qwen3", "qk_norm", qk_norm="per_head", sliding_window="layer_types"),
        _llama_like("olmo2", "qk_norm", "post_norm", qk_norm="all_heads", **_POST_NORM),
        # ---- more Llama-like decoders: same module paths, features read from what the module passes
        _llama_like("arcee"),
        _llama_like(
            "apertus",
            "qk_norm",
            qk_norm="per_head",
            mlp_norm="feedforward_layernorm",
            attn_norm="attention_layernorm",
        ),
        _llama_like("aria_text", "moe"),
        _llama_like("cwm", "sliding_window", sliding_window="layer_types"),
        _llama_like("ernie4_5"),
        _llama_like("ernie4_5_moe", "moe"),
        _llama_like(
            "exaone4",
            "qk_norm",
            "sliding_window",
            "post_norm",
            qk_norm="per_head",
            sliding_window="layer_types",
            **_POST_NORM,
        ),
        _llama_like(
            "exaone_moe", "qk_norm", "sliding_window", "moe", qk_norm="per_head", sliding_window="layer_types"
        ),
        _llama_like("flex_olmo", "qk_norm", "post_norm", "moe", qk_norm="all_heads", **_POST_NORM),
        _llama_like("glm", "partial_rotary"),
        _llama_like(
            "glm4",
            "partial_rotary",
            mlp_out_norm="post_mlp_layernorm",
            attn_out_norm="post_self_attn_layernorm",
        ),
        _llama_like("glm4_moe", "partial_rotary", "qk_norm", "moe", qk_norm="per_head"),
        _llama_like("granite", "logit_scaling", scaling="attention_multiplier", **_GRANITE),
        _llama_like(
            "granitemoe",
            "logit_scaling",
            "moe",
            scaling="attention_multiplier",
            mlp="block_sparse_moe",
            **_GRANITE,
        ),
        _llama_like(
            "granitemoeshared",
            "logit_scaling",
            "moe",
            scaling="attention_multiplier",
            mlp="block_sparse_moe",
            **_GRANITE,
        ),
        _llama_like("helium"),
        _llama_like("hunyuan_v1_dense", "qk_norm", qk_norm="per_head", qk_norm_before_rope=False),
        _llama_like("hunyuan_v1_moe", "qk_norm", "moe", qk_norm="per_head", qk_norm_before_rope=False),
        _llama_like(
            "hyperclovax",
            "logit_scaling",
            mlp_out_norm="post_norm2",
            attn_out_norm="post_norm1",
            logit_scale=("logits_scaling", "mul"),
            residual_scale="residual_multiplier",
        ),
        _llama_like("internlm3"),
        _llama_like("iquestcoder"),
        _llama_like("jais2"),
        _llama_like("mellum", "qk_norm", "moe", qk_norm="per_head"),
        _llama_like("minimax_m2", "qk_norm", "moe", qk_norm="all_heads"),
        _llama_like("ministral", "sliding_window", sliding_window="layer_types"),
        _llama_like("ministral3", "sliding_window", sliding_window="all"),
        _llama_like("mixtral", "sliding_window", "moe", sliding_window="all"),
        _llama_like("nanochat", "qk_norm", qk_norm="per_head", final_softcap="final_logit_softcapping"),
        _llama_like("nemotron", "partial_rotary"),
        _llama_like("olmo"),
        _llama_like(
            "olmo3",
            "qk_norm",
            "sliding_window",
            "post_norm",
            qk_norm="all_heads",
            sliding_window="layer_types",
            **_POST_NORM,
        ),
        _llama_like("olmoe", "qk_norm", "moe", qk_norm="all_heads"),
        _llama_like("phimoe", "sliding_window", "moe", sliding_window="all"),
        _llama_like("qwen2_moe", "sliding_window", "moe", sliding_window="layer_types"),
        _llama_like(
            "qwen3_moe", "qk_norm", "sliding_window", "moe", qk_norm="per_head", sliding_window="layer_types"
        ),
        _llama_like("seed_oss"),
        _llama_like("smollm3", "nope_layers", "sliding_window", sliding_window="layer_types"),
        _llama_like("stablelm", "partial_rotary", "parallel_block"),
        _llama_like("starcoder2", "sliding_window", sliding_window="all"),
        _llama_like(
            "cohere", "parallel_block", "logit_scaling", mlp_norm="input_layernorm", logit_scale=_COHERE_SCALE
        ),
        _llama_like(
            "cohere2",
            "parallel_block",
            "sliding_window",
            "logit_scaling",
            mlp_norm="input_layernorm",
            sliding_window="layer_types",
            logit_scale=_COHERE_SCALE,
        ),
        _llama_like(
            "cohere2_moe",
            "parallel_block",
            "sliding_window",
            "moe",
            "logit_scaling",
            mlp_norm="input_layernorm",
            sliding_window="layer_types",
            logit_scale=_COHERE_SCALE,
        ),
        _llama_like(
            "vaultgemma",
            "sliding_window",
            "softcap",
            mlp_norm="pre_feedforward_layernorm",
            softcap="attn_logit_softcapping",
            sliding_window="layer_types",
            scaling="query_pre_attn_scalar ** -0.5",
            final_softcap="final_logit_softcapping",
            attn_implementation="eager",
        ),
        _llama_like(
            "llama4_text",
            "chunked_attention",
            "nope_layers",
            "qk_norm",
            "moe",
            mlp="feed_forward",
            qk_norm="per_head",
        ),
        _llama_like(
            "gpt_oss",
            "learned_sinks",
            "sliding_window",
            "moe",
            sliding_window="layer_types",
            attn_implementation="eager",
        ),
        _llama_like(
            "flint",
            "learned_sinks",
            "sliding_window",
            "qk_norm",
            qk_norm="per_head",
            sliding_window="layer_types",
            attn_implementation="eager",
        ),
        _llama_like(
            "deepseek_v2",
            "latent_attention",
            "moe",
            q_proj="q_b_proj",
            k_proj=None,
            v_proj=None,
            head_dim_attr="v_head_dim",
        ),
        _llama_like(
            "deepseek_v3",
            "latent_attention",
            "moe",
            q_proj="q_b_proj",
            k_proj=None,
            v_proj=None,
            head_dim_attr="v_head_dim",
        ),
        _llama_like(
            "glm4_moe_lite",
            "latent_attention",
            "moe",
            q_proj="q_b_proj",
            k_proj=None,
            v_proj=None,
            head_dim_attr="v_head_dim",
        ),
        _llama_like(
            "minicpm3",
            "latent_attention",
            "logit_scaling",
            logit_scale=("logits_scaling", "div_hidden"),
            residual_scale="residual_scale",
            q_proj="q_b_proj",
            k_proj=None,
            v_proj=None,
            head_dim_attr="v_head_dim",
        ),
        _llama_like(
            "youtu",
            "latent_attention",
            q_proj="q_b_proj",
            k_proj=None,
            v_proj=None,
            head_dim_attr="v_head_dim",
        ),
        # ---- other module layouts
        Family(
            "gpt_neox",
            decoder="gpt_neox",
            attention="attention",
            q_proj=None,
            k_proj=None,
            v_proj=None,
            qkv_proj="query_key_value",
            qkv_layout="per_head",
            head_dim_attr="head_size",
            o_proj="dense",
            final_norm="final_layer_norm",
            gqa=False,
            features=("partial_rotary", "parallel_block"),
        ),
        Family(
            "persimmon",
            q_proj=None,
            k_proj=None,
            v_proj=None,
            qkv_proj="query_key_value",
            qkv_layout="per_head",
            o_proj="dense",
            final_norm="final_layernorm",
            gqa=False,
            qk_norm="per_head",
            features=("partial_rotary", "qk_norm"),
        ),
        Family(
            "phi",
            o_proj="dense",
            mlp_norm="input_layernorm",
            final_norm="final_layernorm",
            features=("gqa", "partial_rotary", "parallel_block"),
        ),
        Family(
            "gpt_bigcode",
            **_GPT2_LAYOUT,
            qkv_layout="bigcode",
            features=("multi_query",),
            unsupported=(("add_cross_attention", "cross-attention layers"),),
        ),
        Family(
            "opt",
            decoder="model.decoder",
            o_proj="out_proj",
            mlp=None,
            attn_norm="self_attn_layer_norm",
            mlp_norm="final_layer_norm",
            final_norm="final_layer_norm",
            gqa=False,
        ),
        Family(
            "biogpt",
            decoder="biogpt",
            o_proj="out_proj",
            mlp=None,
            attn_norm="self_attn_layer_norm",
            mlp_norm="final_layer_norm",
            final_norm="layer_norm",
            unembed="output_projection",
            gqa=False,
        ),
        # vision-language models: where the text model lives; its own entry gives the rest
        Family("llava", decoder="model.language_model", text_config="text_config"),
        Family("qwen2_vl", decoder="model.language_model", text_config="text_config"),
        Family("idefics3", decoder="model.text_model", text_config="text_config"),
        Family("smolvlm", decoder="model.text_model", text_config="text_config"),
        Family(
            "gemma3", decoder="model.language_model", text_config="text_config", bidirectional_images=True
        ),
    )
}
FAMILIES["gpt-sw3"] = replace(FAMILIES["gpt2"], model_type="gpt-sw3")
"""Every supported family, keyed by `model_type`."""


_OWN = "computes attention inside its module instead of calling transformers' attention interface"
_HYBRID = "hybrid model: state-space / linear-attention layers between the softmax-attention layers"

REFUSED: dict[str, tuple[str, str]] = {
    # model_type: (missing feature, why)
    "bloom": ("alibi", f"ALiBi position biases; BloomAttention {_OWN}"),
    "mpt": ("alibi", f"ALiBi position biases; MptAttention {_OWN}"),
    "falcon": ("alibi", f"ALiBi / multi-query variants; FalconAttention {_OWN}"),
    "gptj": ("own_attention", f"GPTJAttention {_OWN}"),
    "codegen": ("own_attention", f"CodeGenAttention {_OWN}"),
    "gpt_neo": ("own_attention", f"GPTNeoAttention (local attention layers) {_OWN}"),
    "gpt_neox_japanese": ("own_attention", f"GPTNeoXJapaneseAttention {_OWN}"),
    "openai-gpt": ("own_attention", f"its Attention module {_OWN}"),
    "xglm": ("own_attention", f"XGLMAttention {_OWN}"),
    "cpmant": ("own_attention", f"CpmAntAttention (relative position buckets) {_OWN}"),
    "ctrl": ("own_attention", f"CTRL's MultiHeadAttention {_OWN}"),
    "diffllama": ("differential_attention", "differential attention (two softmax maps subtracted per head)"),
    "doge": ("dynamic_mask_attention", "dynamic mask attention (a learned, input-dependent mask)"),
    "bitnet": (
        "output_sub_norm",
        "a norm over all heads' outputs before o_proj (a head's slice is not its own)",
    ),
    "jetmoe": ("mixture_of_attention", "mixture-of-attention-heads (experts route the query heads)"),
    "deepseek_v32": ("sparse_attention", "DeepSeek sparse attention (a learned indexer selects keys)"),
    "deepseek_v4": ("sparse_attention", "compressed / sparse attention with a learned indexer"),
    "glm_moe_dsa": ("sparse_attention", "DeepSeek sparse attention (a learned indexer selects keys)"),
    "gemma3n_text": ("kv_sharing", "cross-layer KV sharing and AltUp residual streams"),
    "gemma4_text": ("kv_sharing", "cross-layer KV sharing and per-layer inputs"),
    "gemma4_unified_text": ("kv_sharing", "cross-layer KV sharing and per-layer inputs"),
    "granite_swa": (
        "untested",
        "learned sinks with per-layer rotary tables: no tiny model in the matrix yet",
    ),
    "granitemoe_swa": (
        "untested",
        "learned sinks with per-layer rotary tables: no tiny model in the matrix yet",
    ),
    "afmoe": ("gated_output", "a gate on the attention output: no tiny model in the matrix yet"),
    "beam": ("gated_output", "a gate on the attention output: no tiny model in the matrix yet"),
    "laguna": ("gated_output", "a gate on the attention output: no tiny model in the matrix yet"),
    "zaya": ("untested", "fused QKV with QK-norm and residual scales: no tiny model in the matrix yet"),
    "moshi": ("untested", "audio-text decoder with its own rotary module: no tiny model in the matrix yet"),
    "hrm_text": ("recurrent_blocks", "hierarchical recurrent reasoning modules (blocks applied repeatedly)"),
    "modernbert-decoder": ("untested", "local / global attention layers: no tiny model in the matrix yet"),
    "mimo_v2_flash": ("untested", "no tiny model in the matrix yet"),
    "solar_open": ("untested", "no tiny model in the matrix yet"),
    "longcat_flash": ("untested", "zero-compute experts and MLA: no tiny model in the matrix yet"),
    "kolibri1": ("untested", "no tiny model in the matrix yet"),
    "hy_v3": ("untested", "no tiny model in the matrix yet"),
    "hy_v4": ("untested", "no tiny model in the matrix yet"),
    "axk1": ("untested", "no tiny model in the matrix yet"),
    "axk2": ("untested", "no tiny model in the matrix yet"),
    "dots1": ("untested", "no tiny model in the matrix yet"),
    "dots3_note_text": ("untested", "no tiny model in the matrix yet"),
    "inkling_text": ("untested", "no tiny model in the matrix yet"),
    "inkling2_text": ("untested", "mixed sliding / full attention modules: no tiny model in the matrix yet"),
    "minimax_m3_vl_text": ("untested", "no tiny model in the matrix yet"),
    "cohere_compass_text": ("untested", "no tiny model in the matrix yet"),
    "cohere2_vision_text": ("untested", "no tiny model in the matrix yet"),
    "dbrx": ("untested", "fused Wqkv with clipping: no tiny model in the matrix yet"),
    "qwen4_exp_text": ("untested", "no tiny model in the matrix yet"),
    "qwen3_5_moe_text": ("hybrid", _HYBRID),
    # hybrids: refused by name (edits would be allowed only on the softmax layers)
    "bamba": ("hybrid", _HYBRID),
    "bailing_hybrid": ("hybrid", _HYBRID),
    "falcon_h1": ("hybrid", _HYBRID),
    "granitemoehybrid": ("hybrid", _HYBRID),
    "jamba": ("hybrid", _HYBRID),
    "kimi_linear": ("hybrid", _HYBRID),
    "lfm2": ("hybrid", "hybrid model: short convolutions between the softmax-attention layers"),
    "lfm2_moe": ("hybrid", "hybrid model: short convolutions between the softmax-attention layers"),
    "lfm3": ("hybrid", "hybrid model: short convolutions between the softmax-attention layers"),
    "minimax": ("hybrid", "hybrid model: lightning (linear) attention layers between softmax layers"),
    "nemotron_h": ("hybrid", _HYBRID),
    "olmo_hybrid": ("hybrid", _HYBRID),
    "qwen3_next": ("hybrid", "hybrid model: gated DeltaNet (linear attention) layers between softmax layers"),
    "qwen3_5_text": (
        "hybrid",
        "hybrid model: gated DeltaNet (linear attention) layers between softmax layers",
    ),
    "recurrent_gemma": ("hybrid", "hybrid model: RG-LRU recurrent blocks between local-attention layers"),
    "zamba": ("hybrid", _HYBRID),
    "zamba2": ("hybrid", _HYBRID),
}
"""Decoder-only language models refused at load: `model_type -> (missing feature, reason)`."""


def supported_model_types() -> list[str]:
    """The `model_type`s `family_of` accepts, sorted."""
    return sorted(FAMILIES)


def family_of(config: object) -> Family:
    """The `Family` of a `transformers` config (a VLM resolves to its text model's family).

    Args:
        config: a `PretrainedConfig` (its `model_type` is looked up).

    Returns:
        the table entry; for a vision-language model the text model's entry with the
        wrapper's `decoder` path, `vlm` set to the wrapper's `model_type` and its
        `bidirectional_images`.

    Raises:
        ValueError: a `model_type` in `REFUSED` (the message names the missing feature), one
            not in the table (the message names it and lists the supported ones), or a config
            flag the family marks as `unsupported`.
    """
    kind = getattr(config, "model_type", None)
    fam = FAMILIES.get(kind) if isinstance(kind, str) else None
    if fam is None and isinstance(kind, str) and kind in REFUSED:
        feature, reason = REFUSED[kind]
        raise HeadsteerValueError(
            f"model_type {short_repr(kind)} is not supported: headsteer's edit engine does not reproduce its "
            f"attention exactly (missing feature: {feature}: {reason})"
        )
    if fam is None:
        raise HeadsteerValueError(
            f"model_type {short_repr(kind)} is not supported: headsteer reproduces the attention of "
            f"{', '.join(supported_model_types())} exactly; a new family is one entry in "
            "heads/model/families.py"
        )
    if fam.text_config is not None:
        sub = getattr(config, fam.text_config, None)
        if sub is None:
            raise HeadsteerValueError(
                f"model_type {short_repr(kind)}: config has no {short_repr(fam.text_config)}"
            )
        inner = family_of(sub)
        return replace(inner, decoder=fam.decoder, vlm=kind, bidirectional_images=fam.bidirectional_images)
    for flag, reason in fam.unsupported:
        if getattr(config, flag, None):
            raise HeadsteerValueError(
                f"model_type {short_repr(kind)} with {flag}={short_repr(getattr(config, flag))} is not "
                f"supported: the edit engine does not reproduce {reason}"
            )
    return fam
