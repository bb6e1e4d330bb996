"""Tiny random-weight models of every family in `heads.model.families.FAMILIES`
(configs in code, no download)."""

from __future__ import annotations

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


def _tiny_config(kind: str):
    import transformers as tf

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
    raise ValueError(kind)


TINY = sorted(set(FAMILIES) - {"qwen2_vl_text"})  # qwen2_vl_text is reached through qwen2_vl
SDPA_REFUSES = {"gemma2"}  # transformers' own SDPA path raises on soft-capping
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
