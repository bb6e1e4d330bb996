"""`HeadModel`: one adapter over a Hugging Face causal LM that exposes its heads.

Everything in headsteer talks to a model through this adapter: geometry
(`n_layers`, `n_heads`, `n_kv_heads`, `d_head`, `d_model`, `d_vocab`), the
attention and output-projection modules of each layer, and head-major weight
views named as in TransformerLens (`W_Q`, `W_K`, `W_V`, `W_O`, `W_E`, `W_U`).
Shapes are read from the real modules' weights, never from
`hidden_size / num_attention_heads`. Where the modules live and every other
family-specific fact comes from the model-family table (`heads.model.families`), kept as
`HeadModel.family`; a family not in the table, or a feature the edit engine does not
reproduce, is refused here with a `ValueError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from heads._util.validation import is_int, short_repr
from heads.backends.base import Backend
from heads.backends.core import make_backend
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.families import Family
from heads.model.parts import submodule, unwrap

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

__all__ = ["HeadModel", "submodule"]


_module = submodule
_unwrap = unwrap  # the names the scorers imported before `heads.model.parts`


def _weight(module: nn.Module) -> torch.Tensor:
    """`module.weight` (a projection, embedding or LM head)."""
    return cast(torch.Tensor, module.weight)


class HeadModel:
    """A loaded causal LM plus its tokenizer, seen as `[n_layers, n_heads]` attention heads.

    Args:
        model: a `transformers` causal LM (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
            `Phi3ForCausalLM`, `GPT2LMHeadModel`, …) or vision-language model (LLaVA,
            Qwen2-VL, Idefics3 / SmolVLM, Gemma 3) of a family in `heads.model.families.FAMILIES`;
            for a VLM the heads are those of its language model.
        tokenizer: its (fast) tokenizer; needed for text prompts and spans.
        name: a model id recorded in every `HeadScores` produced with this model.
        processor: for a vision-language model, its processor (image processor +
            tokenizer; `heads.inputs.images` uses it to encode prompts with images).
        remote: nnsight only: run every trace on NDIF (`trace(..., remote=True)`); see
            `heads.backends.core`.
        backend: the backend to run through, built on `model` (`heads.backends.core.make_backend`,
            as `load_model` and `HeadModel.wrap` do); None (default) builds it here.

    `model` may also be a TransformerLens `TransformerBridge` or an nnsight
    `TransformersModel` / `LanguageModel` (their tokenizer is used when `tokenizer` is None);
    `HeadModel.wrap(obj)` does the same and also accepts a `HeadModel`. The backend is kept as
    `.backend` (`.backend.kind`: `"hf"`, `"transformer_lens"` or `"nnsight"`); forwards go
    through `run()` / `generate()`, which use the backend's entry point (see `heads.backends.core`).

    Every family-specific fact (module paths, fused QKV, sliding windows, QK-norm, …) comes
    from its `heads.model.families` entry, kept as `.family`.

    Raises:
        TypeError: `model` is not a `transformers` model, bridge or nnsight model.
        ValueError: a `model_type` not in the family table, a config feature the edit engine
            does not reproduce (refused here, before anything is changed), or a model whose
            modules are not where its family entry says.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase | None = None,
        name: str | None = None,
        processor: ProcessorMixin | None = None,
        *,
        remote: bool = False,
        backend: Backend | None = None,
    ):
        if backend is None:
            backend, native_tok = make_backend(model, remote=remote)  # TypeError for anything else
            tokenizer = native_tok if tokenizer is None else tokenizer
        elif not isinstance(backend, Backend) or (
            model is not backend.module and model is not backend.native
        ):
            raise HeadsteerTypeError(
                f"backend must be a heads.backends Backend built on this model, got {type(backend).__name__}"
            )
        parts = backend.parts
        model = cast("PreTrainedModel", backend.module)
        cfg = model.config
        self.model: PreTrainedModel = model
        self.backend: Backend = backend
        self.tokenizer: PreTrainedTokenizerBase | None = tokenizer
        self.processor: ProcessorMixin | None = processor
        self.name = name or getattr(cfg, "_name_or_path", None) or type(model).__name__
        self.family: Family = backend.family
        self.decoder: nn.Module = parts.decoder
        self.layers: list[nn.Module] = parts.layers
        self.attentions: list[nn.Module] = parts.attentions  # on a bridge: its attention components
        self.out_projs: list[nn.Module] = parts.out_projs
        self.q_projs: list[nn.Module] = parts.q_projs  # the module computing the queries (maybe a fused QKV)
        self.unembed: nn.Module = parts.unembed  # the LM head, weight [d_vocab, d_model]
        self.d_head: int = parts.d_head  # the per-head width of the o_proj input
        self.n_layers: int = parts.n_layers
        self.n_heads: int = parts.n_heads
        self.n_kv_heads: int = parts.n_kv_heads
        self.d_model: int = parts.d_model
        self.d_vocab: int = int(_weight(self.unembed).shape[0])
        if backend.kind == "transformer_lens":
            self._check_bridge_geometry(backend.native)

    @classmethod
    def wrap(
        cls, obj: object, tokenizer: PreTrainedTokenizerBase | None = None, *, name: str | None = None
    ) -> HeadModel:
        """A `HeadModel` over whatever `obj` is: a `HeadModel` (returned as is), a `transformers`
        causal LM, a TransformerLens `TransformerBridge` or an nnsight `TransformersModel` /
        `LanguageModel` (the tokenizer defaults to the bridge's / nnsight model's own).

        Raises:
            TypeError: any other object (names its type).
            ValueError: a family headsteer does not support, a bridge with processed weights, or
                a `HeadModel` with a different `tokenizer` / `name` (it would be ignored).
        """
        if isinstance(obj, HeadModel):
            if (tokenizer is not None and tokenizer is not obj.tokenizer) or (
                name is not None and name != obj.name
            ):
                raise HeadsteerValueError(
                    "HeadModel.wrap got a HeadModel and a different tokenizer or name: it is returned "
                    "as is, so build a new HeadModel over its .model instead"
                )
            return obj
        backend, native_tok = make_backend(obj)
        return cls(cast(nn.Module, obj), tokenizer or native_tok, name=name, backend=backend)

    def _check_bridge_geometry(self, bridge: object) -> None:
        """Read the geometry from the bridge's own weights and check it matches the modules."""
        attn: Any = cast(nn.ModuleList, getattr(bridge, "blocks"))[0].attn  # noqa: B009
        wq, wk = cast(torch.Tensor, attn.W_Q), cast(torch.Tensor, attn.W_K)  # [H, D, d], [G, D, d]
        got = (int(wq.shape[0]), int(wk.shape[0]), int(wq.shape[-1]), int(wq.shape[1]))
        want = (self.n_heads, self.n_kv_heads, self.d_head, self.d_model)
        if got != want:
            raise HeadsteerValueError(
                f"the bridge's weights give (n_heads, n_kv_heads, d_head, d_model) = {got}, the wrapped "
                f"model's modules {want}; refusing a bridge whose weights are not the model's"
            )

    # ------------------------------------------------------------------ running
    def run(self, **inputs):
        """One forward through the backend's entry point; the `transformers` output object.

        `"hf"` calls the model, `"transformer_lens"` the bridge's rewired module tree (every hook
        point fires), `"nnsight"` runs it in `trace()` (with `remote` if set).
        """
        return self.backend.run(**inputs)

    def generate(self, **inputs):
        """`transformers` `generate` through the backend's entry point (see `run`)."""
        return self.backend.generate(**inputs)

    def trace(self, *inputs, **kwargs):
        """nnsight only: the user's own `trace()` on the wrapped nnsight model, to use inside
        `heads.editing(...)` so headsteer's edits and the user's interventions act in one forward.

        Raises:
            ValueError: the backend is not nnsight.
        """
        trace = getattr(self.backend, "trace", None)
        if trace is None:
            raise HeadsteerValueError(
                "trace() needs the nnsight backend; this HeadModel's backend is "
                f"{short_repr(self.backend.kind)}"
            )
        return trace(*inputs, **kwargs)

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
    def attention_configs(self) -> list[PreTrainedConfig]:
        """The distinct config objects the attention modules read `_attn_implementation` from."""
        seen: dict[int, PreTrainedConfig] = {}
        for a in self.attentions:
            cfg = getattr(unwrap(a), "config", self.model.config)
            seen.setdefault(id(cfg), cfg)
        return list(seen.values())

    def sliding_window(self, layer: int) -> int | None:
        """Sliding-window size (keys) of `layer`'s attention, or None for full attention.

        Read through the family table (`Family.sliding_window`): `"all"` layers use
        `config.sliding_window`, `"layer_types"` only the `"sliding_attention"` ones.
        """
        rule = self.family.sliding_window
        if rule == "none":
            return None
        cfg = getattr(unwrap(self.attentions[layer]), "config", self.model.config)
        window = getattr(cfg, "sliding_window", None)
        if rule == "layer_types":
            types = getattr(cfg, "layer_types", None)
            if types is None or types[layer] != "sliding_attention":
                return None
        return int(window) if window else None

    @property
    def final_norm(self) -> nn.Module:
        """The norm applied to the residual stream before the unembedding."""
        return _module(self.decoder, self.family.final_norm)

    def mlp(self, layer: int) -> nn.Module:
        """The MLP of decoder block `layer` (a mixture-of-experts block when `family.moe`).

        Raises:
            ValueError: the family's MLP is not one module (OPT, BioGPT: `fc1` / `fc2` sit in
                the block).
        """
        if self.family.mlp is None:
            raise HeadsteerValueError(
                f"model_type {short_repr(self.family.model_type)}: the MLP is not one module (its layers sit "
                "directly in the decoder block)"
            )
        return _module(self.layers[layer], self.family.mlp)

    def mlp_norm(self, layer: int) -> nn.Module | None:
        """The norm on the MLP's input in block `layer`, or None (the MLP reads the raw residual)."""
        name = self.family.mlp_norm
        return None if name is None else _module(self.layers[layer], name)

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
            raise HeadsteerValueError(
                f"sequence of {short_repr(n_tokens)} tokens exceeds the model's limit of {limit} positions"
            )

    def check_head(self, layer: int, head: int | None = None) -> None:
        """Raise `ValueError` naming `layer`/`head` if it is not a head of this model."""
        for name, value, n in (("layer", layer, self.n_layers), ("head", head, self.n_heads)):
            if value is None:
                continue
            if not is_int(value):
                raise HeadsteerTypeError(f"{name} must be an int, got {short_repr(value)}")
            if not 0 <= value < n:
                raise HeadsteerValueError(
                    f"unknown {name} {short_repr(value)}: this model has {n} ({name}s 0..{n - 1})"
                )

    # ------------------------------------------------------------------ weights
    def _o_weight(self, layer: int) -> torch.Tensor:
        """Output projection as `[n_heads * d_head, d_model]` (input rows, output columns)."""
        w = _weight(self.out_projs[layer])
        return w if self.family.conv1d else w.T  # Conv1D stores [in, out]

    def _qkv_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V projections as `[d_model, width]` matrices (widths H*d, G*d, G*d)."""
        fam, attn = self.family, self.attentions[layer]
        if fam.latent:
            raise HeadsteerValueError(
                f"model_type {short_repr(fam.model_type)} uses multi-head latent attention: queries, keys "
                "and values are decompressed from low-rank latents (with a shared rotary key), so there are "
                "no per-head W_Q / W_K / W_V matrices; weight-based scorers do not apply"
            )
        if fam.fused_qkv:
            w = _weight(_module(attn, cast(str, fam.qkv_proj)))
            w = w if fam.conv1d else w.T  # [d_model, (H + 2G) * d]
            q_w, kv_w = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
            if w.shape[1] != q_w + 2 * kv_w:
                raise HeadsteerValueError(f"fused QKV width {w.shape[1]} is not {q_w} + 2 x {kv_w}")
            layout = fam.qkv_layout
            if layout == "bigcode":  # GPT-BigCode: blocks with multi-query, head by head without
                layout = "blocks" if getattr(self.model.config, "multi_query", False) else "per_head"
            if layout == "per_head":  # [H, (q | k | v), d] (no GQA in these families)
                per = w.reshape(self.d_model, self.n_heads, 3, self.d_head)
                q, k, v = (per[:, :, i].reshape(self.d_model, -1) for i in range(3))
                return q, k, v
            q, k, v = w.split([q_w, kv_w, kv_w], dim=1)
            return q, k, v
        mats = [_weight(_module(attn, cast(str, p))) for p in (fam.q_proj, fam.k_proj, fam.v_proj)]
        q, k, v = (m if fam.conv1d else m.T for m in mats)
        return q, k, v

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
        return _weight(unwrap(self.model.get_input_embeddings())).detach()

    @property
    def W_U(self) -> torch.Tensor:  # noqa: N802
        """`[d_model, d_vocab]` unembedding (the LM head, transposed)."""
        return _weight(self.unembed).detach().T

    def __repr__(self) -> str:
        return (
            f"HeadModel({self.name!r}, n_layers={self.n_layers}, n_heads={self.n_heads}, "
            f"n_kv_heads={self.n_kv_heads}, d_head={self.d_head}, d_model={self.d_model}"
            + ("" if self.backend.kind == "hf" else f", backend={self.backend.kind!r}")
            + ")"
        )
