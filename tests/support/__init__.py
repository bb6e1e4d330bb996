"""Shared test helpers: test edits and tiny random models built from configs (no download)."""

from __future__ import annotations

import torch

from heads import HeadModel, ProbEdit

VOCAB = 49152  # the embedded tokenizer's vocabulary, so tiny models read real text


class Identity(ProbEdit):
    """Test edit: returns the pattern unchanged (forces the eager path)."""

    def apply(self, probs, call):
        return probs


class ZeroRow(ProbEdit):
    """Test edit: zero the whole attention row of the chosen heads."""

    def apply(self, probs, call):
        return torch.zeros_like(probs)


def _config(kind: str):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if kind == "llama":  # GQA 4:2
        return LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            **common,
        )
    if kind == "qwen2":  # GQA 4:2, head_dim * n_heads != hidden_size
        return Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            max_position_embeddings=512,
            **common,
        )
    if kind == "mistral":
        return MistralConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=512,
            sliding_window=None,
            **common,
        )
    if kind == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)
    raise ValueError(kind)


def make_tiny(kind: str, tokenizer, attn: str = "sdpa", seed: int = 0, **overrides) -> HeadModel:
    """A tiny random model of `kind`; `overrides` set config fields (e.g. sliding_window)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _config(kind)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn).eval()
    return HeadModel(model, tokenizer, name=f"tiny-{kind}")
