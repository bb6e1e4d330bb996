"""`HeadModel`: one adapter over a Hugging Face causal LM that exposes its heads.

Everything in headsteer talks to a model through this adapter: geometry
(`n_layers`, `n_heads`, `n_kv_heads`, `d_head`, `d_model`, `d_vocab`), the
attention and output-projection modules of each layer, and head-major weight
views named as in TransformerLens (`W_Q`, `W_K`, `W_V`, `W_O`, `W_E`, `W_U`).
Shapes are read from the real modules' weights, never from
`hidden_size / num_attention_heads`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["HeadModel"]


@dataclass(frozen=True)
class _Layout:
    """Where an architecture keeps its decoder layers and attention projections."""

    layers: str  # dotted path from the causal-LM module to the ModuleList of blocks
    attn: str  # attribute of a block holding the attention module
    out_proj: str  # attribute of the attention module: the output projection (o_proj)
    fused_qkv: str | None = None  # GPT-2 style Conv1D holding [W_Q | W_K | W_V]


_LAYOUTS = {
    "gpt2": _Layout("transformer.h", "attn", "c_proj", fused_qkv="c_attn"),
}
_DEFAULT_LAYOUT = _Layout("model.layers", "self_attn", "o_proj")


def _get(obj: object, dotted: str) -> object:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


class HeadModel:
    """A loaded causal LM plus its tokenizer, seen as `[n_layers, n_heads]` attention heads.

    Args:
        model: a `transformers` causal LM (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
            `MistralForCausalLM`, `GPT2LMHeadModel`, …) whose attention goes through
            `transformers`' `AttentionInterface`.
        tokenizer: its (fast) tokenizer; needed for text prompts and spans.
        name: a model id recorded in every `HeadScores` produced with this model.
        processor: for a vision-language model, its processor (image processor +
            tokenizer; `heads.images` uses it to encode prompts with images).

    Raises:
        TypeError: `model` is not an `nn.Module` with a `config`.
        ValueError: the architecture's decoder layers or attention projections
            cannot be found.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: object | None = None,
        name: str | None = None,
        processor: object | None = None,
    ):
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        self.model = model
        self.tokenizer = tokenizer
        self.processor = processor
        cfg = model.config
        self.name = name or getattr(cfg, "_name_or_path", None) or type(model).__name__
        self._layout = _LAYOUTS.get(getattr(cfg, "model_type", ""), _DEFAULT_LAYOUT)
        try:
            layers = _get(model, self._layout.layers)
        except AttributeError:
            # Vision-language wrappers keep the language model one level down
            # (LLaVA, Qwen2-VL: `language_model`; Idefics3 / SmolVLM: `text_model`).
            for path in ("model.language_model.layers", "model.text_model.layers"):
                try:
                    layers = _get(model, path)
                except AttributeError:
                    continue
                self._layout = _Layout(path, "self_attn", "o_proj")
                break
            else:
                raise ValueError(f"cannot find decoder layers of model_type={cfg.model_type!r}") from None
        self.layers: list[nn.Module] = list(layers)
        self.attentions: list[nn.Module] = [getattr(b, self._layout.attn) for b in self.layers]
        self.out_projs: list[nn.Module] = [getattr(a, self._layout.out_proj) for a in self.attentions]
        self.q_projs: list[nn.Module] = [
            getattr(a, self._layout.fused_qkv or "q_proj") for a in self.attentions
        ]
        a0 = self.attentions[0]
        self.d_head: int = int(a0.head_dim)
        self.n_layers: int = len(self.layers)
        in_o = self._o_weight(0).shape[0]
        if in_o % self.d_head:
            raise ValueError(f"o_proj input width {in_o} is not a multiple of head_dim {self.d_head}")
        self.n_heads: int = in_o // self.d_head
        self.n_kv_heads: int = self.n_heads // int(getattr(a0, "num_key_value_groups", 1))
        self.d_model: int = int(self._o_weight(0).shape[1])
        self.d_vocab: int = int(self.model.get_output_embeddings().weight.shape[0])

    # ----------------------------------------------------------------- geometry
    @property
    def n_groups(self) -> int:
        """Query heads per KV head (`g = n_heads / n_kv_heads`; 1 without GQA)."""
        return self.n_heads // self.n_kv_heads

    def kv_head(self, head: int) -> int:
        """The KV head that query head `head` reads keys and values from (GQA map)."""
        self.check_head(0, head)
        return head // self.n_groups

    @property
    def kv_group(self) -> torch.Tensor:
        """`[n_heads]` long tensor: the KV head of every query head."""
        return torch.arange(self.n_heads) // self.n_groups

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def attention_configs(self) -> list[object]:
        """The distinct config objects the attention modules read `_attn_implementation` from."""
        seen: dict[int, object] = {}
        for a in self.attentions:
            cfg = getattr(a, "config", self.model.config)
            seen.setdefault(id(cfg), cfg)
        return list(seen.values())

    def sliding_window(self, layer: int) -> int | None:
        """Sliding-window size of `layer`'s attention, or None for full attention."""
        attn = self.attentions[layer]
        if hasattr(attn, "sliding_window"):
            return attn.sliding_window
        cfg = getattr(attn, "config", self.model.config)
        window = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None)
        if window is not None and types is not None and types[layer] != "sliding_attention":
            return None
        return window

    @property
    def max_positions(self) -> int | None:
        """Longest sequence the model's position embeddings allow (None if unbounded)."""
        cfg = self.model.config
        cfg = getattr(cfg, "text_config", None) or cfg
        n = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        return int(n) if n else None

    def check_length(self, n_tokens: int) -> None:
        """Raise `ValueError` if `n_tokens` exceeds `max_positions`."""
        limit = self.max_positions
        if limit is not None and n_tokens > limit:
            raise ValueError(f"sequence of {n_tokens} tokens exceeds the model's limit of {limit} positions")

    def check_head(self, layer: int, head: int | None = None) -> None:
        """Raise `ValueError` naming `layer`/`head` if it is not a head of this model."""
        for name, value, n in (("layer", layer, self.n_layers), ("head", head, self.n_heads)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if not 0 <= value < n:
                raise ValueError(f"unknown {name} {value}: this model has {n} ({name}s 0..{n - 1})")

    # ------------------------------------------------------------------ weights
    def _o_weight(self, layer: int) -> torch.Tensor:
        """Output projection as `[n_heads * d_head, d_model]` (input rows, output columns)."""
        proj = self.out_projs[layer]
        w = proj.weight
        return w if self._layout.fused_qkv else w.T  # Conv1D stores [in, out]

    def _qkv_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V projections as `[d_model, width]` matrices."""
        attn = self.attentions[layer]
        if self._layout.fused_qkv:
            w = getattr(attn, self._layout.fused_qkv).weight  # [d_model, 3 * d_model]
            q, k, v = w.split(w.shape[1] // 3, dim=1)
            return q, k, v
        return attn.q_proj.weight.T, attn.k_proj.weight.T, attn.v_proj.weight.T

    def layer_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """Head-major views (no copy) of one layer's weights, always current.

        Returns `{"W_Q": [n_heads, d_model, d_head], "W_K"/"W_V": [n_kv_heads, d_model, d_head],
        "W_O": [n_heads, d_head, d_model]}`.
        """
        self.check_head(layer)
        q, k, v = self._qkv_weights(layer)

        def split(m: torch.Tensor, n: int) -> torch.Tensor:
            return m.detach().reshape(self.d_model, n, self.d_head).permute(1, 0, 2)

        return {
            "W_Q": split(q, self.n_heads),
            "W_K": split(k, self.n_kv_heads),
            "W_V": split(v, self.n_kv_heads),
            "W_O": self._o_weight(layer).detach().reshape(self.n_heads, self.d_head, self.d_model),
        }

    def _stack(self, name: str) -> torch.Tensor:
        return torch.stack([self.layer_weights(layer)[name] for layer in range(self.n_layers)])

    @property
    def W_Q(self) -> torch.Tensor:  # noqa: N802 (TransformerLens name)
        """`[n_layers, n_heads, d_model, d_head]` query weights (q = x @ W_Q[l, h]); a fresh copy."""
        return self._stack("W_Q")

    @property
    def W_K(self) -> torch.Tensor:  # noqa: N802
        """`[n_layers, n_kv_heads, d_model, d_head]` key weights, one per KV head; a fresh copy."""
        return self._stack("W_K")

    @property
    def W_V(self) -> torch.Tensor:  # noqa: N802
        """`[n_layers, n_kv_heads, d_model, d_head]` value weights, one per KV head; a fresh copy."""
        return self._stack("W_V")

    @property
    def W_O(self) -> torch.Tensor:  # noqa: N802
        """`[n_layers, n_heads, d_head, d_model]` output weights (z @ W_O[l, h]); a fresh copy."""
        return self._stack("W_O")

    @property
    def W_E(self) -> torch.Tensor:  # noqa: N802
        """`[d_vocab, d_model]` token embedding."""
        return self.model.get_input_embeddings().weight.detach()

    @property
    def W_U(self) -> torch.Tensor:  # noqa: N802
        """`[d_model, d_vocab]` unembedding (the LM head, transposed)."""
        return self.model.get_output_embeddings().weight.detach().T

    def __repr__(self) -> str:
        return (
            f"HeadModel({self.name!r}, n_layers={self.n_layers}, n_heads={self.n_heads}, "
            f"n_kv_heads={self.n_kv_heads}, d_head={self.d_head}, d_model={self.d_model})"
        )
