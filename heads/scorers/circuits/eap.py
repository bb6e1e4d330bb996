"""EAP and EAP-IG edge scores in memory linear in the prompt (`heads.scorers.circuits.scores`).

score(u -> v) = sum over positions of (a_u(x~) - a_u(x)) . dM/dv_in, averaged over the
interpolation steps for EAP-IG. Nothing of size `[edges, T, D]` is kept:

* the activation differences are kept compactly, per layer: the heads' `z(x~) - z(x)`
  `[R, T, H, d]` (post-norm families: `z / s`, the frozen scale per run) and the MLPs'
  `[R, T, D]`, one corrupted and one clean forward without gradients;
* the gradients come one layer at a time (`heads.scorers.layerwise`): layer l runs alone from its
  recorded input with zero deltas added at its q / k / v sites, the MLP's input (`resid_mid`,
  taken back out at `resid_post`) and, in the last layer, the final norm's input; the gradient
  at a head's q input in the residual stream is the q-site gradient through W_Q[h] and the
  attention norm's Jacobian (one vector-Jacobian product of the norm per head);
* each layer's downstream gradients `[S, R, T, D]` meet the differences of every node below
  (the heads' projected through W_O, a few heads at a time) and are dropped.

Peak memory: about 2 L + L / every + every + S residual-stream copies per pair chunk plus one
layer's graph, against L (H + 1) + L (H + 2 G + 1) copies for the dense edge form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from heads.engine.activations import ActivationEdit
from heads.engine.edits import AttentionCall, Edit
from heads.model.adapter import HeadModel
from heads.model.parts import norm_stats
from heads.scorers.circuits.layout import Graph
from heads.scorers.circuits.nodes import LayerParts, embed_output, layer_parts
from heads.scorers.layerwise import default_every, inputs_down, record_inputs, run_layer

__all__ = ["HEAD_CHUNK", "eap_chunk"]

HEAD_CHUNK = 4
"""Heads whose outputs are projected to the residual stream at once when scoring (bounds memory)."""

Loss = Callable[[torch.Tensor], torch.Tensor]
"""`logits [R, V] fp32 -> scalar`: the metric summed over the rows."""


class _Nodes:
    """Reads of the upstream nodes' outputs in one forward: the corrupted run stores them, the
    clean run subtracts its own (so the store holds `a(x~) - a(x)`)."""

    def __init__(self, model: HeadModel, parts: list[LayerParts]):
        L = model.n_layers
        self.parts = parts
        self.post = parts[0].post is not None
        self.input: torch.Tensor | None = None
        self.z: list[torch.Tensor | None] = [None] * L
        self.mlp: list[torch.Tensor | None] = [None] * L
        self._z: list[torch.Tensor | None] = [None] * L  # post-norm: z until its scale is read
        self.sign = 1.0  # +1 while recording the corrupted run, -1 for the clean one

    def _put(self, store: list[torch.Tensor | None], la: int, value: torch.Tensor) -> None:
        v = value.detach().float()
        if self.sign > 0:
            store[la] = v.clone()
        else:
            cast(torch.Tensor, store[la]).sub_(v)

    def edits(self) -> list[Edit]:
        return [e for la in range(len(self.z)) for e in self.layer_edits(la)]

    def layer_edits(self, la: int) -> list[Edit]:
        """The reads of layer `la`'s nodes (and, in layer 0, of the input's)."""
        out: list[Edit] = [ActivationEdit("residual", 0, self._input)] if la == 0 else []
        out.append(ActivationEdit("head_output", la, self._head(la)))
        if self.post:
            out.append(ActivationEdit("attn_out_pre_norm", la, self._scale(la)))
        out.append(ActivationEdit("mlp_out", la, self._mlp(la)))
        return out

    def _input(self, x: torch.Tensor, call: AttentionCall) -> None:
        v = x.detach().float()
        self.input = v.clone() if self.sign > 0 else cast(torch.Tensor, self.input).sub_(v)

    def _head(self, la: int) -> Callable[[torch.Tensor, AttentionCall], None]:
        def fn(z: torch.Tensor, call: AttentionCall) -> None:
            if self.post:
                self._z[la] = z.detach()
            else:
                self._put(self.z, la, z)

        return fn

    def _scale(self, la: int) -> Callable[[torch.Tensor, AttentionCall], None]:
        post = cast(nn.Module, self.parts[la].post)

        def fn(x: torch.Tensor, call: AttentionCall) -> None:
            scale, _ = norm_stats(post, x)  # [R, T, 1] fp32
            z = cast(torch.Tensor, self._z[la])
            self._z[la] = None
            self._put(self.z, la, z.float() / scale[..., None])

        return fn

    def _mlp(self, la: int) -> Callable[[torch.Tensor, AttentionCall], None]:
        def fn(o: torch.Tensor, call: AttentionCall) -> None:
            self._put(self.mlp, la, o)

        return fn

    def mask(self, mask: torch.Tensor) -> None:
        """Zero the differences at padding positions (`mask [R, T]`); the heads' differences
        become `[H, R T, d]` (one matrix per head for the projection through W_O)."""
        m = mask.to(cast(torch.Tensor, self.input).device, torch.float32)
        cast(torch.Tensor, self.input).mul_(m[..., None])
        for la, (z, o) in enumerate(zip(self.z, self.mlp, strict=True)):
            zm = cast(torch.Tensor, z).mul_(m[..., None, None])  # [R, T, H, d]
            self.z[la] = zm.permute(2, 0, 1, 3).reshape(zm.shape[2], -1, zm.shape[3]).contiguous()
            cast(torch.Tensor, o).mul_(m[..., None])


def _add(delta: torch.Tensor) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor]:
    def fn(x: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return x + delta.to(x.dtype)

    return fn


def _interpolate(e_corr: torch.Tensor, alpha: float) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor]:
    """The embedding output becomes `e(x~) + alpha (e(x) - e(x~))` (EAP-IG over the inputs)."""

    def fn(e: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        c = e_corr.to(e.device, e.dtype)
        return c + alpha * (e - c)

    return fn


def _norm_form(
    norm: nn.Module, x: torch.Tensor, normed: torch.Tensor
) -> tuple[str, torch.Tensor, float] | None:
    """`("rms" | "layer", gain [D] fp32, eps)` when `norm` computes an RMSNorm (`g x / rms(x)`,
    gain `weight`, `1 + weight` or none) or a LayerNorm (`g (x - mean) / std + b`) of `x`: the
    form is chosen by recomputing `normed = norm(x)` ([..., D] fp32, as the module gave it) with
    each candidate (within 1e-5 of its scale); None unless exactly one matches."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    w = getattr(norm, "weight", None)
    if not isinstance(eps, float) or x.dtype != torch.float32 or normed.dtype != torch.float32:
        return None
    gains = [torch.ones(x.shape[-1], device=x.device)]
    if isinstance(w, torch.Tensor) and w.shape == x.shape[-1:]:
        gains = [w.detach().float(), 1.0 + w.detach().float()]
    bias = getattr(norm, "bias", None)
    b = bias.detach().float() if isinstance(bias, torch.Tensor) else 0.0
    tol = 1e-5 * float(normed.abs().max()) + 1e-30
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    mu = x.mean(-1, keepdim=True)
    xh = (x - mu) * torch.rsqrt((x - mu).pow(2).mean(-1, keepdim=True) + eps)
    found: list[tuple[str, torch.Tensor, float]] = []
    for g in gains:
        if not isinstance(bias, torch.Tensor) and float((g * x * r - normed).abs().max()) <= tol:
            found.append(("rms", g, eps))
        if float((g * xh + b - normed).abs().max()) <= tol:
            found.append(("layer", g, eps))
    return found[0] if len(found) == 1 else None  # none, or ambiguous (x of mean ~0): autograd


