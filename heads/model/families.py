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
   family whose modules sit where Llama's do, else `Family(...)` (its fields are documented in
   `heads/model/family_schema.py`); only the fields that differ from the Llama defaults need a
   value. A config flag the engine cannot reproduce goes in `unsupported` so that such a model
   is refused at load.
3. If the family's config needs fields beyond the shared tiny ones (experts, latent ranks, a
   window), add them to `EXTRA` in `tests/support/families.py`: the family matrix
   (`tests/heads/test_family_matrix.py`) then checks the family on a tiny random model
   (recorder read-only on eager and SDPA, PASTA's closed form, UA ablation, cache, padding).
4. Or, when the engine cannot reproduce it, add it to `REFUSED` (`heads/model/refused.py`) with
   the missing feature, and regenerate the support page (`python docs/scripts/gen_families.py`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, TypedDict

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.model.family_schema import FEATURES, Family
from heads.model.refused import REFUSED

__all__ = ["FAMILIES", "FEATURES", "REFUSED", "Family", "family_of", "supported_model_types"]


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
