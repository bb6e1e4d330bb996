"""Tiny random-weight models of every family in `heads.model.families.FAMILIES`
(configs in code, no download)."""

from __future__ import annotations

from functools import cache

import torch

from heads import HeadModel
from heads.model.families import FAMILIES

N_VOCAB = 300
TEXT = dict(
    vocab_size=N_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
WINDOW = 6  # sliding-window size of the tiny sliding families: shorter than the prompts
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


MOE = dict(
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_k=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
)
MLA = dict(  # DeepSeek's `head_dim` is the rotary part of a query / key head
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    head_dim=8,
    v_head_dim=16,
    num_key_value_heads=4,
)
# model_type -> config fields beyond TEXT (only what the family needs to be tiny or to show its feature)
EXTRA: dict[str, dict] = {
    "mixtral": dict(MOE, sliding_window=WINDOW),
    "phimoe": dict(MOE, sliding_window=WINDOW),
    "starcoder2": dict(sliding_window=WINDOW),
    "ministral3": dict(sliding_window=WINDOW),
    "ministral": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "cwm": dict(sliding_window=WINDOW),
    "smollm3": dict(no_rope_layers=[1, 0]),
    "qwen2_moe": dict(MOE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3_moe": dict(MOE),
    "olmoe": dict(MOE),
    "flex_olmo": dict(MOE),
    "aria_text": dict(MOE),
    "ernie4_5_moe": dict(MOE, moe_num_shared_experts=1),
    "exaone_moe": dict(MOE, num_shared_experts=1),
    "exaone4": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "olmo3": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "granitemoe": dict(MOE),
    "granitemoeshared": dict(MOE),
    "hunyuan_v1_moe": dict(MOE),
    "minimax_m2": dict(MOE),
    "mellum": dict(MOE),
    "glm4_moe": dict(MOE, first_k_dense_replace=1),
    "cohere2": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "cohere2_moe": dict(MOE, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "vaultgemma": dict(
        attn_logit_softcapping=2.0,
        initializer_range=0.3,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "llama4_text": dict(
        MOE,
        intermediate_size_mlp=96,
        attention_chunk_size=WINDOW,
        no_rope_layers=[1, 0],
        interleave_moe_layer_step=1,
    ),
    "gpt_oss": dict(MOE, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "flint": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "deepseek_v2": dict(MOE, **MLA, first_k_dense_replace=1),
    "deepseek_v3": dict(MOE, **MLA, first_k_dense_replace=1),
    "glm4_moe_lite": dict(MOE, **MLA, first_k_dense_replace=1),
    "minicpm3": dict(MLA),
    "youtu": dict(MLA),
    "stablelm": dict(use_parallel_residual=True, qk_layernorm=False),
    "phi": dict(num_key_value_heads=2),
    "gpt_neox": dict(num_key_value_heads=None, head_dim=None),
    "persimmon": dict(qk_layernorm=True, head_dim=None),
    "opt": dict(ffn_dim=96, word_embed_proj_dim=64, head_dim=None),
    "biogpt": dict(head_dim=None),
    "gpt_bigcode": dict(n_positions=128, multi_query=True),
}
ALIASES = {"gpt-sw3": "gpt2"}  # model types that run another family's modules


def _generic_config(kind: str):
    from transformers import CONFIG_MAPPING

    fields = {k: v for k, v in {**TEXT, **EXTRA.get(kind, {})}.items() if v is not None}
    return CONFIG_MAPPING[kind](**fields)


def _tiny_config(kind: str):
    import transformers as tf
    from transformers import CONFIG_MAPPING

    if kind == "llama":
        return tf.LlamaConfig(**TEXT)
    if kind == "mistral":
        return tf.MistralConfig(**TEXT, sliding_window=WINDOW)
    if kind == "qwen2":  # layer 0 full, layer 1 sliding
        return tf.Qwen2Config(**TEXT, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if kind == "gemma":
        return tf.GemmaConfig(**TEXT)
    if kind == "phi3":  # fused qkv_proj with GQA widths
        return tf.Phi3Config(**TEXT, sliding_window=WINDOW)
    if kind == "gpt2":
        return tf.GPT2Config(
            vocab_size=N_VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            bos_token_id=1,
            eos_token_id=2,
        )
    if kind == "gemma2":  # the example: soft-capping at 2.0
        # weights large enough that the logits reach the cap
        return tf.Gemma2Config(
            **TEXT, attn_logit_softcapping=2.0, sliding_window=WINDOW, initializer_range=0.3
        )
    if kind == "gemma3_text":
        return tf.Gemma3TextConfig(
            **TEXT, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
        )
    if kind == "qwen3":
        return tf.Qwen3Config(**TEXT)
    if kind == "olmo2":
        return tf.Olmo2Config(**TEXT)
    if kind == "qwen2_vl_text":
        return tf.Qwen2VLConfig(
            text_config=dict(TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            vision_config=dict(
                depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4, spatial_merge_size=2
            ),
            image_token_id=5,
            video_token_id=6,
            vision_start_token_id=7,
        )
    vision = dict(image_size=32, patch_size=8, **VISION)
    if kind == "llava":
        return tf.LlavaConfig(
            text_config=tf.LlamaConfig(**TEXT), vision_config=tf.CLIPVisionConfig(**vision), image_token_id=5
        )
    if kind == "qwen2_vl":
        return _tiny_config("qwen2_vl_text")
    if kind == "idefics3":
        return tf.Idefics3Config(
            text_config=tf.LlamaConfig(**TEXT), vision_config=vision, image_token_id=5, scale_factor=2
        )
    if kind == "smolvlm":
        return tf.SmolVLMConfig(
            text_config=tf.LlamaConfig(**TEXT), vision_config=vision, image_token_id=5, scale_factor=2
        )
    if kind == "gemma3":
        return tf.Gemma3Config(
            text_config=dict(
                TEXT, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
            ),
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_index=5,
        )
    if kind in ALIASES:
        cfg = _tiny_config(ALIASES[kind])
        cls = CONFIG_MAPPING[kind]
        return cls(**cfg.to_diff_dict())
    return _generic_config(kind)


CORE = ("llama", "mistral", "qwen2", "gemma", "phi3", "gpt2", "gemma2", "gemma3_text", "qwen3", "olmo2")
VLM = ("llava", "qwen2_vl", "idefics3", "smolvlm", "gemma3")
# the families tests/heads/test_families.py checks in depth (the family matrix,
# tests/heads/test_family_matrix.py, walks every entry of FAMILIES)
TINY = sorted(CORE + VLM)
SDPA_REFUSES = {
    k for k, f in FAMILIES.items() if f.attn_implementation == "eager"
}  # transformers refuses SDPA
CASES = [(k, a) for k in TINY for a in ("eager", "sdpa") if not (a == "sdpa" and k in SDPA_REFUSES)]


def tiny_family_model(kind: str, attn: str = "eager", seed: int = 0, **overrides) -> HeadModel:
    """A tiny random fp32 model of family `kind` (a VLM for the vision-language entries)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    cfg = _tiny_config(kind)
    target = getattr(cfg, "text_config", None) or cfg
    for key, value in overrides.items():
        setattr(target, key, value)
    auto = AutoModelForImageTextToText if hasattr(cfg, "text_config") else AutoModelForCausalLM
    model = auto.from_config(cfg, dtype=torch.float32, attn_implementation=attn).eval()
    return HeadModel(model, None, name=f"tiny-{kind}")


@cache
def shared_family_model(kind: str, attn: str = "eager", long: bool = False) -> HeadModel:
    """`tiny_family_model(kind, attn)` built once per session, shared by tests/heads/test_families.py
    and tests/heads/test_family_matrix.py (read-only users: a test that changes weights builds
    its own). `long`: windows and chunks of 64 keys, so that a KV cache keeps absolute positions
    over a short generation."""
    if long:
        return tiny_family_model(kind, attn, sliding_window=64, attention_chunk_size=64)
    return tiny_family_model(kind, attn)


def family_inputs(seq: int = 12, pad: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of random text tokens (no image / special ids); row 1 left-padded by `pad`."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(10, N_VOCAB, (2, seq), generator=g)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, mask
