"""The decomposition itself: each side (query, key, value) of a layer's heads as a sum of the
residual stream's components, under the frozen-scale convention.

The residual entering layer l is `x_l = sum_c r_c`: the embeddings (token; position where the
family has them), every earlier head's output, every earlier attention block's constant (the
output bias; for post-norm families the post-norm's shift), every earlier MLP output. The MLP
output is read as what the block adds beyond its attention, `x_{l'+1} - x_{l'} - attn_{l'}`,
so the components add up to `x_l` exactly (up to float rounding). A head's output is `z W_O`;
in post-norm families the block normalises its attention output before the residual add, so a
head writes `g * (z W_O) / s` with `s` the post-norm's scale frozen at its value at that
position.

With the input norm's scale `s_t` frozen, the pre-norm query of head h is
`u_t = sum_c (r_c C diag(g) W_Q^h) / s_t + (beta W_Q^h + b_Q^h)` (C centres for LayerNorm:
centring distributes over the components). A QK-norm divides by its own scale (per head, or over
all heads), frozen from `u_t`, and multiplies by its gain; RoPE rotates by the position. Each
step is linear per position, so `q_t = sum_c a_c(t) + a_bias(t)` exactly, and the same for keys
(per KV head) and values (no rotation, no QK-norm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heads.model.adapter import HeadModel
from heads.scorers.qk.family import LayerParts
from heads.scorers.qk.record import Recording

__all__ = ["Components", "Side", "components", "side"]


def _rows(x: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """`x [N, T, ...]` at columns `cols [N, P]` -> `[N, P, ...]`."""
    return x[torch.arange(x.shape[0])[:, None], cols]


@dataclass
class Components:
    """The residual stream entering one layer, split into components, at chosen positions.

    Attributes:
        names: component names (`"embed"`, `"pos_embed"`, `"L{l}H{h}"`, `"{l}_attn_bias"`,
            `"{l}_mlp_out"`), in order; the side's constant (`"bias"`) is added by `side`.
        resid: per residual-space component `[N, P, D]` (None for a head, whose vector is `heads`).
        heads: per layer l' `(z [N, P, H, d], W_O' [H, d, D], inv_s [N, P])`: head h writes
            `z[..., h, :] @ W_O'[h] * inv_s` (W_O' folds a post-norm's gain; inv_s its frozen 1/scale).
        head_index: `{name: (layer, head)}` of the head components.
        x: `[N, P, D]` the residual itself at those positions (the sum of the components).
        ends: `ends[l]` is the number of components entering layer l (`ends[0]`: the embeddings).
    """

    names: list[str]
    resid: list[torch.Tensor | None]
    heads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    head_index: dict[str, tuple[int, int]]
    x: torch.Tensor
    ends: list[int]

    def entering(self, layer: int, rec: Recording, cols: torch.Tensor) -> Components:
        """The components of the residual entering an earlier `layer` (a prefix of these: each
        layer's block of components does not depend on the layer that reads them)."""
        end = self.ends[layer]
        return Components(
            self.names[:end],
            self.resid[:end],
            self.heads[:layer],
            {k: v for k, v in self.head_index.items() if v[0] < layer},
            _rows(rec.resid[layer], cols),
            self.ends[: layer + 1],
        )


def _attn_out(parts: LayerParts, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`(W_O' [H, d, D], inv_s [N, P], constant [N, P, D] or None)` of layer l' whose head outputs
    at the chosen positions are `z [N, P, H, d]`."""
    N, P = z.shape[:2]
    if parts.out_norm is None:
        const = None if parts.b_O is None else parts.b_O.expand(N, P, -1)
        return parts.W_O, torch.ones(N, P, dtype=torch.float64), const
    pre = torch.einsum("nphd,hdD->npD", z, parts.W_O)
    if parts.b_O is not None:
        pre = pre + parts.b_O
    norm = parts.out_norm
    inv = 1.0 / norm.scale(pre)  # [N, P]
    const = None
    if parts.b_O is not None:
        b = parts.b_O
        b = b - b.mean() if norm.kind == "layer" else b
        const = norm.gain * b * inv[..., None]
    if norm.bias is not None:
        const = norm.bias.expand(N, P, -1) if const is None else const + norm.bias
    return parts.write(), inv, const


def components(
    model: HeadModel,
    rec: Recording,
    parts: list[LayerParts],
    layer: int,
    cols: torch.Tensor,
    position_ids: torch.Tensor,
) -> Components:
    """The components of the residual entering `layer` at padded columns `cols [N, P]`.

    `parts` holds `LayerParts` of layers `0..layer-1`; `position_ids [N, T]` the run's positions
    (GPT-2's position embedding is read at them)."""
    x0 = _rows(rec.resid[0], cols)
    names: list[str] = []
    resid: list[torch.Tensor | None] = []
    wpe = getattr(model.decoder, "wpe", None)
    if wpe is not None:  # GPT-2: learned absolute positions join the residual at the input
        pos = wpe.weight.detach().double().cpu()[_rows(position_ids, cols)]
        names += ["embed", "pos_embed"]
        resid += [x0 - pos, pos]
    else:
        names.append("embed")
        resid.append(x0)
    heads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    head_index: dict[str, tuple[int, int]] = {}
    ends = [len(names)]
    for la in range(layer):
        z = _rows(rec.z[la], cols)  # [N, P, H, d]
        w_o, inv, const = _attn_out(parts[la], z)
        heads.append((z, w_o, inv))
        for h in range(z.shape[2]):
            name = f"L{la}H{h}"
            head_index[name] = (la, h)
            names.append(name)
            resid.append(None)
        attn = torch.einsum("nphd,hdD->npD", z, w_o) * inv[..., None]
        if const is not None:
            names.append(f"{la}_attn_bias")
            resid.append(const)
            attn = attn + const
        mlp = _rows(rec.resid[la + 1], cols) - _rows(rec.resid[la], cols) - attn
        names.append(f"{la}_mlp_out")
        resid.append(mlp)
        ends.append(len(names))
    return Components(names, resid, heads, head_index, _rows(rec.resid[layer], cols), ends)


@dataclass
class Side:
    """One side of a layer's heads as a sum of components.

    Attributes:
        vectors: `[N, C + 1, X, P, d]` fp64: component c's share of head x's query / key / value
            at each position (QK-normed and rotated as the head computes it); the last entry is
            the constant (`"bias"`: norm and projection biases).
        names: the `C + 1` component names (`"bias"` last).
        total: `[N, X, P, d]` the head's vector recomputed from the whole residual (equals
            `vectors.sum(1)` up to float rounding).
        inv: `[N, P]` the input norm's frozen 1/scale at each position.
        qk_factor: `[N, X, P, d]` the QK-norm's gain over its frozen scale, or None.
        w_read: `[X, D, d]` the projection folded with the input norm's gain (and centring).
        rot: `[N, P, d, d]` the rotary maps as matrices (`R_p v = v @ rot[n, p]`), or None.
    """

    vectors: torch.Tensor
    names: list[str]
    total: torch.Tensor
    inv: torch.Tensor
    qk_factor: torch.Tensor | None
    w_read: torch.Tensor
    rot: torch.Tensor | None


def _constant(parts: LayerParts, W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """`[X, d]` the pre-norm constant of heads with projections `W [X, D, d]` and bias `b`."""
    const = torch.zeros(W.shape[0], W.shape[-1], dtype=torch.float64)
    if parts.in_norm is not None and parts.in_norm.bias is not None:
        const = const + torch.einsum("D,xDd->xd", parts.in_norm.bias, W)
    return const if b is None else const + b


def side(comps: Components, parts: LayerParts, kind: str, sel: list[int], positions: torch.Tensor) -> Side:
    """The `kind` side (`"q"`, `"k"` or `"v"`) of heads `sel` (query heads for q, KV heads for
    k / v) of `parts.layer`, at the positions of `comps` (`positions [N, P]`: the rotary
    positions of those columns)."""
    W = {"q": parts.W_Q, "k": parts.W_K, "v": parts.W_V}[kind]  # [X_all, D, d]
    b = {"q": parts.b_Q, "k": parts.b_K, "v": parts.b_V}[kind]
    qk = {"q": parts.q_norm, "k": parts.k_norm, "v": None}[kind]
    x = comps.x  # [N, P, D]
    N, P, _ = x.shape
    X, d = len(sel), W.shape[-1]
    w_read = parts.read(W[sel])  # [X, D, d]
    inv = torch.ones(N, P, dtype=torch.float64) if parts.in_norm is None else 1.0 / parts.in_norm.scale(x)
    C = len(comps.names)
    vectors = torch.empty(N, C + 1, X, P, d, dtype=torch.float64)  # filled in place (memory: one copy)
    first = {la: comps.names.index(f"L{la}H0") for la in range(len(comps.heads))}
    for la, (z, w_o, inv_o) in enumerate(comps.heads):  # head h of layer l' reads through W_O' W_read
        H, dz, D = w_o.shape
        via_weights = H * dz * D * X * d + N * P * H * X * dz * d  # compose W_O' W_read, then apply
        via_resid = N * P * H * dz * D + N * P * H * D * X * d  # each head's residual vector first
        if via_weights <= via_resid:  # many positions: the [H, X, d, d] product once
            m = torch.einsum("hdD,xDe->hxde", w_o, w_read)
            a = torch.einsum("nphd,hxde->nhxpe", z, m)
        else:  # few positions (one query per head): never form the weight product
            a = torch.einsum("nphD,xDe->nhxpe", torch.einsum("nphd,hdD->nphD", z, w_o), w_read)
        vectors[:, first[la] : first[la] + H] = a * (inv_o * inv)[:, None, None, :, None]
    for c, r in enumerate(comps.resid):
        if r is not None:
            vectors[:, c] = torch.einsum("npD,xDd->nxpd", r, w_read) * inv[:, None, :, None]
    pre_const = _constant(parts, W[sel], None if b is None else b[sel])[None, :, None, :].expand(N, -1, P, -1)
    # the head's own pre-norm vector from the whole residual (the run's value)
    full = torch.einsum("npD,xDd->nxpd", x, w_read) * inv[:, None, :, None] + pre_const
    factor = None
    vectors[:, C] = pre_const
    if qk is not None:
        if parts.qk_norm == "per_head":
            s_qk = qk.scale(full)  # [N, X, P]
            gain = qk.gain.expand(X, d)
            shift = None if qk.bias is None else qk.bias.expand(X, d)
        else:  # over all heads: the scale reads every head's pre-norm vector
            n_all = W.shape[0]
            u_all = torch.einsum("npD,xDd->npxd", x, parts.read(W)) * inv[..., None, None] + _constant(
                parts, W, b
            )
            s_qk = qk.scale(u_all.reshape(N, P, -1))[:, None, :].expand(N, X, P)
            gain = qk.gain.reshape(n_all, d)[sel]
            shift = None if qk.bias is None else qk.bias.reshape(n_all, d)[sel]
        factor = gain[None, :, None, :] / s_qk[..., None]  # [N, X, P, d]
        vectors.mul_(factor[:, None])
        full = full * factor
        if shift is not None:
            vectors[:, -1] = vectors[:, -1] + shift[None, :, None, :]
            full = full + shift[None, :, None, :]
    rot = parts.rotation(positions) if kind != "v" else None
    if rot is not None and parts.rotary is not None:  # the family's own rotary, elementwise, in chunks
        step = max(1, (1 << 22) // max(1, N * X * P * d))  # components per chunk: ~32 MB at a time
        for c0 in range(0, C + 1, step):
            chunk = vectors[:, c0 : c0 + step]
            n_c = chunk.shape[1]
            flat = chunk.reshape(N, n_c * X, P, d)
            vectors[:, c0 : c0 + step] = parts.rotary(flat, positions).reshape(N, n_c, X, P, d)
        full = parts.rotary(full, positions)
    return Side(vectors, [*comps.names, "bias"], full, inv, factor, w_read, rot)
