"""The AtP / AtP* estimate of one batch of prompts, in memory linear in the prompt.

`heads.scorers.safety.attribution.attribute` (the public API and the method) runs this per
batch. For every head (l, h) and prompt the estimate is `sum_t dm/dz . (z_ablated - z)`; the
gradients come one layer at a time (`heads.scorers.layerwise`): a no-grad forward records the
residual entering a few layers (`checkpoint_layers`), then each layer runs alone from its
recomputed input with a zero added to its heads' outputs (`head_output` site, whose gradient is
dm/dz), and the gradient at its input goes down to the layer below. Where the block has a
`resid_mid` the layer runs as its attention half (every position) and its MLP half in
`MLP_CHUNKS` position chunks (the top layer's at the last position only: the logits read
nothing else), each flow's gradient turned into its gradient at `resid_mid` chunk by chunk, in
place. The change `z_ablated - z` of layer l is made
while layer l is processed (from its clean z; the delta pass of an attention edit starts at l
from the same input), so no `[L, T, H, d]` store is needed either.

Each metric scalar (the `kl_tokens` log-probs for KL, or the metric) is a *flow*: its own
gradient through the layers, all taken from one forward of each layer. GradDrop (AtP* §3.1.2)
adds a flow per scalar and dropped layer l': above l' it is the plain flow, at l' the gradient
passes the layer by the residual stream only (its attention and MLP outputs get none, so its
heads get 0), below it goes on as usual. Drops are taken a few at a time (each group one walk
down the layers): the plain flows go down to the group's lowest dropped layer only (below it
only the drops' flows are read) and there become that layer's drop flows, so a walk with k
dropped layers carries at most `k n` flows (n scalars) at once, and `k` is the largest with
`k n <= MAX_FLOWS` (at least 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from heads._util.validation import short_repr
from heads.engine.activations import ActivationEdit
from heads.engine.edits import AttentionCall, Edit, ProbEdit, QueryScale
from heads.engine.variants import run_rows
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.scorers.layerwise import (
    attention_half,
    checkpoint_layers,
    has_mid,
    inputs_down,
    mlp_half,
    record_inputs,
    run_layer,
)

__all__ = ["BatchSetup", "attribute_batch", "coarse_kl", "layer_edit"]

REST_FLOOR = 1e-4  # smallest predicted "rest" mass, relative to the clean one
MAX_FLOWS = 4
"""GradDrop: the most flows (dropped layer x metric scalar) a walk carries at once, where a drop
group of k layers needs `k n` (n metric scalars; at least one layer per walk): KL over 4 tokens
one dropped layer per walk, a one-scalar metric 4. Each flow keeps a residual-stream copy (its
gradient) beside the walk's ~20 (docs/long-context.md): 4 flows is plain AtP's walk with KL
(2.24x a forward's peak on SmolLM2 at 1k tokens)."""
MLP_CHUNKS = 8
"""Position chunks of a layer's MLP half (its forward and backward, one chunk at a time)."""
MLP_MIN_ROWS = 64
"""Fewest positions in an MLP chunk (shorter prompts: fewer chunks)."""

Flow = tuple[int | None, int]
"""`(dropped layer or None, metric scalar index)`."""


class LinearisedScale(ProbEdit):
    """Pattern `A + (f - 1) A (log A - sum_k A log A)`: `softmax(f s)` linearised at f = 1."""

    def __init__(self, layer: int, factor: float):
        super().__init__(layer=layer)
        self.factor = float(factor)

    def apply(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        logp = torch.where(probs > 0, probs.clamp(min=1e-45).log(), 0.0)
        centred = logp - (probs * logp).sum(-1, keepdim=True)
        return probs + (self.factor - 1.0) * probs * centred


def layer_edit(ablation: Any, layer: int, eps: float, saturation_fix: bool) -> Edit:
    """The edit of `layer` whose pattern change the delta pass computes (UA or a custom edit)."""
    if callable(ablation):
        edit = ablation(layer)
        if not isinstance(edit, Edit) or edit.layer != layer:
            raise HeadsteerValueError(
                f"ablation({layer}) must return an Edit for layer {layer}, got {short_repr(edit)}"
            )
        return edit
    if saturation_fix:
        return QueryScale(layer=layer, factor=eps)
    return LinearisedScale(layer, eps)


class _Stop(Exception):
    """Raised from a `head_output` read to end a delta pass once the layer's z is read."""


def edited_z(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    layer: int,
    edit: Edit,
    residual: torch.Tensor,
) -> torch.Tensor:
    """`z_edited` of `layer` (`[B, T, H, d]`) from a forward of that layer alone (no gradients):
    the engine starts at `layer` from the clean `residual`, applies `edit`, and a `head_output`
    read listed after it stops the forward once z is known."""
    got: list[torch.Tensor] = []

    def read(z: torch.Tensor, call: AttentionCall) -> None:
        got.append(z.detach())
        raise _Stop

    with torch.no_grad():
        try:
            run_rows(
                model,
                ids,
                mask,
                [edit, ActivationEdit("head_output", layer, read)],
                start=layer,
                residual=residual if layer else None,
            )
        except _Stop:
            pass
    if not got:
        raise RuntimeError(f"the delta pass never reached the head outputs of layer {layer}")
    return got[0]


def coarse_kl(p_top: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """KL(coarse p || coarse p') for predicted log-prob changes `delta` `[B, m, *]` of the top-m
    tokens with clean probs `p_top` `[B, m]`; the rest class takes the remaining mass."""
    shape = (*p_top.shape, *([1] * (delta.dim() - 2)))
    p = p_top.double().reshape(shape)
    d = delta.double().clamp(max=50.0)
    rest = (1.0 - p.sum(1, keepdim=True)).clamp(min=1e-12)
    new = p * d.exp()
    new_rest = (1.0 - new.sum(1, keepdim=True)).clamp(min=0.0)
    new_rest = torch.maximum(new_rest, rest * REST_FLOOR)
    total = new.sum(1, keepdim=True) + new_rest
    new, new_rest = new / total, new_rest / total
    kl = (p * (p.log() - new.log())).sum(1) + (rest * (rest.log() - new_rest.log()))[:, 0]
    return kl.clamp(min=0.0).float()


@dataclass(frozen=True)
class BatchSetup:
    """What `attribute_batch` needs of `attribute`'s checked arguments (the same for every batch);
    `means`: the per-layer head means of `ablation="mean"`, else None."""

    ablation: Any
    eps: float
    metric: Any
    kl_tokens: int
    saturation_fix: bool
    graddrop: bool
    means: list[torch.Tensor] | None


class _Walk:
    """One walk down the layers carrying the plain flows and the flows of some dropped layers."""

    def __init__(
        self,
        model: HeadModel,
        ids: torch.Tensor,
        mask: torch.Tensor,
        rows: torch.Tensor,
        setup: BatchSetup,
        real: torch.Tensor,
        scalars: Callable[[torch.Tensor], list[torch.Tensor]],
        drops: list[int],
    ):
        self.m, self.ids, self.mask, self.rows, self.setup = model, ids, mask, rows, setup
        self.real = real  # [R, T, 1, 1] bool
        self.all_real = bool(real.all())  # no padding: nothing to mask
        self.scalars = scalars
        self.drops = drops
        self.bottom = min(drops) if drops else None  # the plain flows end here (become its drops')
        R, L, H = len(rows), model.n_layers, model.n_heads
        self.n_scalars = 0
        self.effects: dict[Flow, torch.Tensor] = {}
        self.shape = (R, L, H)
        self.split = has_mid(model)  # attention, then the MLP on its output: the MLP in chunks

    def _edited(self, la: int, x_in: torch.Tensor) -> torch.Tensor | None:
        """The heads' outputs of layer `la` under the pattern edit (delta pass, no gradients), run
        before the layer's graph is built; None for the ablations whose change needs only z."""
        s = self.setup
        if s.ablation in ("sc", "zero", "mean"):
            return None
        edit = layer_edit(s.ablation, la, s.eps, s.saturation_fix)
        return edited_z(self.m, self.ids, self.mask, la, edit, x_in)

    def _dz(self, la: int, z: torch.Tensor, edited: torch.Tensor | None) -> tuple[torch.Tensor, float]:
        """`(d, c)` with `z_ablated - z = c d` on the real positions (0 on padding): for `"sc"` /
        `"zero"` d is z itself (the layer's graph keeps it anyway: no copy) and c = eps - 1."""
        s = self.setup
        scale = 1.0
        if s.ablation in ("sc", "zero"):
            dz, scale = z, s.eps - 1.0
        elif s.ablation == "mean":
            dz = cast(list[torch.Tensor], s.means)[la].to(z) - z
        else:
            dz = cast(torch.Tensor, edited) - z
        if not self.all_real:
            dz = torch.where(self.real.to(dz.device), dz, 0.0)
        return dz, scale

    def _effect(self, key: Flow, la: int, gz: torch.Tensor | None, dz: tuple[torch.Tensor, float]) -> None:
        eff = self.effects.setdefault(key, torch.zeros(self.shape))
        if gz is not None:
            eff[:, la] = ((gz * dz[0]).sum((1, 3)) * dz[1]).float().cpu()

    def run(self, sparse: dict[int, torch.Tensor]) -> dict[Flow, torch.Tensor]:
        g_next: dict[Flow, torch.Tensor] = {}
        for la, x_in in inputs_down(self.m, self.ids, self.mask, sparse):
            if la == self.bottom and g_next and all(k[0] is None for k in g_next):
                g_next = self._passed(la, g_next)  # no flow goes through the layer: not run
                continue
            x = x_in.detach().requires_grad_(True)
            layer = self._split_layer if self.split else self._whole_layer
            # z_ablated is not named here: the layer drops it once z_ablated - z is made
            g_next = layer(la, x, self._edited(la, x_in), g_next)
        for d in self.drops:  # above the dropped layer a drop's flow is the plain one
            for j in range(self.n_scalars if d + 1 < self.m.n_layers else 0):
                self.effects[(d, j)][:, d + 1 :] = self.effects[(None, j)][:, d + 1 :]
        return self.effects

    def _passed(self, la: int, g_next: dict[Flow, torch.Tensor]) -> dict[Flow, torch.Tensor]:
        """At the lowest dropped layer `la` when only the plain flows reach it: they become its
        drops' flows (the gradient leaving `la` passed by the residual stream, its heads 0)."""
        new: dict[Flow, torch.Tensor] = {}
        for (_, j), g in g_next.items():
            self._effect((la, j), la, None, (g, 0.0))
            new[(la, j)] = g
        return new

    def _split_layer(
        self, la: int, x: torch.Tensor, edited: torch.Tensor | None, g_next: dict[Flow, torch.Tensor]
    ) -> dict[Flow, torch.Tensor]:
        """Layer `la` as its attention half (one graph over every position) and its MLP half in
        position chunks (`MLP_CHUNKS`; the top layer's at the last position only, the one the
        logits read): each flow's gradient leaving the layer becomes, chunk by chunk and in place,
        its gradient at `resid_mid`, then goes through the attention half to `x` and the heads."""
        m, ids, mask = self.m, self.ids, self.mask
        box: list[torch.Tensor] = []
        zeta: list[torch.Tensor] = []
        mid = attention_half(m, ids, mask, la, x, [ActivationEdit("head_output", la, _tap(box, zeta))])
        dz = self._dz(la, box.pop(), edited)
        del edited
        T = mid.shape[1]
        leaving: dict[Flow, torch.Tensor] = {}  # the plain flows' gradient leaving `la`, for its drops
        if la == m.n_layers - 1:
            piece = mid[:, T - 1 :].detach().requires_grad_(True)
            post = torch.zeros_like(piece, requires_grad=True)
            out = mlp_half(m, ids, la, piece, T - 1, [ActivationEdit("resid_post", la, _plus(post))])
            with torch.enable_grad():
                values = self.scalars(out)
            self.n_scalars = len(values)
            for j, value in enumerate(values):
                gp, gpost = torch.autograd.grad(
                    value, [piece, post], retain_graph=j < len(values) - 1, allow_unused=True
                )
                if la != self.bottom:
                    g_next[(None, j)] = _last(_z(gp, piece), mid)
                if la in self.drops:
                    leaving[(None, j)] = _last(_z(gpost, post), mid)
            del values, out
        else:
            if la == self.bottom:  # the plain flows end here: they are this layer's drops' now
                leaving = {(None, j): g_next.pop((None, j)) for j in range(self.n_scalars)}
            elif la in self.drops:
                leaving = {(None, j): g_next[(None, j)].clone() for j in range(self.n_scalars)}
            chunk = max(MLP_MIN_ROWS, -(-T // MLP_CHUNKS))
            for a in range(0, T, chunk):
                piece = mid[:, a : a + chunk].detach().requires_grad_(True)
                out = mlp_half(m, ids, la, piece, a)
                keys = [k for k in g_next if k[0] != la]
                for i, key in enumerate(keys):
                    rows = g_next[key][:, a : a + chunk]
                    (gp,) = torch.autograd.grad(out, [piece], rows, retain_graph=i < len(keys) - 1)
                    g_next[key][:, a : a + chunk] = gp  # now the flow's gradient at resid_mid
                del out, piece
        new: dict[Flow, torch.Tensor] = {}
        keys = [k for k in g_next if k[0] != la]
        for i, key in enumerate(keys):
            g_mid = g_next.pop(key)
            gx, gz = torch.autograd.grad(
                mid, [x, zeta[0]], grad_outputs=g_mid, retain_graph=i < len(keys) - 1, allow_unused=True
            )
            del g_mid
            self._effect(key, la, gz, dz)
            new[key] = _z(gx, x)
            del gx, gz
        for (_, j), g in leaving.items():  # new flows: passed by the residual stream only, heads get 0
            self._effect((la, j), la, None, dz)
            new[(la, j)] = g
        return new

    def _whole_layer(
        self, la: int, x: torch.Tensor, edited: torch.Tensor | None, g_next: dict[Flow, torch.Tensor]
    ) -> dict[Flow, torch.Tensor]:
        """Layer `la` as one graph (blocks without a `resid_mid`: attention and MLP in parallel)."""
        m = self.m
        L = m.n_layers
        box: list[torch.Tensor] = []
        zeta: list[torch.Tensor] = []
        edits: list[Edit] = [ActivationEdit("head_output", la, _tap(box, zeta))]
        top = la == L - 1
        if top:
            post = torch.zeros_like(x, requires_grad=True)
            edits.append(ActivationEdit("resid_post", la, _plus(post)))
        out = run_layer(m, self.ids, self.mask, la, x, edits)
        dz = self._dz(la, box.pop(), edited)
        del edited
        leaves = [x, zeta[0]]
        grads: dict[Flow, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.enable_grad():
            if top:
                values = self.scalars(out)
                self.n_scalars = len(values)
                for j, s in enumerate(values):
                    gx, gz, gpost = torch.autograd.grad(
                        s, [*leaves, post], retain_graph=True, allow_unused=True
                    )
                    grads[(None, j)] = (_z(gx, x), _z(gz, zeta[0]))
                    g_next[(None, j)] = _z(gpost, post)  # the gradient leaving the top layer
                del values, s  # they hold the top layer's graph: freed with `out`, not kept all walk
            keys = [k for k in g_next if not ((top or la == self.bottom) and k[0] is None)]
            for i, key in enumerate(keys):
                drop = key[0]
                if drop is not None and drop == la:
                    continue  # handled below: the stream passes the dropped layer untouched
                last = i == len(keys) - 1
                gx, gz = torch.autograd.grad(
                    out, leaves, grad_outputs=g_next[key], retain_graph=not last, allow_unused=True
                )
                grads[key] = (_z(gx, x), _z(gz, zeta[0]))
        del out
        for d in self.drops:  # new flows: the plain flow's gradient leaving layer d, passed by
            if d == la:  # the residual stream only; d's heads get 0
                for j in range(self.n_scalars):
                    grads[(d, j)] = (g_next[(None, j)], torch.zeros_like(zeta[0]))
        new: dict[Flow, torch.Tensor] = {}
        for key, (gx, gz) in grads.items():
            if la == self.bottom and key[0] is None:
                continue  # the plain flows end at the lowest dropped layer
            self._effect(key, la, gz, dz)
            new[key] = gx
        return new


def _last(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`g` (`[R, 1, D]`, at the last position) as `[R, T, D]` with zeros elsewhere."""
    full = torch.zeros_like(like)
    full[:, -1:] = g
    return full


def _tap(
    box: list[torch.Tensor], zeta: list[torch.Tensor]
) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor]:
    """A `head_output` edit keeping z (`box`) and passing on a view of it (`zeta`) whose gradient
    is dm/dz: a graph node of its own that copies nothing (a zero leaf added to z would cost two
    copies of z while the layer's graph is alive)."""

    def fn(z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        box.append(z.detach())
        node = z.view_as(z)
        zeta.append(node)
        return node

    return fn


def _plus(leaf: torch.Tensor) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor]:
    def fn(y: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return y + leaf

    return fn


def _z(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g.detach()


def walks_per_batch(n_layers: int, setup: BatchSetup) -> int:
    """The walks down the layers `attribute_batch` makes per batch: 1, or with GradDrop one per
    group of `MAX_FLOWS // scalars` dropped layers (scalars: `kl_tokens` for KL, else 1)."""
    if not setup.graddrop:
        return 1
    per_group = max(1, MAX_FLOWS // (setup.kl_tokens if setup.metric == "kl" else 1))
    return -(-n_layers // per_group)


def attribute_batch(
    model: HeadModel,
    enc: EncodedPrompts,
    rows: torch.Tensor,
    setup: BatchSetup,
    walked: Callable[[], None] | None = None,
) -> torch.Tensor:
    """`[R, L, H]` estimates for the prompts `rows` of `enc` (one batch); `walked()` is called after
    each walk down the layers (`walks_per_batch` of them)."""
    metric, kl_tokens = setup.metric, setup.kl_tokens
    lengths = enc.attention_mask[rows].sum(-1)
    trim = enc.length - int(lengths.max())
    ids, mask = enc.input_ids[rows, trim:], enc.attention_mask[rows, trim:]
    L = model.n_layers
    logits, sparse = record_inputs(model, ids, mask, checkpoint_layers(L))
    logp0 = _logp(logits)
    real = mask.to(torch.bool)[:, :, None, None]
    p_top: torch.Tensor | None = None
    if metric == "kl":
        p_top, top = logp0.exp().topk(kl_tokens, dim=-1)  # [R, m]

    def scalars(last_logits: torch.Tensor) -> list[torch.Tensor]:
        logp = _logp(last_logits)
        if metric == "kl":
            return [logp.gather(-1, top[:, j : j + 1].to(logp.device)).sum() for j in range(kl_tokens)]
        values = metric(logp, rows.to(logp.device))
        if not isinstance(values, torch.Tensor) or tuple(values.shape) != (len(rows),):
            raise HeadsteerValueError(
                f"the metric must return a [{len(rows)}] tensor, got {short_repr(values)}"
            )
        if not values.requires_grad:
            raise HeadsteerValueError("the metric does not depend on the log-probs it is given (no gradient)")
        return [values.sum()]

    def estimate(effects: Sequence[torch.Tensor]) -> torch.Tensor:
        if metric == "kl":
            return coarse_kl(cast(torch.Tensor, p_top).cpu(), torch.stack(list(effects), 1))
        return effects[0]

    if not setup.graddrop:
        eff = _Walk(model, ids, mask, rows, setup, real, scalars, []).run(sparse)
        if walked is not None:
            walked()
        return estimate([eff[(None, j)] for j in range(len(eff))])
    n_scalars = 1 if metric != "kl" else kl_tokens
    per_group = max(1, MAX_FLOWS // n_scalars)
    total = torch.zeros(len(rows), L, model.n_heads)
    for g0 in range(0, L, per_group):
        drops = list(range(g0, min(L, g0 + per_group)))
        if g0:  # recorded again: kept for every walk they would add their copies to each walk's peak
            _, sparse = record_inputs(model, ids, mask, checkpoint_layers(L))
        eff = _Walk(model, ids, mask, rows, setup, real, scalars, drops).run(sparse)
        if walked is not None:
            walked()
        for d in drops:
            est = estimate([eff[(d, j)] for j in range(n_scalars)])
            total += est if metric == "kl" else est.abs()
    return total / (L - 1)


def _logp(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
