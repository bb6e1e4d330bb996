"""The decomposed forward of a circuit graph (`heads.scorers.circuits.layout`), on the engine's sites.

Every node input of the graph (`heads.scorers.circuits.graph`) is the sum of the upstream
nodes' outputs (plus constant biases), so patching edge u -> v means v_in' = v_in - a_u(run) +
a_u(x~): only u's contribution to v's input is replaced by its corrupted value. The run is the
model's own forward with edits at the engine's sites (`heads.engine.activations`), the same on
every backend (`hf`, `transformer_lens`, `nnsight`) and per thread:

* `residual` (`resid_pre`) of layer l reads x_l, the stream entering the block;
* `q` / `k` / `v` of layer l (the projections' outputs, before QK-norm and RoPE) replace the
  patched heads' blocks by the projection of `norm(x_l + delta_v)` (the block's attention norm,
  its own module's arithmetic; the head's rows of the projection weight);
* `head_output` (`z`) of layer l reads the heads' outputs, split per head with W_O;
* `attn_out_pre_norm` (post-norm families) reads the post-attention norm's input, whose scale
  `s` (per position) is frozen for the heads' shares: head h adds `gain * (z_h W_O[h]) / s`;
* `resid_mid` gets the MLP input's delta (the MLP reads `norm(x_mid + delta)`) and `resid_post`
  takes it back out of the stream, so only the MLP sees it; `resid_post` of the last layer gets
  the logits' delta (the final norm's input);
* `mlp_out` reads the MLP's output (post-norm families: its post-norm's, what joins the stream).

With nothing patched no site changes a value, so the logits are the model's. Layers below the
first patched input can be skipped (`run_graph(skip=)`): the engine's layer-prefix reuse
(`heads.engine.prefix.starting_at`, per thread) feeds the clean run's residual to the first
computed layer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, cast

import torch
from torch import nn

from heads.engine.activations import ActivationEdit
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Edit
from heads.engine.prefix import starting_at
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import position_ids
from heads.model.adapter import HeadModel
from heads.model.parts import norm_stats
from heads.planning.eap import CIRCUIT_NORM_CHUNK
from heads.scorers.circuits.layout import (
    ATTN_NORMS,
    Graph,
    check_family,
    first_patched_layer,
    graph_of,
)
from heads.scorers.circuits.nodes import Acts, LayerParts, embed_output, head_shares, layer_parts

__all__ = [
    "ATTN_NORMS",
    "Acts",
    "Graph",
    "LayerParts",
    "check_family",
    "embed_output",
    "first_patched_layer",
    "graph_of",
    "layer_parts",
    "run_graph",
]

_SKIP_LAYERS = True
"""Let `run_graph(skip=)` start the forward at the first patched layer from the clean run's
residual (tests switch it off to check the full forward gives the same numbers)."""

_COMPLEMENT = True
"""Let a patched input whose sources are mostly patched take the whole stream difference minus
the unpatched sources' (tests switch it off to check the direct sum gives the same numbers)."""

_NORM_CHUNK = CIRCUIT_NORM_CHUNK
"""Patched q / k / v inputs normalised and projected at a time (`_Runner._normed`; 4, the memory
plan's `heads.planning.eap.CIRCUIT_NORM_CHUNK`)."""

_FAST_LINEAR = True
"""Project per-head copies by the head's rows of the projection weight (tests switch it off to
check that calling the projection module on every copy gives the same numbers)."""


def _is_head(graph: Graph) -> torch.Tensor:
    """`[U]` bool: which upstream nodes are heads (not the input, not an MLP)."""
    idx = torch.arange(graph.n_upstream)
    return (idx >= 1) & ((idx - 1) % (graph.n_heads + 1) != graph.n_heads)


