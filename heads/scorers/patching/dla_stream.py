"""The one forward of direct logit attribution, streamed: each layer's parts are projected on the
answer direction while the forward runs, and only what the result needs is kept.

`direct_logit_attribution` decomposes the stream leaving the last block,
`x_L = e + sum_l r_l (attn_l + mlp_l)` (`r_l` the block's residual multiplier, 1 for most families),
and multiplies every part's projection on the direction `u` by the final norm's scale frozen at
its value in the run, `s(t)`. The projections are linear in the parts, so they can be taken at
each layer's engine site as the forward reaches it and multiplied by `s(t)` at the end
(`s` needs `x_L`, known only then). Kept, for the `P` positions read (`P = T` by default):

* per layer the heads' terms `[N, H, P]` and the MLP and "beyond the heads" terms `[N, P]`
  (together `[N, L, H + 2, P]` fp32: under half a residual copy on SmolLM2 at `P = T`);
* a running sum of the parts `[N, P, D]` fp32 (one residual copy at `P = T`), for the `rest`
  term `(x_L - e - sum_l r_l (attn_l + mlp_l)) . u`;
* `x_L` at the `P` positions (one residual copy) and, for a moment within each layer, the heads'
  outputs `z` of that layer (until its attention output is read).

No KV cache and no other layer's activations are held (the run's full cache, `record_run`, held
about 13x a plain forward's peak at 1k-2k tokens on SmolLM2). Every read is an engine site
(`ActivationEdit` reads: `residual`, `head_output`, `attn_out`, `mlp_out`, `resid_post`), so it
runs on every backend. Families whose attention / MLP outputs are not engine sites (a residual
multiplier other than 1: Granite, MiniCPM3; an MLP that is not one module: OPT, BioGPT) are
read as `record_run` reads them: the attention output is `o_proj(z)` (then the post-attention
norm), and the MLP's part is the block's output minus its input minus the attention part, taken
on the projections (`(resid_post - residual) . u`) and on the running sum
(`+= resid_post - residual`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch

from heads.engine.activations import ActivationEdit
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Edit
from heads.engine.forward import run_last
from heads.model.adapter import HeadModel
from heads.model.parts import submodule
from heads.scorers.patching.norms import NormParts, head_terms
from heads.scorers.patching.record import stream_sites

# Internal to `heads.scorers.patching.logit` (importable by this module path, not public API).
__all__: list[str] = []


@dataclass
class Streamed:
    """What the streamed DLA forward keeps (fp32, CPU, `P` the positions read), every term before
    the final norm's frozen scale `s(t)` and the mask are applied.

    Attributes:
        heads: per layer `[N, H, P]` `share_h . u` (before the residual multiplier).
        attn_u: per layer `[N, P]` `r_l * (attn_l - sum_h share_h) . u` (the output bias, a
            post-norm's bias: what the attention output holds beyond the heads).
        mlp_u: per layer `[N, P]` `r_l * mlp_l . u`.
        embed_u: `[N, P]` `e . u` (the residual entering layer 0).
        rest_u: `[N, P]` `(x_L - e - sum_l r_l (attn_l + mlp_l)) . u`.
        final: `[N, P, D]` `x_L`, the stream leaving the last block.
    """

    heads: list[torch.Tensor] = field(default_factory=list)
    attn_u: list[torch.Tensor] = field(default_factory=list)
    mlp_u: list[torch.Tensor] = field(default_factory=list)
    embed_u: torch.Tensor | None = None
    rest_u: torch.Tensor | None = None
    final: torch.Tensor | None = None


def _residual_scale(model: HeadModel, layer: int) -> float:
    name = model.family.residual_scale
    return 1.0 if name is None else float(getattr(model.layers[layer], name))


def _attention_output(model: HeadModel, layer: int, z: torch.Tensor) -> torch.Tensor:
    """`[N, P, D]` fp32 block `layer`'s attention output as it joins the stream (before any
    residual multiplier) from its head outputs `z [N, P, H, d]` (fp32): `z W_O + b_O` (computed,
    not by calling the output projection, whose input is the site being read), then the family's
    post-attention norm module, if any (HyperCLOVA X with a residual multiplier)."""
    wo, bo = _o_matrices(model, layer)
    out = torch.einsum("nthd,hdk->ntk", z, wo)
    if bo is not None:
        out = out + bo
    name = model.family.attn_out_norm
    if name is not None:
        norm = submodule(model.layers[layer], name)
        out = cast(torch.Tensor, norm(out.to(model.device, model.dtype))).float().cpu()
    return out


def _o_matrices(model: HeadModel, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`W_O [H, d, D]` and the output bias `[D]` (or None) of `layer`, fp32 CPU."""
    w = model._o_weight(layer).detach().float().cpu()  # [H*d, D]
    b = getattr(model.out_projs[layer], "bias", None)
    return w.reshape(model.n_heads, model.d_head, -1), (None if b is None else b.detach().float().cpu())


