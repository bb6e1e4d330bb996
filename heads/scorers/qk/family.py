"""The family facts QK attribution and composition scores read, and the families they accept.

A head's query and key are affine in the residual stream entering its layer once every norm's
scale is frozen at its value in the run (the convention of direct logit attribution). This
module gives, for one layer, the pieces of that affine map as the model's own modules define
them: the attention's input norm (none on OLMo 2, whose attention reads the raw residual), the
norm on the attention output before it joins the residual (Gemma 2 / 3, OLMo 2: `post_norm`),
the QK-norms (per head: Qwen 3, Gemma 3; over all heads: OLMo 2), the projections' weights and
biases, the rotary embedding (the family's own `rotary_emb` and `apply_rotary_pos_emb`), the
logit scale, soft-cap and learned sinks.

Accepted families are those on which the decomposition is checked against an independent
forward (tests/heads/qk/test_qk_oracle.py): `ACCEPTED`. Multi-head latent attention is refused
by name (no per-head key projection of the residual); any other family is refused naming it.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from heads._util.validation import short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel, _module, _unwrap
from heads.scorers.patching.logit import norm_parts
from heads.scorers.qk.request import QK_FAMILIES

__all__ = ["ACCEPTED", "Norm", "Rotary", "check_qk_model", "layer_parts", "LayerParts"]

ACCEPTED = QK_FAMILIES
"""`model_type`s whose decomposition is checked exact against an independent forward (one list
with the requests' config check, `heads.scorers.qk.request.QK_FAMILIES`)."""

_ATTN_NORMS = ("input_layernorm", "ln_1")


def check_qk_model(model: HeadModel) -> None:
    """Refuse, before any forward, a model QK attribution cannot decompose exactly.

    Raises:
        TypeError: `model` is not a `HeadModel`.
        ValueError: multi-head latent attention (named), a vision-language wrapper, the
            TransformerLens backend (its attention runs inside the bridge), or a `model_type`
            not in `ACCEPTED` (the message lists them).
    """
    if not isinstance(model, HeadModel):
        raise HeadsteerTypeError(f"model must be a HeadModel, got {type(model).__name__}")
    fam = model.family
    name = fam.model_type
    if fam.latent:
        raise HeadsteerValueError(
            f"QK attribution does not support model_type {short_repr(name)}: multi-head latent "
            "attention decompresses keys from a shared low-rank latent with a shared rotary key, so "
            "there is no per-head key projection of the residual stream to decompose"
        )
    if fam.vlm is not None:
        raise HeadsteerValueError(
            f"QK attribution does not support vision-language model {short_repr(fam.vlm)} "
            "(text decoders only)"
        )
    if model.backend.kind == "transformer_lens":
        raise HeadsteerValueError(
            "QK attribution needs the transformers or nnsight backend; a TransformerLens bridge computes "
            "attention inside the bridge"
        )
    if name not in ACCEPTED:
        raise HeadsteerValueError(
            f"QK attribution does not support model_type {short_repr(name)}: its decomposition is checked "
            f"exact on {', '.join(ACCEPTED)} only"
        )


@dataclass(frozen=True)
class Norm:
    """One norm under the frozen-scale convention: `y = gain * (x - mean x) / s + bias` with `s`
    the run's scale (`sqrt(mean x^2 + eps)` for `"rms"`, `sqrt(var x + eps)` and centring for
    `"layer"`)."""

    kind: str
    gain: torch.Tensor  # [dim] fp64
    bias: torch.Tensor | None  # [dim] fp64 or None
    eps: float

    @classmethod
    def of(cls, model: HeadModel, module: nn.Module, dim: int) -> Norm:
        kind, gain, bias, eps = norm_parts(model, module, dim)
        return cls(kind, gain.double(), None if bias is None else bias.double(), eps)

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """`[...]` the frozen scale `s` of each vector of `x` `[..., dim]` (fp64)."""
        x = x.double()
        if self.kind == "layer":
            return (x.var(-1, unbiased=False) + self.eps).sqrt()
        return (x.pow(2).mean(-1) + self.eps).sqrt()

    def reading(self, w: torch.Tensor) -> torch.Tensor:
        """`w` `[dim, ...]` as read through this norm: `C diag(gain) w` (C centres for LayerNorm)."""
        out = self.gain.reshape(-1, *([1] * (w.dim() - 1))) * w
        if self.kind == "layer":
            out = out - out.mean(0, keepdim=True)
        return out

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The norm itself on `x` `[..., dim]` (fp64), for the totals."""
        x = x.double()
        c = x - x.mean(-1, keepdim=True) if self.kind == "layer" else x
        y = self.gain * c / self.scale(x)[..., None]
        return y if self.bias is None else y + self.bias


Rotary = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""`(v [..., X, P, d], positions [N, P] or [P]) -> R v`: the layer's rotary map per position."""


@dataclass(frozen=True)
class LayerParts:
    """The affine pieces of one layer's attention (fp64, CPU).

    Attributes:
        layer: the layer index.
        in_norm: the attention's input norm, or None (OLMo 2 reads the raw residual).
        out_norm: the norm on the attention output before the residual add (post-norm families), or None.
        W_Q: `[H, D, d]`; W_K, W_V: `[G, D, d]`; W_O: `[H, d, D]`.
        b_Q: `[H, d]` or None; b_K, b_V: `[G, d]` or None; b_O: `[D]` or None.
        q_norm: the query QK-norm, or None; `qk_norm` `"per_head"` (over d) or `"all_heads"`
            (over H*d / G*d).
        k_norm: the key QK-norm, or None (as `q_norm`).
        scaling: the logit scale the module passes.
        softcap: `c` of `c tanh(s / c)` on the logits, or None.
        sinks: `[H]` learned sink logits, or None.
        rotary: `rotary(v, positions)`, or None (absolute positions).
    """

    layer: int
    in_norm: Norm | None
    out_norm: Norm | None
    W_Q: torch.Tensor  # noqa: N815 (TransformerLens names)
    W_K: torch.Tensor  # noqa: N815
    W_V: torch.Tensor  # noqa: N815
    W_O: torch.Tensor  # noqa: N815
    b_Q: torch.Tensor | None  # noqa: N815
    b_K: torch.Tensor | None  # noqa: N815
    b_V: torch.Tensor | None  # noqa: N815
    b_O: torch.Tensor | None  # noqa: N815
    q_norm: Norm | None
    k_norm: Norm | None
    qk_norm: str
    scaling: float
    softcap: float | None
    sinks: torch.Tensor | None
    rotary: Rotary | None

    def read(self, w: torch.Tensor) -> torch.Tensor:
        """`w` `[X, D, d]` folded with the input norm's gain (and centring): the weights that
        read the raw residual, `C diag(gain) w`."""
        return w if self.in_norm is None else self.in_norm.reading(w.transpose(0, 1)).transpose(0, 1)

    def rotation(self, positions: torch.Tensor) -> torch.Tensor | None:
        """`[N, P, d, d]` the rotary map at each position as a matrix `B` (`R_p v = v @ B[n, p]`),
        built by the family's own rotary function on the basis vectors; None without RoPE."""
        if self.rotary is None:
            return None
        d = self.W_Q.shape[-1]
        N, P = positions.shape
        eye = torch.eye(d, dtype=torch.float64)[None, :, None, :].expand(N, d, P, d)
        return self.rotary(eye.contiguous(), positions).permute(0, 2, 1, 3)  # [N, P, i, j]

    def write(self) -> torch.Tensor:
        """`W_O` `[H, d, D]` folded with the output norm's gain (post-norm families)."""
        return self.W_O if self.out_norm is None else self.W_O * self.out_norm.gain


def _bias(module: nn.Module) -> torch.Tensor | None:
    b = getattr(module, "bias", None)
    return None if b is None else cast(torch.Tensor, b).detach().double().cpu()


def _qkv_bias(model: HeadModel, layer: int) -> tuple[torch.Tensor | None, ...]:
    fam, attn = model.family, model.attentions[layer]
    H, G, d = model.n_heads, model.n_kv_heads, model.d_head
    if fam.fused_qkv:
        b = _bias(_module(attn, cast(str, fam.qkv_proj)))
        if b is None:
            return None, None, None
        q, k, v = b.split([H * d, G * d, G * d])
        return q.reshape(H, d), k.reshape(G, d), v.reshape(G, d)
    out = []
    for name, n in ((fam.q_proj, H), (fam.k_proj, G), (fam.v_proj, G)):
        b = _bias(_module(attn, cast(str, name)))
        out.append(None if b is None else b.reshape(n, d))
    return tuple(out)


def _rotary(model: HeadModel, layer: int) -> Rotary | None:
    """The layer's rotary map from the family's own `rotary_emb` and `apply_rotary_pos_emb`."""
    rot = getattr(model.decoder, "rotary_emb", None)
    if rot is None:
        return None
    attn = _unwrap(model.attentions[layer])
    apply = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if apply is None:
        raise HeadsteerValueError(
            f"model_type {short_repr(model.family.model_type)}: no apply_rotary_pos_emb beside its attention"
        )
    kw: dict = {}
    if "layer_type" in inspect.signature(rot.forward).parameters:
        types = getattr(model.model.config, "layer_types", None)
        kw["layer_type"] = types[layer] if types else None
    dev = model.device

    def rotary(v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        pos = positions if positions.dim() == 2 else positions[None]
        with torch.no_grad():
            cos, sin = rot(torch.zeros(1, device=dev, dtype=torch.float32), pos.to(dev), **kw)
        cos, sin = cos.double().cpu(), sin.double().cpu()  # [N, P, d_rot]
        one = v[..., :1, :, :] if v.dim() == 4 else v  # the function rotates a key too: a small one
        if positions.dim() == 1:
            cos, sin = cos[0], sin[0]  # [P, d_rot], broadcast over the leading dims
            out, _ = apply(v, one, cos[None], sin[None], unsqueeze_dim=0)
            return cast(torch.Tensor, out)
        # v [N, X, P, d]: cos [N, P, d] -> [N, 1, P, d]
        out, _ = apply(v, one, cos, sin, unsqueeze_dim=1)
        return cast(torch.Tensor, out)

    return rotary


def layer_parts(model: HeadModel, layer: int) -> LayerParts:
    """The affine pieces of `layer`'s attention (see `LayerParts`), fp64 on CPU.

    Raises:
        ValueError: an input norm that is not among the accepted layouts.
    """
    fam = model.family
    block = model.layers[layer]
    attn = _unwrap(model.attentions[layer])
    D = model.d_model
    in_norm = None
    for name in _ATTN_NORMS:
        m = getattr(block, name, None)
        if isinstance(m, nn.Module):
            in_norm = Norm.of(model, m, D)
            break
    post = "post_norm" in fam.features
    if in_norm is None and not (post and fam.mlp_norm is None):
        raise HeadsteerValueError(
            f"model_type {short_repr(fam.model_type)}: no attention input norm among {_ATTN_NORMS}"
        )
    out_norm = Norm.of(model, cast(nn.Module, block.post_attention_layernorm), D) if post else None
    w = model.layer_weights(layer)
    b_q, b_k, b_v = _qkv_bias(model, layer)
    q_norm = k_norm = None
    H, G, d = model.n_heads, model.n_kv_heads, model.d_head
    if fam.qk_norm != "none":
        width = (d, d) if fam.qk_norm == "per_head" else (H * d, G * d)
        q_norm = Norm.of(model, cast(nn.Module, attn.q_norm), width[0])
        k_norm = Norm.of(model, cast(nn.Module, attn.k_norm), width[1])
    softcap = None
    if fam.softcap is not None:
        c = getattr(model.model.config, fam.softcap, None)
        softcap = float(c) if c else None
    sinks = getattr(attn, "sinks", None) if "learned_sinks" in fam.features else None
    return LayerParts(
        layer,
        in_norm,
        out_norm,
        w["W_Q"].double().cpu(),
        w["W_K"].double().cpu(),
        w["W_V"].double().cpu(),
        w["W_O"].double().cpu(),
        b_q,
        b_k,
        b_v,
        _bias(model.out_projs[layer]),
        q_norm,
        k_norm,
        fam.qk_norm,
        float(cast(float, attn.scaling)),
        softcap,
        None if sinks is None else cast(torch.Tensor, sinks).detach().double().cpu(),
        _rotary(model, layer),
    )
