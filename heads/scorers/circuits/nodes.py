"""What the circuit graph reads of a model: each block's parts and the upstream nodes' outputs.

`LayerParts` holds what the decomposition needs of one block (its attention norm, head-major
q / k / v / o weights and biases, the post-attention norm of the post-norm families and its
gain); `Acts` holds one run's node outputs compactly (`[R, T, H, d]` head outputs, `[R, T, D]`
MLP outputs, the stream at each block boundary); `head_shares` turns head outputs into what
each head adds to the residual stream (`z_h W_O[h]`, times `gain / s` under a post-norm whose
scale `s` is frozen at its value in the run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from heads.model.adapter import HeadModel
from heads.model.parts import submodule, unwrap
from heads.scorers.circuits.layout import attn_norm

__all__ = ["Acts", "LayerParts", "embed_output", "head_shares", "layer_parts"]


# ------------------------------------------------------------------------------ model parts
@dataclass
class LayerParts:
    """What the decomposition needs of one block.

    Attributes:
        norm1: the attention's input norm (Identity when the family has none, e.g. OLMo 2).
        w: `{"q": [H, D, d], "k": [G, D, d], "v": [G, D, d]}` head-major projection weights.
        b: the same keys, `[n, d]` biases or None.
        proj: `{"q" | "k" | "v": (module, lo, hi)}`: the module computing it and the feature range
            of its output that holds it (the fused QKV for all three).
        w_o: `[H, d, D]` output weights.
        post: the post-attention norm (post-norm families) or None.
        gain: `[D]` fp32 gain of `post` (Gemma's `1 + weight`), or None.
    """

    norm1: nn.Module
    w: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor | None]
    proj: dict[str, tuple[nn.Module, int, int]]
    w_o: torch.Tensor
    post: nn.Module | None = None
    gain: torch.Tensor | None = None


def _gain(model: HeadModel, norm: nn.Module) -> torch.Tensor:
    """`[D]` fp32 gain of an RMS / LayerNorm module (Gemma multiplies by `1 + weight`)."""
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor):
        return torch.ones(model.d_model)
    gain = w.detach().float()
    return 1.0 + gain if "gemma" in model.family.model_type else gain


def layer_parts(model: HeadModel, la: int) -> LayerParts:
    """The `LayerParts` of block `la` of `model` (a family `check_family` accepts)."""
    fam = model.family
    block = model.layers[la]
    norm = attn_norm(block)
    ws = model.layer_weights(la)
    H, G, d = model.n_heads, model.n_kv_heads, model.d_head
    widths = {"q": H * d, "k": G * d, "v": G * d}
    proj: dict[str, tuple[nn.Module, int, int]] = {}
    b: dict[str, torch.Tensor | None] = {}
    lo = 0
    for which in ("q", "k", "v"):
        mod = unwrap(model.backend.parts.projection(la, which))
        if fam.fused_qkv:
            proj[which] = (mod, lo, lo + widths[which])
        else:
            proj[which] = (mod, 0, widths[which])
        bias = getattr(mod, "bias", None)
        b[which] = (
            None
            if not isinstance(bias, torch.Tensor)
            else bias.detach()[proj[which][1] : proj[which][2]].reshape(-1, d)
        )
        lo += widths[which]
    post = None if fam.attn_out_norm is None else submodule(block, fam.attn_out_norm)
    return LayerParts(
        norm1=nn.Identity() if norm is None else unwrap(norm),
        w={"q": ws["W_Q"], "k": ws["W_K"], "v": ws["W_V"]},
        b=b,
        proj=proj,
        w_o=ws["W_O"],
        post=post,
        gain=None if post is None else _gain(model, post),
    )


def head_shares(
    z: torch.Tensor,
    w_o: torch.Tensor,
    heads: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    gain: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[h, R, T, D]` what heads `heads` (default all) of `z [R, T, H, d]` add to the stream:
    `z_h W_O[h]` (`w_o [H, d, D]`), times `gain / scale` under a post-norm whose scale
    `scale [R, T, 1]` is frozen at its value in the run."""
    if heads is not None:
        z = z[..., heads.to(z.device), :]
        w_o = w_o[heads.to(w_o.device)]
    out = torch.einsum("rthd,hdD->hrtD", z.to(w_o.dtype), w_o)
    if scale is not None:
        assert gain is not None
        out = out * (gain.to(out.device, out.dtype) / scale.to(out.device, out.dtype))
    return out


# ------------------------------------------------------------------------------ activations
@dataclass
class Acts:
    """The upstream nodes' outputs of one run, compactly.

    Attributes:
        input: `[R, T, D]` the residual entering layer 0.
        z: per layer `[R, T, H, d]` head outputs (the `o_proj` input).
        mlp: per layer `[R, T, D]` MLP outputs (what the MLP adds to the stream).
        resid: per layer `[R, T, D]` the stream leaving the layer, or empty when not recorded.
        scale: per layer `[R, T, 1]` fp32 scale of the post-attention norm (post-norm families;
            head h adds `gain * z_h W_O[h] / scale`), or empty.
        gain: per layer `[D]` the post-attention norm's gain, or empty.
        mid: per layer `[R, T, D]` the stream between the attention and the MLP (the MLP's input
            before its norm), or empty when not recorded.
    """

    input: torch.Tensor
    z: list[torch.Tensor]
    mlp: list[torch.Tensor]
    resid: list[torch.Tensor | None] = field(default_factory=list)
    scale: list[torch.Tensor] = field(default_factory=list)
    gain: list[torch.Tensor] = field(default_factory=list)
    mid: list[torch.Tensor] = field(default_factory=list)

    def rows(self, index: torch.Tensor) -> Acts:
        """The same activations for the rows `index` (a copy)."""
        return Acts(
            self.input[index],
            [z[index] for z in self.z],
            [m[index] for m in self.mlp],
            [None if r is None else r[index] for r in self.resid],
            [s[index] for s in self.scale],
            self.gain,
            [m[index] for m in self.mid],
        )

    def stream_in(self, la: int) -> torch.Tensor:
        """`[R, T, D]` the stream entering layer `la` (`input`, or the output of layer la - 1)."""
        return self.input if la == 0 else cast(torch.Tensor, self.resid[la - 1])

    def can_skip(self, n_layers: int) -> bool:
        """Whether every layer's output was recorded (layers can be skipped)."""
        return len(self.resid) == n_layers and all(r is not None for r in self.resid)

    def head_out(self, la: int, w_o: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """`[h, R, T, D]` what the heads (`heads`, default all) of layer `la` add to the stream."""
        if self.scale:
            return head_shares(self.z[la], w_o, heads, self.scale[la], self.gain[la])
        return head_shares(self.z[la], w_o, heads)

    def upstream(self, w_o: list[torch.Tensor]) -> torch.Tensor:
        """`[U, R, T, D]` every upstream node's output (`w_o`: per layer `[H, d, D]`)."""
        out = [self.input[None]]
        for la, (w, m) in enumerate(zip(w_o, self.mlp, strict=True)):
            out += [self.head_out(la, w), m[None]]
        return torch.cat(out)


def embed_output(model: HeadModel, ids: torch.Tensor) -> torch.Tensor:
    """`[R, T, D]` the embedding module's output for `ids` (its own `forward`, no site edits)."""
    emb = unwrap(model.backend.parts.embed)
    with torch.no_grad():
        return cast(torch.Tensor, emb.forward(ids.to(model.device)))
