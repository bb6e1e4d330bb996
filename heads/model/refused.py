"""The decoder-only families headsteer refuses at load, each with the attention feature its
edit engine does not reproduce (`REFUSED`); `heads.model.families.family_of` raises with it."""

from __future__ import annotations

__all__ = ["REFUSED"]


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