class _Runner:
    """The edits of one decomposed forward of R rows (see the module docstring).

    Args:
        patch: `[R, U, Dn]` bool edges to corrupt per row, or None.
        corr: the corrupted run's `Acts` (with `resid` and `mid` recorded), needed with `patch`.
        rows: `[R]` long, the row of `corr` (and of the skip's clean `Acts`) each row of this run
            reads, or None when they are the same rows (nothing is copied per row).
        grad: inject zero deltas that require grad at every downstream input (EAP).
        record: keep this run's `Acts` (detached).
        embed: `(e_corr [R, T, D], alpha)`: the embedding output becomes
            `e_corr + alpha (e - e_corr)` (EAP-IG over the inputs).
        skip: `(l0, clean)`: layers 0 .. l0-1 are not run; the diffs of their upstream nodes are
            taken from `clean` (the run equals the clean run below the first patched input).
        compact: keep the heads' differences as `[R, T, h, d]` head outputs (`z~_h - z_h`, over
            the post-norm scale where there is one) and project them by `W_O[h]` each time an
            input reads them, instead of keeping every head's `[R, T, D]` share: the upstream
            differences then take about 2 L + 1 residual streams a row instead of U = 1 + L (H + 1)
            (long prompts), at the cost of one `W_O` projection per reading layer.

    Each patched input's delta is the sum of the patched sources' differences, or, when most of
    its sources are patched (a circuit's complement), the whole difference of the stream
    `x~_v - x_v` (every source: the stream is the sum of the nodes' outputs) minus the unpatched
    sources' differences, so only the smaller set of upstream differences is ever kept.
    """

    def __init__(
        self,
        model: HeadModel,
        graph: Graph,
        *,
        patch: torch.Tensor | None = None,
        corr: Acts | None = None,
        rows: torch.Tensor | None = None,
        grad: bool = False,
        record: bool = False,
        embed: tuple[torch.Tensor, float] | None = None,
        skip: tuple[int, Acts] | None = None,
        compact: bool = False,
    ):
        self.m, self.g = model, graph
        self.skip = skip
        self.patch, self.corr, self.grad, self.record, self.embed = patch, corr, grad, record, embed
        self.index = rows
        L, H, G = graph.n_layers, graph.n_heads, graph.n_kv_heads
        self.H, self.G, self.d = H, G, model.d_head
        self.parts = [layer_parts(model, la) for la in range(L)]
        self.post = model.family.attn_out_norm is not None
        self.x: list[torch.Tensor | None] = [None] * L  # residual entering each layer
        # per layer {"q" | "k" | "v": (head blocks [R, T, a, d], heads [a])} of its patched inputs
        self.normed: list[dict[str, tuple[torch.Tensor, torch.Tensor]] | None] = [None] * L
        self.z: list[Any] = [None] * L
        self.zrun: list[Any] = [None] * L  # this run's z, until the post-norm scale is read
        self.mlp: list[Any] = [None] * L
        self.resid: list[torch.Tensor | None] = [None] * L
        self.mid: list[Any] = [None] * L
        self.scale: list[Any] = [None] * L
        self.mlp_delta: list[torch.Tensor | None] = [None] * L
        self.inp: torch.Tensor | None = None
        self.deltas: dict[str, torch.Tensor] = {}  # grad mode: the injected zero deltas
        # [R, u, T*D] a_u(x~) - a_u(run) of the upstream nodes some row needs (u of them, in
        # upstream order), filled as computed
        self.diff: torch.Tensor | None = None
        self.compact = compact
        # compact: per layer (heads [j] long, [R, T, j, d] fp32 z~ - z) of the heads some row needs
        self.hdiff: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.n_before = graph.n_before()
        if patch is not None:
            p = patch.bool().cpu()
            valid = graph.valid
            n_p = p.sum(1)  # [R, Dn] patched sources per input
            # the complement is smaller: delta = (x~ - x) - sum of the unpatched sources' diffs
            self.base = ((self.n_before[None] - n_p) < n_p) & _COMPLEMENT  # [R, Dn]
            self.coef = torch.where(self.base[:, None], (valid & ~p).to(torch.int8).neg(), p.to(torch.int8))
            self.union = (self.coef != 0).any(dim=0)  # [U, Dn]
            used = self.union.any(dim=1)  # [U]
            self.used = used
            if compact:  # the heads' differences are kept per layer (`hdiff`), not as columns
                used = used & ~_is_head(graph)
            self.n_used = int(used.sum())
            self.up_pos = torch.where(used, torch.cumsum(used.long(), 0) - 1, -1)  # [U] -> diff column

    # -------------------------------------------------------------- rows of the recorded runs
    def _c(self, t: torch.Tensor) -> torch.Tensor:
        """`t`'s rows for this run's rows (`rows`), on its device."""
        return t if self.index is None else t[self.index.to(t.device)]

    # -------------------------------------------------------------- deltas
    def _delta(
        self, lo: int, hi: int, x: torch.Tensor, x_corr: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(delta [a, R, T, D], active [a] long)`: the deltas of the downstream inputs lo + active
        (those with an edge patched in some row, all of lo..hi-1 in grad mode); None when nothing
        is patched. `x` is this run's stream at the inputs, `x_corr()` the corrupted run's."""
        if self.grad:
            key = f"{lo}:{hi}"
            t = torch.zeros(hi - lo, *x.shape, dtype=x.dtype, device=x.device, requires_grad=True)
            self.deltas[key] = t
            return t, torch.arange(hi - lo)
        if self.patch is None:
            return None
        n = int(self.n_before[lo])
        pu = self.union[:n, lo:hi]
        pb = self.base[:, lo:hi]  # [R, hi - lo]
        active = torch.nonzero(pu.any(dim=0) | pb.any(dim=0))[:, 0]
        if not len(active):
            return None
        R = x.shape[0]
        if self.compact:
            return self._delta_compact(lo, hi, x, x_corr, n, active), active
        out = torch.zeros(len(active), R, x[0].numel(), dtype=torch.float32, device=x.device)
        used = torch.nonzero(pu.any(dim=1))[:, 0]
        if len(used):
            full = cast(torch.Tensor, self.diff)
            cols = self.up_pos[used]
            if int(cols[-1]) - int(cols[0]) == len(cols) - 1:  # consecutive columns: a view
                diff = full[:, int(cols[0]) : int(cols[-1]) + 1]
            else:
                diff = full[:, cols.to(full.device)]
            c = self.coef[:, used][:, :, lo:hi][:, :, active].to(full.device, full.dtype)  # [R, u, a]
            out += torch.bmm(c.transpose(1, 2), diff).transpose(0, 1)  # [a, R, T*D]
        b = pb[:, active]  # [R, a]
        if bool(b.any()):
            whole = self._stream_diff(x, x_corr)
            out += b.T.to(x.device, torch.float32)[:, :, None] * whole[None]
        return out.reshape(len(active), *x.shape).to(x.dtype), active

    def _delta_compact(
        self,
        lo: int,
        hi: int,
        x: torch.Tensor,
        x_corr: Callable[[], torch.Tensor],
        n: int,
        active: torch.Tensor,
    ) -> torch.Tensor:
        """`_delta`'s `[a, R, T, D]` with the heads' differences kept compactly (`compact`): one
        `[R, a, T*D]` buffer, each source layer's heads projected by `W_O` when read and added in
        place, so no `[U, T, D]` and no `[a, T, D]` temporary is made."""
        R = x.shape[0]
        out = torch.zeros(R, len(active), x[0].numel(), dtype=torch.float32, device=x.device)
        pick = self.union[:n, lo:hi].any(dim=1)  # [n] sources some row needs at these inputs
        coef = self.coef[:, :n, lo:hi][:, :, active]  # [R, n, a]
        cols = torch.nonzero(pick & (self.up_pos[:n] >= 0))[:, 0]  # the input and MLP nodes
        if len(cols):
            full = cast(torch.Tensor, self.diff)
            c = coef[:, cols].to(full.device, full.dtype)  # [R, u, a]
            out.baddbmm_(c.transpose(1, 2), full[:, self.up_pos[cols].to(full.device)])
        for la, (heads, dz) in self.hdiff.items():
            u0 = self.g.head_node(la, 0)
            if u0 >= n:
                break
            rows = pick[u0 + heads]
            if not bool(rows.any()):
                continue
            hs = heads[rows]
            lp = self.parts[la]
            w_o = lp.w_o[hs.to(lp.w_o.device)].to(dz.device, torch.float32)  # [j, d, D]
            share = torch.einsum("rtjd,jdD->rjtD", dz[:, :, rows.to(dz.device)], w_o)
            if lp.gain is not None:
                share = share * lp.gain.to(share.device)
            c = coef[:, u0 + hs].to(share.device, torch.float32)  # [R, j, a]
            out.baddbmm_(c.transpose(1, 2), share.flatten(2))
            del share
        b = self.base[:, lo:hi][:, active]  # [R, a]
        if bool(b.any()):
            whole = self._stream_diff(x, x_corr)
            out.addcmul_(b.to(x.device, torch.float32)[:, :, None], whole[:, None])
        return out.transpose(0, 1).reshape(len(active), *x.shape).to(x.dtype)

    def _stream_diff(self, x: torch.Tensor, x_corr: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`[R, T*D]` fp32 `x~ - x`: the corrupted run's stream minus this run's (every source's
        difference at once, the complement's base)."""
        return (self._c(x_corr()).to(x.device).float() - x.float()).flatten(1)

    def _used(self, u0: int, k: int) -> torch.Tensor | None:
        """`[j]` long: which of the upstream nodes u0 .. u0+k-1 some row needs (None: none)."""
        if self.patch is None:
            return None
        sel = torch.nonzero(self.used[u0 : u0 + k])[:, 0]
        return sel if len(sel) else None

    def _set_diff(self, u0: int, value: torch.Tensor, sel: torch.Tensor) -> None:
        """Store `value [j, R, T, D]`, the diffs of upstream nodes `u0 + sel`."""
        if self.diff is None:
            R = value.shape[1]
            self.diff = torch.zeros(
                R, self.n_used, value[0, 0].numel(), dtype=torch.float32, device=value.device
            )
        # the used nodes of one sub-layer get consecutive columns (up_pos counts used nodes in order)
        c0 = int(self.up_pos[u0 + int(sel[0])])
        self.diff[:, c0 : c0 + len(sel)] = value.float().transpose(0, 1).flatten(2)

    def _input_diff(self, x: torch.Tensor) -> None:
        if self._used(0, 1) is not None:
            corr = cast(Acts, self.corr)
            self._set_diff(0, (self._c(corr.input).to(x.device) - x)[None], torch.zeros(1, dtype=torch.long))

    def _head_diff(self, la: int, z: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Store the diffs of layer la's heads some row needs (`z [R, T, H, d]`: this run's head
        outputs, `scale`: this run's post-attention norm scale or None)."""
        u0 = self.g.head_node(la, 0)
        sel = self._used(u0, self.H)
        if sel is not None and self.compact:  # z~_h / s~ - z_h / s, projected when read
            corr = cast(Acts, self.corr)
            sd = sel.to(z.device)
            mine = z[..., sd, :].float()
            theirs = self._c(corr.z[la])[..., sel.to(corr.z[la].device), :].to(z.device).float()
            if scale is not None:
                mine = mine / scale.to(z.device).float()[..., None]
                theirs = theirs / self._c(corr.scale[la]).to(z.device).float()[..., None]
            self.hdiff[la] = (sel, theirs - mine)
        elif sel is not None:
            corr = cast(Acts, self.corr)
            lp = self.parts[la]
            mine = head_shares(z, lp.w_o, sel, scale, lp.gain)
            zc = self._c(corr.z[la])
            theirs = head_shares(zc, lp.w_o, sel, self._c(corr.scale[la]) if corr.scale else None, lp.gain)
            self._set_diff(u0, theirs.to(mine.device) - mine, sel)

    def _mlp_diff(self, la: int, o: torch.Tensor) -> None:
        if self._used(self.g.mlp_node(la), 1) is not None:
            mc = self._c(cast(Acts, self.corr).mlp[la]).to(o.device)
            self._set_diff(self.g.mlp_node(la), (mc - o)[None], torch.zeros(1, dtype=torch.long))

    # -------------------------------------------------------------- the edits
    def edits(self) -> list[Edit]:
        """Every site edit of this run (layers below the skip start get none)."""
        g = self.g
        n_skip = 0 if self.skip is None else self.skip[0]
        out: list[Edit] = []
        if self.embed is not None:
            e_corr, alpha = self.embed

            def interpolate(x: torch.Tensor, call: AttentionCall) -> torch.Tensor:
                ec = e_corr.to(x.device, x.dtype)
                return ec + alpha * (x - ec)

            out.append(ActivationEdit("embed", 0, interpolate))
        for la in range(n_skip, g.n_layers):
            out.append(ActivationEdit("residual", la, self._resid_pre(la)))
            for which in ("q", "k", "v"):
                out.append(ActivationEdit(which, la, self._qkv(la, which)))
            out.append(ActivationEdit("head_output", la, self._z(la)))
            if self.post:
                out.append(ActivationEdit("attn_out_pre_norm", la, self._attn_pre(la)))
            mlp_in = g.mlp_input(la)
            if (
                self.grad
                or self.record
                or (self.patch is not None and bool(self.union[:, mlp_in].any() | self.base[:, mlp_in].any()))
            ):
                out.append(ActivationEdit("resid_mid", la, self._resid_mid(la)))
            out.append(ActivationEdit("mlp_out", la, self._mlp(la)))
            out.append(ActivationEdit("resid_post", la, self._resid_post(la)))
        return out

    def _resid_pre(self, la: int) -> Callable[[torch.Tensor, AttentionCall], None]:
        def fn(x: torch.Tensor, call: AttentionCall) -> None:
            self.x[la] = x
            self.normed[la] = None
            self.mlp_delta[la] = None
            if la == 0:
                self.inp = x.detach() if self.record else None
                self._input_diff(x)

        return fn

    def _normed(self, la: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """`{"q" | "k" | "v": (blocks [R, T, a, d], heads [a])}`: each active input's head block of
        its projection of `norm(x_l + delta)` (None: nothing patched at layer la). The normalised
        copies are made `_NORM_CHUNK` inputs at a time and dropped once projected, so only the
        deltas and a few `[R, T, D]` copies are alive at once."""
        if self.normed[la] is None:
            x = cast(torch.Tensor, self.x[la])
            lo = self.g.q_input(la, 0)
            corr = self.corr
            got = self._delta(lo, lo + self.H + 2 * self.G, x, lambda: cast(Acts, corr).stream_in(la))
            if got is None:
                return None
            delta, active = got
            H, G = self.H, self.G
            out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for which, (a, b) in (("q", (0, H)), ("k", (H, H + G)), ("v", (H + G, H + 2 * G))):
                idx = torch.nonzero((active >= a) & (active < b))[:, 0]
                if not len(idx):
                    continue
                heads = active[idx] - a
                blocks = []
                for c0 in range(0, len(idx), _NORM_CHUNK):
                    i = idx[c0 : c0 + _NORM_CHUNK]
                    part = delta[int(i[0]) : int(i[-1]) + 1]  # consecutive: a view
                    normed = self.parts[la].norm1.forward(x[None] + part)
                    blocks.append(self._project(la, which, normed, heads[c0 : c0 + _NORM_CHUNK]))
                    del normed
                out[which] = (torch.cat(blocks, dim=2), heads)
            del delta
            self.normed[la] = out
        return self.normed[la]

    def _project(self, la: int, which: str, part: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """`[R, T, a, d]`: head `heads[i]`'s block of `which`'s projection of `part[i]`
        (`part [a, R, T, D]`): the head's rows of the weight (`graph._FAST_LINEAR`), else the
        projection module's own `forward` on every copy, sliced."""
        lp, d = self.parts[la], self.d
        if _FAST_LINEAR:
            w = lp.w[which]
            hd = heads.to(w.device)
            out = torch.einsum("krtD,kDd->rtkd", part.to(w.dtype), w[hd])
            bias = lp.b[which]
            if bias is not None:
                out = out + bias[hd]
            return out
        mod, lo, hi = lp.proj[which]
        full: torch.Tensor = mod.forward(part)[..., lo:hi]  # [a, R, T, n d]
        a = part.shape[0]
        full = full.reshape(a, *full.shape[1:-1], -1, d)
        idx = torch.arange(a, device=full.device)
        return full[idx, ..., heads.to(full.device), :].permute(1, 2, 0, 3)

    def _qkv(self, la: int, which: str) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor | None]:
        H, G = self.H, self.G
        lo, hi = {"q": (0, H), "k": (H, H + G), "v": (H + G, H + 2 * G)}[which]

        def fn(o: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
            got = self._normed(la)
            if got is None or which not in got:
                return None
            blocks, heads = got[which]  # [R, T, a, d], [a]
            if len(heads) == hi - lo and bool((heads == torch.arange(hi - lo)).all()):
                return blocks.to(o.dtype)
            new = o.clone()
            new[..., heads.to(o.device), :] = blocks.to(o.dtype)
            return new

        return fn

    def _z(self, la: int) -> Callable[[torch.Tensor, AttentionCall], None]:
        def fn(z: torch.Tensor, call: AttentionCall) -> None:
            self.normed[la] = None  # the layer's q / k / v are computed: its copies are done
            self.x[la] = None
            if self.record:
                self.z[la] = z.detach()
            if self.post:  # the diffs need the post-norm's scale: at attn_out_pre_norm
                self.zrun[la] = z
            else:
                self._head_diff(la, z, None)

        return fn

    def _attn_pre(self, la: int) -> Callable[[torch.Tensor, AttentionCall], None]:
        post = self.parts[la].post

        def fn(x: torch.Tensor, call: AttentionCall) -> None:
            scale, _ = norm_stats(cast(nn.Module, post), x)
            self.scale[la] = scale.detach() if self.record else scale
            self._head_diff(la, cast(torch.Tensor, self.zrun[la]), scale)

        return fn

    def _resid_mid(self, la: int) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor | None]:
        down = self.g.mlp_input(la)

        def fn(x: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
            if self.record:
                self.mid[la] = x.detach()
            got = self._delta(down, down + 1, x, lambda: cast(Acts, self.corr).mid[la])
            if got is None:
                return None
            delta = got[0][0]
            self.mlp_delta[la] = delta
            return x + delta

        return fn

    def _mlp(self, la: int) -> Callable[[torch.Tensor, AttentionCall], None]:
        def fn(o: torch.Tensor, call: AttentionCall) -> None:
            if self.record:
                self.mlp[la] = o.detach()
            self._mlp_diff(la, o)

        return fn

    def _resid_post(self, la: int) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor | None]:
        last = la == self.g.n_layers - 1

        def fn(x: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
            new = x
            delta = self.mlp_delta[la]
            if delta is not None:  # the MLP's delta leaves the stream with the block
                new = new - delta
            if last:
                lo = self.g.logits_input
                got = self._delta(
                    lo, lo + 1, new, lambda: cast(torch.Tensor, cast(Acts, self.corr).resid[la])
                )
                if got is not None:
                    new = new + got[0][0]
            if self.record:
                self.resid[la] = new.detach()
            return None if new is x else new

        return fn

    # -------------------------------------------------------------- results
    def skipped_diffs(self) -> None:
        """The diffs of the skipped layers' upstream nodes, from the clean run (`skip`)."""
        if self.skip is None:
            return
        l0, clean = self.skip
        if self._used(0, 1) is not None:
            self._input_diff(self._c(clean.input).to(self.m.device))
        for la in range(l0):
            scale = self._c(clean.scale[la]) if clean.scale else None
            self._head_diff(la, self._c(clean.z[la]), scale)
            self._mlp_diff(la, self._c(clean.mlp[la]))

    def acts(self) -> Acts:
        post = self.post
        return Acts(
            cast(torch.Tensor, self.inp),
            list(self.z),
            list(self.mlp),
            list(self.resid),
            list(self.scale) if post else [],
            [cast(torch.Tensor, p.gain) for p in self.parts] if post else [],
            list(self.mid) if self.record else [],
        )


def run_graph(
    model: HeadModel,
    graph: Graph,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    patch: torch.Tensor | None = None,
    corr: Acts | None = None,
    rows: torch.Tensor | None = None,
    grad: bool = False,
    record: bool = False,
    embed: tuple[torch.Tensor, float] | None = None,
    skip: tuple[int, Acts] | None = None,
    compact: bool = False,
) -> tuple[torch.Tensor, _Runner]:
    """One decomposed forward of `ids [R, T]` (`mask [R, T]`, left-padded).

    Args:
        patch: `[R, U, Dn]` bool: the edges corrupted in each row (v_in' = v_in + a_u(x~) - a_u(run)).
        corr: the corrupted run's `Acts` (required with `patch`; recorded by `run_graph(record=
            True)`), for the R rows or, with `rows`, for the rows `rows` names.
        rows: `[R]` long: the row of `corr` and of the skip's `clean` each row of this run reads
            (None: the same rows); nothing is copied per row.
        grad: inject zero deltas requiring grad at every downstream input; `runner.deltas`
            then holds them (keys `"lo:hi"` in downstream order).
        record: keep the run's `Acts` (`runner.acts()`).
        embed: EAP-IG: `(e_corr [R, T, D], alpha)` interpolates the embedding output.
        skip: `(l0, clean)` with `clean` the clean run's recorded `Acts` (rows as `corr`): when no
            row patches an input below layer l0, layers 0 .. l0-1 are not computed (the engine's
            layer-prefix reuse feeds `clean.resid[l0 - 1]` to layer l0); the logits are those of
            the full forward (up to float rounding). Ignored unless `patch` is given, nothing is
            recorded or differentiated and every layer output was recorded; raises ValueError
            when a row patches an input below l0.
        compact: keep the heads' upstream differences as head outputs and project them when read
            (`_Runner`): about 2 L + 1 residual streams a row instead of 1 + L (H + 1); the same
            logits up to float rounding.

    Returns:
        `(logits [R, V] fp32 at the last position, runner)`.
    """
    if patch is not None and corr is None:
        raise HeadsteerValueError("patching edges needs the corrupted run's activations (corr=)")
    if skip is not None:
        l0, clean = skip
        if (
            not _SKIP_LAYERS
            or patch is None
            or grad
            or record
            or l0 <= 0
            or not clean.can_skip(graph.n_layers)
        ):
            skip = None
        elif first_patched_layer(graph, patch) < l0:
            raise HeadsteerValueError(f"skip={l0} layers, but a row patches an input below layer {l0}")
        else:  # only the logits patched: the last layer still runs (the engine starts at a layer)
            skip = (min(l0, graph.n_layers - 1), clean)
    runner = _Runner(
        model,
        graph,
        patch=patch,
        corr=corr,
        rows=rows,
        grad=grad,
        record=record,
        embed=embed,
        skip=skip,
        compact=compact,
    )
    runner.skipped_diffs()
    dev = model.device
    with ExitStack() as stack:
        if skip is not None:
            resid = runner._c(cast(torch.Tensor, skip[1].resid[skip[0] - 1]))
            stack.enter_context(starting_at(model, skip[0], resid.to(dev)))
        stack.enter_context(editing(model, runner.edits(), require_fired=False))
        out = model.run(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=position_ids(mask).to(dev),
            use_cache=False,
            logits_to_keep=1,
        )
    return out.logits[:, -1].float(), runner
