"""EAP and EAP-IG without holding every node's activation difference (`eap_chunk_lean`).

The same scores as `heads.scorers.circuits.eap.eap_chunk` (up to float rounding in the order of
the sums), with less kept. `eap_chunk` holds every upstream node's `a(x~) - a(x)` for the whole
walk down the layers (about 2 L residual-stream copies) and the walk's recorded residuals. Here
neither is held. The walk down goes a block of `block` downstream layers at a time (default
`BLOCK`; `edge_scores` picks it from the memory plan, `eap_path.choose_path`):
each layer of the block runs alone with gradients from its input and the gradient reaching its
output, and only its compact gradients are kept (the q / k / v site gradients `[R, T, H | G, d]`,
the MLP's input gradient `[R, T, D]`: about 2.7 copies) with its input. Then a sweep without
gradients runs the corrupted and the clean run (and, for an EAP-IG point other than the clean
input, the interpolated run the gradients were taken on) one layer at a time from the embedding
up to the block's top layer: each layer's differences (2 copies) meet the block's gradients,
expanded to the residual stream `1 / POSITION_CHUNKS` of the positions at a time
(`J_norm(x)^T W[h]^T g_h`, `_Expander`), and are dropped; on its way up the sweep keeps the inputs of the
next block's layers (the gradient run's stream), so no residual is recorded for the walk (one
forward without gradients records the top block's inputs).

Cost: about `L (L / block + 1) / 2` layer forwards of each swept run per walk (the sweeps; a
sweep layer costs about 1.1 layer forwards: its MLP chunks skip the attention), one forward, the
walk's layer backwards (about 3 layer forwards each) and one gradient expansion per (upstream
layer, downstream layer) pair (about 0.3-0.4 layer forwards each): on SmolLM2 (30 layers, block
2) about 30 forwards, 2-3x the default path. Peak memory: about `block (2 + 2.7) + 1` residual
copies kept (the block's inputs and gradients, the next block's inputs, the gradient at the
block's bottom) beside the sweep's working set (the swept runs' streams, one layer's
differences and forward, a chunk of their projection) or one layer's graph; `eap_chunk` keeps
`2 L + L / every + every + S`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import cast

import torch
from torch import nn

from heads.engine.activations import ActivationEdit
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Edit
from heads.engine.forward import run_last
from heads.engine.prefix import attention_given, starting_at
from heads.model.adapter import HeadModel
from heads.scorers.circuits.eap import (
    Loss,
    _add,
    _interpolate,
    _layer_grads,
    _Nodes,
    _norm_form,
    _residual_grads,
)
from heads.scorers.circuits.layout import Graph
from heads.scorers.circuits.nodes import LayerParts, embed_output, layer_parts
from heads.scorers.layerwise import attention_half, has_mid, mlp_half, record_inputs

__all__ = ["eap_chunk_lean"]


class _Stop(Exception):
    """Ends a forward once the layer that was asked for has run."""


@torch.no_grad()
def _forward_layer(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    la: int,
    x: torch.Tensor | None,
    reads: list[Edit],
    keep: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Layer `la` alone without gradients from `x` (`[R, T, D]` the residual entering it; None for
    layer 0: the model's own embedding, with the embedding edits of `reads`), with `reads` (of
    that layer): the stream leaving it. `keep`: the residual entering layer 0 is appended."""
    box: list[torch.Tensor] = []

    def replace(old: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return cast(torch.Tensor, x)

    def stop(y: torch.Tensor, call: AttentionCall) -> None:
        box.append(y)
        raise _Stop

    def read(y: torch.Tensor, call: AttentionCall) -> None:
        cast(list[torch.Tensor], keep).append(y.detach())

    edits: list[Edit] = [] if x is None else [ActivationEdit("residual", la, replace)]
    if x is None and keep is not None:
        edits.append(ActivationEdit("residual", 0, read))
    edits += [*reads, ActivationEdit("resid_post", la, stop)]
    _run_to(model, ids, mask, la, x, edits)
    return box[-1].detach()


def _run_to(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    la: int,
    x: torch.Tensor | None,
    edits: list[Edit],
) -> None:
    """A forward without gradients from layer `la` (from `x`; None: from the embedding) with
    `edits`, one of which ends it by raising `_Stop`."""
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(starting_at(model, la, x))
        stack.enter_context(editing(model, edits, require_fired=False))
        try:
            run_last(model, ids, mask)
        except _Stop:
            pass


def _forward_halves(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    la: int,
    x: torch.Tensor | None,
    reads: list[Edit],
    mlp_read: Callable[[int, torch.Tensor], None] | None,
    keep: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """`_forward_layer` for blocks with a `resid_mid` site: the attention half on every position
    (with `reads`, which must not read the MLP's output), then the MLP half `SWEEP_CHUNKS` chunks
    of positions at a time from their `resid_mid` (position-wise: `layerwise.mlp_half`), so the
    MLP's intermediates exist for one chunk at a time (on the Hugging Face backend the chunks do
    not compute the attention again: `attention_given`, its output replaced at `resid_mid`
    anyway); `mlp_read(start, [R, c, D])` gets the MLP's output of each chunk. The stream leaving
    the layer `[R, T, D]`."""
    box: list[torch.Tensor] = []

    def stop(y: torch.Tensor, call: AttentionCall) -> None:
        box.append(y.detach())
        raise _Stop

    def read(y: torch.Tensor, call: AttentionCall) -> None:
        cast(list[torch.Tensor], keep).append(y.detach())

    edits: list[Edit] = [] if x is None else [ActivationEdit("residual", la, _replace(x))]
    if x is None and keep is not None:
        edits.append(ActivationEdit("residual", 0, read))
    _run_to(model, ids, mask, la, x, [*edits, *reads, ActivationEdit("resid_mid", la, stop)])
    mid = box.pop()
    out = torch.empty_like(mid)
    T = mid.shape[1]
    step = max(SWEEP_MIN_ROWS, -(-T // SWEEP_CHUNKS))
    for a in range(0, T, step):
        piece = mid[:, a : a + step]
        chunk: list[Edit] = [
            ActivationEdit("residual", la, _replace(piece)),
            ActivationEdit("resid_mid", la, _replace(piece)),
        ]
        if mlp_read is not None:
            chunk.append(ActivationEdit("mlp_out", la, _at(mlp_read, a)))
        chunk.append(ActivationEdit("resid_post", la, stop))
        p_ids = ids[:, a : a + step]
        skip: AbstractContextManager[None] = nullcontext()
        if model.backend.kind == "hf":  # its output is replaced at resid_mid: not computed
            skip = attention_given(model, {la: piece.new_zeros(1, 1, piece.shape[-1]).expand(piece.shape)})
        with skip:
            _run_to(model, p_ids, torch.ones_like(p_ids), la, piece if la else None, chunk)
        out[:, a : a + step] = box.pop()
    return out


def _at(read: Callable[[int, torch.Tensor], None], a: int) -> Callable[[torch.Tensor, AttentionCall], None]:
    def fn(o: torch.Tensor, call: AttentionCall) -> None:
        read(a, o.detach())

    return fn


def _replace(x: torch.Tensor) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor]:
    def fn(old: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return x

    return fn


BLOCK = 2
"""Downstream layers whose compact gradients are held per sweep recomputing the differences."""

POSITION_CHUNKS = 32
"""The positions are scored in this many chunks (the projected differences and the expanded
gradients exist for one chunk of positions at a time, in two buffers of `H + 2` and `H + 2 G`
rows: 0.8 residual copies at 32 chunks on SmolLM2; every term is a sum over positions)."""

POSITION_MIN_ROWS = 32
"""... of at least this many positions (shorter chunks cost more per position: at 1k tokens,
chunks of 16 positions took 1.4x the time of chunks of 128 per scored pair, 32: 1.07x)."""


def _differences(
    model: HeadModel,
    clean_ids: torch.Tensor,
    corrupted_ids: torch.Tensor,
    mask: torch.Tensor,
    parts: list[LayerParts],
    top: int,
    grad_edits: list[Edit] | None,
    keep: set[int],
    kept: dict[int, torch.Tensor],
) -> Iterator[tuple[int, list[torch.Tensor], torch.Tensor, torch.Tensor]]:
    """`(l, [the input's [R, T, D] in layer 0], the heads' [H, R, T, d], the MLP's [R, T, D])`
    for l = 0 .. top: layer l's upstream nodes' differences `a(x~) - a(x)` (the heads' before
    W_O; post-norm: over the frozen scale), fp32, zero at padding; one layer of both runs at a
    time, from the embedding up. The gradient run's residual entering each layer of `keep` is
    stored in `kept` (the clean run's when `grad_edits` is None, else a third run's, with those
    edits, run up to the highest layer of `keep`)."""
    nodes = _Nodes(model, parts)
    m = mask.to(model.device, torch.float32)
    xc: torch.Tensor | None = None
    xx: torch.Tensor | None = None
    xg: torch.Tensor | None = None
    last_kept = max(keep, default=-1)
    split = has_mid(model)
    R, T = clean_ids.shape

    def mlp_store(la: int, sign: float) -> Callable[[int, torch.Tensor], None]:
        if sign > 0:
            nodes.mlp[la] = torch.empty(R, T, model.d_model, dtype=torch.float32, device=model.device)

        def fn(a: int, o: torch.Tensor) -> None:
            dst = cast(torch.Tensor, nodes.mlp[la])[:, a : a + o.shape[1]]
            dst.copy_(o) if sign > 0 else dst.sub_(o.float())

        return fn

    def run(
        ids: torch.Tensor,
        la: int,
        x: torch.Tensor | None,
        reads: list[Edit],
        sign: float | None,
        box: list | None,
    ) -> torch.Tensor:
        if not split:
            return _forward_layer(model, ids, mask, la, x, reads, box)
        heads_only = [e for e in reads if getattr(e, "site", None) != "mlp_out"]
        store = None if sign is None else mlp_store(la, sign)
        return _forward_halves(model, ids, mask, la, x, heads_only, store, box)

    for la in range(top + 1):
        box: list[torch.Tensor] | None = [] if la == 0 and 0 in keep else None  # layer 0's input
        nodes.sign = 1.0
        xx = run(corrupted_ids, la, xx, nodes.layer_edits(la), 1.0, None)
        nodes.sign = -1.0
        if grad_edits is None:
            if la and la in keep:
                kept[la] = cast(torch.Tensor, xc)
            xc = run(clean_ids, la, xc, nodes.layer_edits(la), -1.0, box)
        else:
            xc = run(clean_ids, la, xc, nodes.layer_edits(la), -1.0, None)
            if la and la in keep:
                kept[la] = cast(torch.Tensor, xg)
            if la < last_kept or box is not None:
                xg = run(clean_ids, la, xg, grad_edits, None, box)
        if box:
            kept[0] = box[0]
        if la == top:
            xc = xx = xg = None
        z = cast(torch.Tensor, nodes.z[la]).mul_(m[..., None, None])  # [R, T, H, d]
        o = cast(torch.Tensor, nodes.mlp[la]).mul_(m[..., None])
        nodes.z[la] = nodes.mlp[la] = None
        inp = [cast(torch.Tensor, nodes.input).mul_(m[..., None])] if la == 0 else []
        nodes.input = None
        zh = z.permute(2, 0, 1, 3).contiguous()  # [H, R, T, d]
        del z
        yield la, inp, zh, o
        del inp, zh, o


def _projected(
    inp: list[torch.Tensor],
    zh: torch.Tensor,
    o: torch.Tensor,
    w_o: torch.Tensor,
    t0: int,
    t1: int,
    buf: torch.Tensor,
) -> torch.Tensor:
    """`[n, R, c D]` fp32 (a view of the flat buffer `buf`): one layer's differences at positions
    t0 .. t1 - 1 in the residual stream, in graph order (the input in layer 0, the heads through
    W_O, the MLP)."""
    H, R, _, d = zh.shape
    c, D = t1 - t0, o.shape[-1]
    n = len(inp) + H + 1
    out = buf[: n * R * c * D].view(n, R, c, D)
    for i, r in enumerate(inp):
        out[i] = r[:, t0:t1]
    part = zh[:, :, t0:t1].reshape(H, R * c, d)
    torch.bmm(part, w_o.to(zh.device), out=out[len(inp) : len(inp) + H].view(H, R * c, D))
    out[-1] = o[:, t0:t1]
    return out.view(n, R, c * D)


FORM_ROWS = 64
"""Positions the attention norm's form is recognised on (`eap._norm_form`), once per held layer."""


class _Expander:
    """A held layer's downstream gradients in the residual stream, a chunk of positions at a time
    (`fill`): the q, k, v heads' `J_norm(x)^T W[h]^T g_h` (`eap._residual_grads`) into one buffer;
    the MLP's input (and the logits') gradients are `rest` as they are.

    The attention norm's form (`eap._norm_form`) is found once for the layer (on its input's last
    `FORM_ROWS` positions) and the norm's per-position scale computed once; then a chunk costs one
    batched matrix product per q / k / v and two in-place passes. A norm of no closed form (or a
    model not in fp32): `eap._residual_grads` per chunk, as before."""

    def __init__(self, part: LayerParts, x: torch.Tensor, compact: list[torch.Tensor]) -> None:
        self.part, self.x = part, x
        self.qkv = compact[:3]  # [R, T, n, d]
        self.rest = compact[3:]  # [R, T, D]: the MLP's input, the logits in the last layer
        self.n = sum(g.shape[2] for g in self.qkv)
        self.identity = isinstance(part.norm1, nn.Identity)
        self.form = None
        if not self.identity:  # the module's form, found on the last positions (real in every row)
            tail = x[:, -min(x.shape[1], FORM_ROWS) :]
            with torch.no_grad():
                self.form = _norm_form(part.norm1, tail, part.norm1.forward(tail))
        self.gain = None if self.form is None else self.form[1].to(x.device)  # [D]
        self.scale: torch.Tensor | None = None  # [R, T, 1]: rms: 1 / rms(x); layer: 1 / std(x)
        self.mean: torch.Tensor | None = None
        if self.form is not None:
            kind, _, eps = self.form
            if kind == "rms":  # (no [R, T, D] temporary)
                ms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).pow_(2).div_(x.shape[-1])
                self.scale = torch.rsqrt(ms + eps)
            else:
                var, self.mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
                self.scale = torch.rsqrt(var + eps)

    def fill(self, t0: int, t1: int, out: torch.Tensor) -> None:
        """Write the q, k, v heads' gradients at positions t0 .. t1 - 1 into `out [n, R, c, D]`
        fp32 (graph order: q heads, k, v)."""
        R, _, D = self.x.shape
        c = t1 - t0
        closed = self.form is not None or (self.identity and self.x.dtype == torch.float32)
        lo = 0
        for which, g in zip(("q", "k", "v"), self.qkv, strict=True):
            n, w = g.shape[2], self.part.w[which]  # [n, D, d]
            if not closed:  # autograd's vector-Jacobian product of the norm
                _residual_grads(self.part, self.x[:, t0:t1], g[:, t0:t1], w, out[lo : lo + n])
            else:
                gp = g[:, t0:t1].permute(2, 0, 1, 3).reshape(n, R * c, -1).to(w.dtype)
                torch.bmm(gp, w.transpose(1, 2), out=out[lo : lo + n].view(n, R * c, D))
            lo += n
        if self.form is None:
            return
        a = out.view(self.n, R * c, D)  # W^T g_h; b = gain a below
        scale = cast(torch.Tensor, self.scale)[:, t0:t1].reshape(R * c, 1)
        gain = cast(torch.Tensor, self.gain)
        xc = self.x[:, t0:t1].reshape(R * c, D)
        if self.form[0] == "rms":  # r b - r^3 x (x . b) / D
            coef = torch.einsum("nrD,rD->nr", a, xc * gain).unsqueeze(-1).mul_(scale.pow(3) / D)
            a.mul_(scale * gain).addcmul_(xc, coef, value=-1.0)
        else:  # s (b - mean(b) - xh mean(b xh)), xh = (x - mean) s
            xh = (xc - cast(torch.Tensor, self.mean)[:, t0:t1].reshape(R * c, 1)) * scale
            m1 = torch.einsum("nrD,D->nr", a, gain).unsqueeze(-1).mul_(scale / D)
            m2 = torch.einsum("nrD,rD->nr", a, xh * gain).unsqueeze(-1).mul_(scale / D)
            a.mul_(scale * gain).sub_(m1).addcmul_(xh, m2, value=-1.0)


def _score_block(
    scores: torch.Tensor,
    model: HeadModel,
    graph: Graph,
    clean_ids: torch.Tensor,
    corrupted_ids: torch.Tensor,
    mask: torch.Tensor,
    parts: list[LayerParts],
    w_o: list[torch.Tensor],
    held: list[tuple[int, torch.Tensor, list[torch.Tensor]]],
    grad_edits: list[Edit] | None,
    keep: set[int],
) -> dict[int, torch.Tensor]:
    """Add `(a_u(x~) - a_u(x)) . g_v` into `scores [R, U, Dn]` for the downstream inputs v of the
    layers in `held` (`(layer, its input [R, T, D], its compact gradients)`) and every upstream
    node u up to each such layer, `POSITION_CHUNKS` chunks of positions at a time (the projected
    differences and the expanded gradients of a chunk in two buffers, one pair per sweep layer,
    freed before the next layer's forward); returns the
    gradient run's residual entering the layers of `keep` (`_differences`)."""
    R, T = clean_ids.shape
    D = model.d_model
    top = max(m for m, _, _ in held)
    step = max(POSITION_MIN_ROWS, -(-T // POSITION_CHUNKS))
    kept: dict[int, torch.Tensor] = {}
    expanders = [(m, _Expander(parts[m], x, compact)) for m, x, compact in held]
    dev = held[0][1].device
    n_d, n_g = (graph.n_heads + 2) * R * step * D, max(e.n for _, e in expanders) * R * step * D
    sweep = _differences(model, clean_ids, corrupted_ids, mask, parts, top, grad_edits, keep, kept)
    for la, inp, zh, o in sweep:
        u0 = 0 if la == 0 else graph.head_node(la, 0)
        d_buf = torch.empty(n_d, dtype=torch.float32, device=dev)  # freed before the next layer runs
        g_buf = torch.empty(n_g, dtype=torch.float32, device=dev)
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            c = t1 - t0
            diff = _projected(inp, zh, o, w_o[la], t0, t1, d_buf)
            u1 = u0 + diff.shape[0]
            for m, e in expanders:
                if m < la:
                    continue
                v0 = graph.q_input(m, 0)
                g = g_buf[: e.n * R * c * D].view(e.n, R, c, D)
                e.fill(t0, t1, g)
                gv = g.view(e.n, R, c * D)
                rest = [extra[:, t0:t1].float().reshape(R, c * D) for extra in e.rest]
                for r in range(R):
                    dr = diff[:, r]
                    scores[r, u0:u1, v0 : v0 + e.n] += (dr @ gv[:, r].T).to(scores.device)
                    for i, extra in enumerate(rest):
                        scores[r, u0:u1, v0 + e.n + i] += (dr @ extra[r]).to(scores.device)
            del diff
        del inp, zh, o, d_buf, g_buf
    return kept


MLP_CHUNKS = 8
"""Position chunks of a layer's MLP half with gradients (its graph for one chunk at a time)."""

SWEEP_CHUNKS = 4
"""Position chunks of a layer's MLP half in the sweeps (its intermediates for one chunk at a time:
below the attention half's peak; each chunk also runs the layer's attention on its positions)."""

SWEEP_MIN_ROWS = 64
"""Positions of the sweeps' smallest MLP chunk: shorter prompts run the MLP whole (a chunk's
matrix products round differently from the whole's, which the differences' cancellation can
magnify to a few 1e-6 of the score scale; with no memory to win on short prompts)."""


def _split_grads(
    model: HeadModel,
    graph: Graph,
    ids: torch.Tensor,
    mask: torch.Tensor,
    la: int,
    x_in: torch.Tensor,
    g_out: torch.Tensor | None,
    loss: Loss,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`eap._layer_grads` with the layer's MLP half run and differentiated `MLP_CHUNKS` chunks
    of positions at a time (it is position-wise: `heads.scorers.layerwise.mlp_half`; in the last
    layer only the last position reaches the logits), then the attention half's backward."""
    H, G, d = graph.n_heads, graph.n_kv_heads, model.d_head
    R, T, D = x_in.shape
    last = la == graph.n_layers - 1
    dt, dev = x_in.dtype, x_in.device
    x = x_in.detach().requires_grad_(True)
    sites = {
        "q": torch.zeros(R, T, H, d, dtype=dt, device=dev, requires_grad=True),
        "k": torch.zeros(R, T, G, d, dtype=dt, device=dev, requires_grad=True),
        "v": torch.zeros(R, T, G, d, dtype=dt, device=dev, requires_grad=True),
    }
    mid = attention_half(model, ids, mask, la, x, [ActivationEdit(w, la, _add(z)) for w, z in sites.items()])
    g_mid = torch.zeros_like(mid)
    g_mlp = torch.zeros(R, T, D, dtype=dt, device=dev)
    g_logits = torch.zeros(R, T, D, dtype=dt, device=dev) if last else None
    chunk = T if last else -(-T // MLP_CHUNKS)
    for a in range(T - 1 if last else 0, T, chunk):
        piece = mid[:, a : a + chunk].detach().requires_grad_(True)
        d_mlp = torch.zeros_like(piece, requires_grad=True)
        leaves = [piece, d_mlp]
        edits: list[Edit] = [ActivationEdit("resid_mid", la, _add(d_mlp))]
        if last:
            d_logits = torch.zeros_like(piece, requires_grad=True)
            leaves.append(d_logits)
            edits.append(ActivationEdit("resid_post", la, _add(d_logits - d_mlp)))
        else:
            edits.append(ActivationEdit("resid_post", la, _add(-d_mlp)))
        out = mlp_half(model, ids, la, piece, a, edits)
        with torch.enable_grad():
            if last:
                got = torch.autograd.grad(loss(out.float()), leaves, allow_unused=True)
            else:
                rows = cast(torch.Tensor, g_out)[:, a : a + chunk]
                got = torch.autograd.grad(out, leaves, grad_outputs=rows, allow_unused=True)
        for dst, g in zip((g_mid, g_mlp, g_logits), got, strict=False):
            if g is not None and dst is not None:
                dst[:, a : a + chunk] = g
        del out, got, piece, leaves
    with torch.enable_grad():
        grads = torch.autograd.grad(mid, [x, *sites.values()], grad_outputs=g_mid, allow_unused=True)
    g_in, gq, gk, gv = (
        torch.zeros_like(v) if g is None else g.detach()
        for v, g in zip([x, *sites.values()], grads, strict=True)
    )
    del grads, mid, g_mid
    return g_in, [gq, gk, gv, g_mlp, *([g_logits] if g_logits is not None else [])]


def eap_chunk_lean(
    model: HeadModel,
    graph: Graph,
    clean_ids: torch.Tensor,
    corrupted_ids: torch.Tensor,
    mask: torch.Tensor,
    loss: Loss,
    *,
    steps: int | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """`eap_chunk`'s `[R, U, Dn]` fp32 scores (EAP, or EAP-IG with `steps` points) without
    holding the activation differences or the walk's recorded residuals (module docstring).

    Args:
        clean_ids, corrupted_ids, mask: `[R, T]` (left-padded, equal lengths).
        loss: the metric summed over the rows, from the logits `[R, V]` at the last position.
        steps: None for EAP, m for EAP-IG.
        block: downstream layers whose gradients are held per sweep recomputing the differences
            (default `BLOCK`); more: fewer sweeps, about 4.7 residual copies more per layer.
    """
    L = graph.n_layers
    block = BLOCK if block is None else max(1, block)
    parts = [layer_parts(model, la) for la in range(L)]
    w_o = [
        p.w_o.float() if p.gain is None else p.w_o.float() * p.gain.to(p.w_o.device)[None, None]
        for p in parts
    ]
    split = has_mid(model)  # attention, then the MLP on its output: the MLP half in chunks
    grads = _split_grads if split else _layer_grads
    R = clean_ids.shape[0]
    scores = torch.zeros(R, graph.n_upstream, graph.n_downstream)
    n_runs = 1 if steps is None else steps
    e_corr = embed_output(model, corrupted_ids) if steps is not None else None
    for k in range(n_runs, 0, -1):
        grad_edits: list[Edit] | None = None  # the gradients' run: the clean one
        if k < n_runs:
            grad_edits = [ActivationEdit("embed", 0, _interpolate(cast(torch.Tensor, e_corr), k / n_runs))]
        top_block = set(range(max(0, L - block), L))
        _, inputs = record_inputs(model, clean_ids, mask, sorted(top_block), grad_edits or [])
        step = torch.zeros_like(scores)
        g_out: torch.Tensor | None = None
        hi = L
        while hi > 0:
            lo = max(0, hi - block)
            held: list[tuple[int, torch.Tensor, list[torch.Tensor]]] = []
            for la in range(hi - 1, lo - 1, -1):
                x_in = inputs.pop(la)
                g_out, compact = grads(model, graph, clean_ids, mask, la, x_in, g_out, loss)
                held.append((la, x_in, compact))
                del x_in, compact
            keep = set(range(max(0, lo - block), lo))
            inputs = _score_block(
                step, model, graph, clean_ids, corrupted_ids, mask, parts, w_o, held, grad_edits, keep
            )
            held = []
            hi = lo
        scores += step
    scores /= n_runs
    scores[:, ~graph.valid] = 0.0
    return scores