@torch.no_grad()
def stream_dla(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    u: torch.Tensor,
    post: list[NormParts | None],
    tol: float,
    cols: torch.Tensor | None = None,
) -> Streamed:
    """One unedited forward of `ids [N, T]` (left-padded, `mask [N, T]`) projecting every part of
    the residual stream on `u [N, D]` (fp32) at the padded columns `cols` (`[P]` long, None: all
    `T`), as the module docstring says.

    Raises:
        ValueError: a post-attention norm's output that is not the norm of the heads' projection
            (`head_terms`' check, within `tol`).
    """
    L, N, T = model.n_layers, ids.shape[0], ids.shape[1]
    streams = stream_sites(model)
    own_mlp = model.family.mlp is not None and streams
    out = Streamed()
    heads: list[torch.Tensor | None] = [None] * L
    attn_u: list[torch.Tensor | None] = [None] * L
    mlp_u: list[torch.Tensor | None] = [None] * L
    pre_u: list[torch.Tensor | None] = [None] * L
    z_kept: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    o_mats = [_o_matrices(model, la) for la in range(L)]
    scales = [_residual_scale(model, la) for la in range(L)]

    def pick(x: torch.Tensor) -> torch.Tensor:
        """`[N, P, ...]` fp32 CPU: the columns read (a copy where columns are chosen)."""
        x = x.detach()
        if x.shape[0] != N:  # a MoE block may return its rows flattened ([N * T, D])
            x = x.reshape(N, T, *x.shape[1:])
        if cols is not None:
            x = x[:, cols.to(x.device)]
        return x.float().cpu()

    def proj(v: torch.Tensor) -> torch.Tensor:  # [N, P, D] -> [N, P]
        return torch.einsum("ntd,nd->nt", v, u)

    def attention(la: int, z: torch.Tensor, raw: torch.Tensor) -> None:
        """Layer `la`'s head terms and the part of its attention output beyond the heads."""
        wo, bo = o_mats[la]
        r = scales[la]
        terms, head_sum = head_terms(z, wo, bo, u, post[la], raw, tol)  # post-norm: frozen scale
        heads[la] = terms
        attn = raw * r
        if own_mlp:
            state["parts"] += attn
        attn_u[la] = proj(attn - cast(torch.Tensor, head_sum) * r)
        if not own_mlp:
            state[f"attn_u{la}"] = proj(attn)

    def on_residual(la: int) -> Callable[[torch.Tensor, AttentionCall], None]:
        def fn(x: torch.Tensor, call: AttentionCall) -> None:
            v = pick(x)
            if la == 0:
                out.embed_u = proj(v)
                state["parts"] = v.clone()
            if not own_mlp:  # the block's output minus its input, on the running sum and on u
                pre_u[la] = proj(v)
                state["parts"] -= v

        return fn

    def on_z(la: int) -> Callable[[torch.Tensor, AttentionCall], None]:
        def fn(x: torch.Tensor, call: AttentionCall) -> None:
            z = pick(x)
            if streams:
                z_kept[la] = z  # until the attention output of this layer is read
            else:  # no attention-output site: the output projection of z, then the post-attention norm
                attention(la, z, _attention_output(model, la, z))

        return fn

    def on_attn(la: int) -> Callable[[torch.Tensor, AttentionCall], None]:
        def fn(x: torch.Tensor, call: AttentionCall) -> None:
            attention(la, z_kept.pop(la), pick(x))

        return fn

    def on_mlp(la: int) -> Callable[[torch.Tensor, AttentionCall], None]:
        def fn(x: torch.Tensor, call: AttentionCall) -> None:
            m = pick(x) * scales[la]
            state["parts"] += m
            mlp_u[la] = proj(m)

        return fn

    def on_post(la: int) -> Callable[[torch.Tensor, AttentionCall], None]:
        def fn(x: torch.Tensor, call: AttentionCall) -> None:
            v = pick(x)
            if not own_mlp:  # mlp . u = (post - pre) . u - r attn . u
                state["parts"] += v
                mlp_u[la] = proj(v) - cast(torch.Tensor, pre_u[la]) - state.pop(f"attn_u{la}")
                pre_u[la] = None
            if la == L - 1:
                out.final = v.clone()

        return fn

    edits: list[Edit] = []
    for la in range(L):
        if la == 0 or not own_mlp:
            edits.append(ActivationEdit("residual", la, on_residual(la)))
        edits.append(ActivationEdit("head_output", la, on_z(la)))
        if streams:
            edits.append(ActivationEdit("attn_out", la, on_attn(la)))
        if own_mlp:
            edits.append(ActivationEdit("mlp_out", la, on_mlp(la)))
        if la == L - 1 or not own_mlp:
            edits.append(ActivationEdit("resid_post", la, on_post(la)))
    with editing(model, edits):  # reads only: the forward is the model's own
        run_last(model, ids, mask)
    final = cast(torch.Tensor, out.final)
    out.rest_u = proj(final - state.pop("parts"))
    out.heads = [cast(torch.Tensor, h) for h in heads]
    out.attn_u = [cast(torch.Tensor, a) for a in attn_u]
    out.mlp_u = [cast(torch.Tensor, m) for m in mlp_u]
    return out