def _norm_vjp(
    norm: nn.Module, x: torch.Tensor, normed: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`a [n, ..., D] -> J_norm(x)^T a` in closed form when `norm` is an RMSNorm or a LayerNorm
    (`_norm_form`); None (autograd then) otherwise. Both are the Jacobians of their formulas:
    RMS `r (g a) - r^3 x (x . g a) / D`; LayerNorm `s (b - mean(b) - xh mean(b xh))`, b = g a,
    xh = (x - mean) s."""
    form = _norm_form(norm, x, normed)
    if form is None:
        return None
    kind, g, eps = form
    D = x.shape[-1]
    if kind == "rms":
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

        def rms(a: torch.Tensor) -> torch.Tensor:
            ga = a * g
            return r * ga - (r.pow(3) / D) * x * (x * ga).sum(-1, keepdim=True)

        return rms
    mu = x.mean(-1, keepdim=True)
    s = torch.rsqrt((x - mu).pow(2).mean(-1, keepdim=True) + eps)
    xh = (x - mu) * s

    def layer(a: torch.Tensor) -> torch.Tensor:
        ga = a * g
        return s * (ga - ga.mean(-1, keepdim=True) - xh * (ga * xh).mean(-1, keepdim=True))

    return layer


def _residual_grads(
    part: LayerParts, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, out: torch.Tensor
) -> None:
    """Write into `out [n, R, T, D]` the gradient at each of n heads' own copy of the residual
    entering the attention norm, from the gradients `g [R, T, n, d]` at the heads' projections
    (weights `w [n, D, d]`): `J_norm(x)^T (W[h] g_h)`, `HEAD_CHUNK` heads at a time (in closed
    form for RMS / LayerNorms, `_norm_vjp`; else one batched vector-Jacobian product)."""
    identity = isinstance(part.norm1, nn.Identity)
    vjp = None
    if not identity:
        with torch.no_grad():
            vjp = _norm_vjp(part.norm1, x, part.norm1.forward(x))
    with torch.enable_grad():
        xc = x.detach().requires_grad_(vjp is None and not identity)
        normed = xc if identity or vjp is not None else part.norm1.forward(xc)
        for h0 in range(0, w.shape[0], HEAD_CHUNK):
            h1 = min(w.shape[0], h0 + HEAD_CHUNK)
            proj = torch.einsum("rtnd,nDd->nrtD", g[:, :, h0:h1].to(w.dtype), w[h0:h1])
            if identity:
                out[h0:h1] = proj
                continue
            if vjp is not None:
                out[h0:h1] = vjp(proj)
                continue
            try:
                (res,) = torch.autograd.grad(
                    normed, xc, grad_outputs=proj.to(normed.dtype), is_grads_batched=True, retain_graph=True
                )
            except RuntimeError:  # a norm without batching rules: one product per head
                res = torch.stack([torch.autograd.grad(normed, xc, p, retain_graph=True)[0] for p in proj])
            out[h0:h1] = res
            del proj, res


def _layer_grads(
    model: HeadModel,
    graph: Graph,
    ids: torch.Tensor,
    mask: torch.Tensor,
    la: int,
    x_in: torch.Tensor,
    g_out: torch.Tensor | None,
    loss: Loss | None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Layer `la` with gradients: `(dM / d(stream entering la) [R, T, D], [the gradients at its
    q / k / v sites [R, T, H | G, d], at the MLP's input [R, T, D] and, in the last layer, at the
    final norm's input [R, T, D]])` (compact: the q / k / v ones not yet in the residual stream)."""
    H, G, d = graph.n_heads, graph.n_kv_heads, model.d_head
    R, T, D = x_in.shape
    last = la == graph.n_layers - 1
    dt = x_in.dtype
    x = x_in.detach().requires_grad_(True)
    zeros = {
        "q": torch.zeros(R, T, H, d, dtype=dt, device=x.device, requires_grad=True),
        "k": torch.zeros(R, T, G, d, dtype=dt, device=x.device, requires_grad=True),
        "v": torch.zeros(R, T, G, d, dtype=dt, device=x.device, requires_grad=True),
    }
    d_mlp = torch.zeros(R, T, D, dtype=dt, device=x.device, requires_grad=True)
    leaves = [x, *zeros.values(), d_mlp]
    edits: list[Edit] = [ActivationEdit(w, la, _add(z)) for w, z in zeros.items()]
    edits.append(ActivationEdit("resid_mid", la, _add(d_mlp)))
    if last:
        d_logits = torch.zeros(R, T, D, dtype=dt, device=x.device, requires_grad=True)
        leaves.append(d_logits)
        edits.append(ActivationEdit("resid_post", la, _add(d_logits - d_mlp)))
    else:
        edits.append(ActivationEdit("resid_post", la, _add(-d_mlp)))
    out = run_layer(model, ids, mask, la, x, edits)
    with torch.enable_grad():
        if last:
            target = cast(Loss, loss)(out.float())
            grads = torch.autograd.grad(target, leaves, allow_unused=True)
        else:
            grads = torch.autograd.grad(
                out, leaves, grad_outputs=cast(torch.Tensor, g_out), allow_unused=True
            )
    got = [torch.zeros_like(v) if g is None else g.detach() for v, g in zip(leaves, grads, strict=True)]
    del grads, out
    return got[0], got[1:]


def _layer_step(
    model: HeadModel,
    graph: Graph,
    ids: torch.Tensor,
    mask: torch.Tensor,
    la: int,
    x_in: torch.Tensor,
    g_out: torch.Tensor | None,
    loss: Loss | None,
    parts: LayerParts,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `la` with gradients: `(dM / d(stream entering la) [R, T, D], the gradients at its
    downstream inputs [S', R, T, D] in graph order: q heads, k, v, MLP, and logits in the last
    layer)`."""
    H, G = graph.n_heads, graph.n_kv_heads
    R, T, D = x_in.shape
    g_in, compact = _layer_grads(model, graph, ids, mask, la, x_in, g_out, loss)
    got = [g_in, *compact]
    g_down = torch.empty(H + 2 * G + len(got) - 4, R, T, D, dtype=torch.float32, device=x_in.device)
    lo = 0
    for which, g in zip(("q", "k", "v"), got[1:4], strict=True):
        n = g.shape[2]
        _residual_grads(parts, x_in, g, parts.w[which], g_down[lo : lo + n])
        lo += n
    for g in got[4:]:  # the MLP's input, the logits
        g_down[lo] = g
        lo += 1
    return g_in, g_down


def _score_layer(
    scores: torch.Tensor,
    graph: Graph,
    la: int,
    g_down: torch.Tensor,
    diffs: _Nodes,
    w_o: list[torch.Tensor],
) -> None:
    """Add `(a_u(x~) - a_u(x)) . g_v` for the downstream inputs v of layer `la` (`g_down [S', R,
    T, D]`) and every upstream node u up to layer `la` into `scores [R, U, Dn]` (entries that
    are not edges are zeroed by the caller): one matrix product per row, `[n, T D] x [T D, S']`;
    the heads' differences `[H, R T, d]` are projected through W_O `HEAD_CHUNK` heads at a time."""
    H = graph.n_heads
    S, R = g_down.shape[0], g_down.shape[1]
    lo = graph.q_input(la, 0)
    hi = lo + S
    dev = w_o[0].device
    g = g_down.to(dev).reshape(S, R, -1)  # [S', R, T D]
    inp = cast(torch.Tensor, diffs.input).to(dev).reshape(R, -1)
    rows = range(R)
    for r in rows:
        scores[r, 0, lo:hi] += (g[:, r] @ inp[r]).to(scores.device)
    for lp in range(la + 1):
        dz = cast(torch.Tensor, diffs.z[lp]).to(dev)  # [H, R T, d]
        for h0 in range(0, H, HEAD_CHUNK):
            h1 = min(H, h0 + HEAD_CHUNK)
            proj = torch.bmm(dz[h0:h1], w_o[lp][h0:h1]).reshape(h1 - h0, R, -1)  # [h, R, T D]
            u0 = graph.head_node(lp, h0)
            for r in rows:
                scores[r, u0 : u0 + h1 - h0, lo:hi] += (proj[:, r] @ g[:, r].T).to(scores.device)
            del proj
        dm = cast(torch.Tensor, diffs.mlp[lp]).to(dev).reshape(R, -1)
        for r in rows:
            scores[r, graph.mlp_node(lp), lo:hi] += (g[:, r] @ dm[r]).to(scores.device)


def eap_chunk(
    model: HeadModel,
    graph: Graph,
    clean_ids: torch.Tensor,
    corrupted_ids: torch.Tensor,
    mask: torch.Tensor,
    loss: Loss,
    *,
    steps: int | None = None,
    every: int | None = None,
) -> torch.Tensor:
    """`[R, U, Dn]` fp32 EAP scores of every (u, v) for the R pairs (each pair's own score; 0
    where there is no edge), or EAP-IG over the inputs with `steps` interpolation points
    k / steps, k = 1..steps (Hanna et al. 2024, Eq. 3).

    Args:
        clean_ids, corrupted_ids, mask: `[R, T]` (left-padded, equal lengths).
        loss: the metric summed over the rows, from the logits `[R, V]` at the last position.
        steps: None for EAP, m for EAP-IG.
        every: layers per recomputed segment of the layer-by-layer backward (default ~sqrt(L)).
    """
    L = graph.n_layers
    every = default_every(L) if every is None else every
    sparse_layers = list(range(0, L, every))
    parts = [layer_parts(model, la) for la in range(L)]
    w_o = [
        p.w_o.float() if p.gain is None else p.w_o.float() * p.gain.to(p.w_o.device)[None, None]
        for p in parts
    ]
    diffs = _Nodes(model, parts)
    record_inputs(model, corrupted_ids, mask, [], diffs.edits())
    diffs.sign = -1.0
    _, clean_sparse = record_inputs(model, clean_ids, mask, sparse_layers, diffs.edits())
    diffs.mask(mask)
    R = clean_ids.shape[0]
    scores = torch.zeros(R, graph.n_upstream, graph.n_downstream)
    n_runs = 1 if steps is None else steps
    e_corr = embed_output(model, corrupted_ids) if steps is not None else None
    for k in range(n_runs, 0, -1):
        if k == n_runs:
            sparse = clean_sparse
        else:
            ec, alpha = cast(torch.Tensor, e_corr), k / n_runs

            def interpolate(
                e: torch.Tensor, call: AttentionCall, ec: torch.Tensor = ec, a: float = alpha
            ) -> torch.Tensor:
                c = ec.to(e.device, e.dtype)
                return c + a * (e - c)

            _, sparse = record_inputs(
                model, clean_ids, mask, sparse_layers, [ActivationEdit("embed", 0, interpolate)]
            )
        step = torch.zeros_like(scores)
        g_out: torch.Tensor | None = None
        for la, x_in in inputs_down(model, clean_ids, mask, sparse, every):
            g_out, g_down = _layer_step(model, graph, clean_ids, mask, la, x_in, g_out, loss, parts[la])
            _score_layer(step, graph, la, g_down, diffs, w_o)
            del g_down
        scores += step
    scores /= n_runs
    scores[:, ~graph.valid] = 0.0
    return scores
