"""Attribution patching (AtP) on clean / corrupted pairs: the first-order estimate of activation
patching, `patch(model, pairs, kind, method="attribution")`.

Activation patching replaces an activation `a` of the base run (the corrupted prompt when
denoising, the clean one when noising) by its value on the source run and measures the metric M.
Attribution patching (Nanda 2023, "Attribution patching"; Syed, Rager & Conmy 2023; Kramar et
al. 2024, "AtP*", Sec. 3.1) estimates every site's patched metric at once from one backward of
the base run:

    M(patched at s) ~= M(base) + sum_{site s} (a_source(s) - a_base(s)) . dM/da(s) |_base

with the gradient taken on the base run: on the corrupted run when denoising (clean values into
the corrupted run), on the clean run when noising. The sums run over the site's features (and,
for `head_out`, its positions). The result is the same `PatchResult` as `patch`'s, its `raw` the
estimated patched metric, normalised as `patch` normalises (`(raw - corrupt) / (clean - corrupt)`
when denoising), so `patch(...)` and `patch(..., method="attribution")` compare cell by cell.

Sites (`ATTRIBUTION_KINDS`): `head_out` (z per head, TransformerLens' `hook_z`, summed over every
position, `[L, H]`), `head_out_by_pos` (`[L, H, P]`), `attn_out`, `mlp_out` (the value joining the
stream, `hook_attn_out` / `hook_mlp_out`, after a post-norm where the family has one) and
`resid_pre` (`[L, P]`). `q`, `k`, `v` and `pattern` are refused by name (`PatchRequest`).

Memory (linear in the prompt, no `[H, T, T]` pattern kept, no cache of every site): the gradients
come one layer at a time (`heads.scorers.layerwise`): a no-grad pass of each run records the
residual entering a few layers (`checkpoint_layers`); the walk goes down from the top layer,
recomputing a segment's inputs without gradients when it reaches it (in `PARTS` passes, so half a
segment's inputs are alive), and runs each layer alone with gradients (its attention half over
every position, its MLP half in position chunks where the block has a `resid_mid`, as the AtP walk
of `heads.scorers.safety.atp`). The no-grad passes also run one layer at a time with the MLP in
position chunks (`layerwise.layer_output`): a whole forward's MLP intermediates (about 10 residual
copies on SmolLM2) never coexist with the checkpoints. The source run is walked down beside the
base run: at each scored layer its site comes from that layer alone without gradients, after the
base layer's backward, is contracted with the gradient at once and dropped. Where the source's
sites at the scored layers and positions take fewer bytes than its checkpoints (few layers or
positions), they are recorded in its one forward instead (`SOURCE`). Kept at the peak on SmolLM2
(30 layers, residual copies `[T, D]`): the two runs' checkpoints and half a segment each (about
14), one layer's attention graph (about 5) and the gradients (2-3): 2.1-2.3x a plain forward's
peak at 1k-4k tokens (docs/long-context.md).

Cost: per chunk of pairs (`SweepOptions.max_rows` pairs a walk) a recording pass of each run,
about 1.5 recomputing passes of each, and one forward and backward of each layer: about 7-8
forwards' CPU time, whatever the number of sites (activation patching: one forward per site
and pair).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import cast

import torch

from heads._util.progress import progress_callback
from heads.engine.activations import ActivationEdit, ActivationRecorder
from heads.engine.edits import AttentionCall, Edit
from heads.engine.options import SweepOptions
from heads.engine.variants import run_rows
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.scorers.layerwise import (
    attention_half,
    checkpoint_layers,
    has_mid,
    inputs_down_chunked,
    layer_output,
    mlp_half,
    record_inputs_chunked,
    run_layer,
)
from heads.scorers.patching.metrics import Metric
from heads.scorers.patching.pairs import PairBatch
from heads.scorers.patching.request import ATTRIBUTION_KINDS, PatchRequest
from heads.scorers.patching.vision import ImagePairBatch
from heads.scorers.safety.atp import MLP_CHUNKS, MLP_MIN_ROWS

__all__ = ["ATTRIBUTION_KINDS", "attribution_sweep", "run_attribution"]


PARTS = 2
"""Parts a checkpoint segment of either run's walk is recomputed in
(`layerwise.inputs_down_chunked`): 2 keeps half a segment's inputs (on SmolLM2 four residual
copies fewer at the peak, both runs together) for about two thirds of a forward more."""

SOURCE = "auto"
"""How the source run's sites reach the walk: `"auto"` (the cheaper in bytes), `"record"` (kept
from its one forward at the scored layers / positions) or `"walk"` (recomputed from its
checkpoints beside the base walk); the tests force each."""

_SITE = {
    "attn_out": "attn_out",
    "mlp_out": "mlp_out",
    "head_out": "head_output",
    "head_out_by_pos": "head_output",
}


class _Stop(Exception):
    """Ends a no-grad forward once the source's site has been read."""


def _columns(kind: str) -> bool:
    return kind != "head_out"


def _tap(
    box: list[torch.Tensor], node: list[torch.Tensor]
) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor]:
    """An edit function keeping the site's value (`box`, detached) and passing on a view of it
    (`node`) whose gradient is dM/da: a graph node that copies nothing."""

    def fn(x: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        box.append(x.detach())
        view = x.view_as(x)
        node.append(view)
        return view

    return fn


def _zeros_if_none(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g.detach()


def _as_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """A stream site's tensor as `[R, T, D]` (a MoE block may hand its rows flattened)."""
    return x.reshape(rows, -1, x.shape[-1]) if x.dim() == 2 else x


class _Contract:
    """The per-layer contraction `(a_source - a_base) . g` of one chunk of pairs, into `effects`
    (`{layer: [R, H] | [R, H, P] | [R, P]}`). `by_col`: the source's sites were recorded at the
    scored columns `cols` (`[R, P, ...]`), else they span every position (`[R, T, ...]`)."""

    def __init__(self, kind: str, cols: torch.Tensor, real: torch.Tensor, n_heads: int, by_col: bool):
        self.kind, self.cols, self.real, self.H, self.by_col = kind, cols, real, n_heads, by_col
        self.effects: dict[int, torch.Tensor] = {}

    def add(self, la: int, src: torch.Tensor, base: torch.Tensor, grad: torch.Tensor, start: int = 0) -> None:
        """Add the contraction at positions `start .. start + c - 1` of layer `la` (`base`, `grad`
        `[R, c, ...]`: the base run's site and its gradient there; `src` as the class says)."""
        R, c = base.shape[0], base.shape[1]
        if self.kind == "head_out":  # [R, T, H, d] -> [R, H]
            d = ((src.float() - base.float()) * grad.float()).sum(-1)
            d = torch.where(self.real.to(d.device)[:, :, None], d, 0.0).sum(1)
            self._acc(la, d.cpu())
            return
        shape = (R, self.H, len(self.cols)) if self.kind == "head_out_by_pos" else (R, len(self.cols))
        full = self.effects.setdefault(la, torch.zeros(shape))
        inside = ((self.cols >= start) & (self.cols < start + c)).nonzero().flatten()
        if not len(inside):
            return
        at = (self.cols[inside] - start).to(base.device)
        s = src[:, inside.to(src.device)] if self.by_col else src[:, (self.cols[inside]).to(src.device)]
        d = ((s.float() - base[:, at].float()) * grad[:, at].float()).sum(-1)  # [R, p] or [R, p, H]
        real = self.real.to(d.device)[:, self.cols[inside].to(d.device)]
        d = torch.where(real.reshape(R, -1, *([1] * (d.dim() - 2))), d, 0.0).cpu()
        if self.kind == "head_out_by_pos":
            full[:, :, inside] += d.transpose(1, 2)
        else:
            full[:, inside] += d

    def _acc(self, la: int, d: torch.Tensor) -> None:
        got = self.effects.setdefault(la, torch.zeros(d.shape))
        got += d


def _source_site(
    model: HeadModel, ids: torch.Tensor, mask: torch.Tensor, kind: str, la: int, x: torch.Tensor
) -> torch.Tensor:
    """The source run's activation at `kind`'s site of layer `la` (`[R, T, ...]`), from layer
    `la` alone without gradients from `x`, the residual entering it (the forward stops there)."""
    if kind == "resid_pre":
        return x
    if kind == "mlp_out":  # the MLP in position chunks (`layer_output`); the top layer: its last position
        R, T = ids.shape
        full = x.new_zeros(R, T, x.shape[-1])

        def keep(a: int, y: torch.Tensor) -> None:
            y = _as_rows(y, R)
            full[:, a : a + y.shape[1]] = y

        layer_output(model, ids, mask, la, x, mlp_read=keep)
        return full
    got: list[torch.Tensor] = []

    def read(a: torch.Tensor, call: AttentionCall) -> None:
        got.append(a.detach())
        raise _Stop

    try:
        run_rows(
            model,
            ids,
            mask,
            [ActivationEdit(_SITE[kind], la, read)],
            start=la,
            residual=x if la else None,
            hidden_states=False,
        )
    except _Stop:
        pass
    if not got:  # pragma: no cover - every layer has the sites of ATTRIBUTION_KINDS
        raise RuntimeError(f"the source forward never reached {kind} of layer {la}")
    return got[0] if kind not in ("attn_out", "mlp_out") else _as_rows(got[0], ids.shape[0])


def _record_sites(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    kind: str,
    layers: Sequence[int],
    cols: torch.Tensor,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """One no-grad forward of the source run keeping its site at `layers` (at `cols` for the
    by-position kinds): `(last logits [R, V] fp32, {layer: [R, P | T, ...]})`."""
    R = ids.shape[0]
    keep_cols = cols.clamp(min=0)

    def pick(x: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        x = _as_rows(x, R) if kind in ("attn_out", "mlp_out") else x
        return x[:, keep_cols.to(x.device)].clone() if _columns(kind) else x.clone()

    site = "residual" if kind == "resid_pre" else _SITE[kind]
    recs = {la: ActivationRecorder(site, la, pick) for la in layers}
    with torch.no_grad():
        out = run_rows(model, ids, mask, list(recs.values()), hidden_states=False)
    return out.logits[:, -1].float(), {la: r.records[-1] for la, r in recs.items()}


class _Source:
    """The source run's site values going down the layers: recorded (`sites`) or recomputed from
    its checkpoints (`walk`, advanced in step with the base walk)."""

    def __init__(
        self,
        model: HeadModel,
        ids: torch.Tensor,
        mask: torch.Tensor,
        kind: str,
        layers: Sequence[int],
        cols: torch.Tensor,
    ):
        self.model, self.ids, self.mask, self.kind = model, ids, mask, kind
        L = model.n_layers
        item = torch.empty(0, dtype=model.dtype).element_size()
        T, D = ids.shape[1], model.d_model
        per = (len(cols) if _columns(kind) else T) * (model.n_heads * model.d_head if "head" in kind else D)
        stored = len(layers) * per
        walked = len(checkpoint_layers(L)) * T * D + per  # the checkpoints, one layer's site
        self.sites: dict[int, torch.Tensor] | None = None
        self.walk: Iterator[tuple[int, torch.Tensor]] | None = None
        if SOURCE == "record" or (SOURCE == "auto" and stored * item <= walked * item):
            self.logits, self.sites = _record_sites(model, ids, mask, kind, layers, cols)
        else:
            self.logits, sparse = record_inputs_chunked(model, ids, mask, checkpoint_layers(L))
            self.walk = inputs_down_chunked(model, ids, mask, sparse, PARTS)

    def at(self, la: int, wanted: bool) -> torch.Tensor | None:
        """The source's site of layer `la` (layers are asked for from the top down, each once)."""
        if self.sites is not None:
            return self.sites.pop(la) if wanted else None
        got, x = next(cast(Iterator[tuple[int, torch.Tensor]], self.walk))
        if got != la:  # pragma: no cover - both walks go down one layer at a time
            raise RuntimeError(f"source walk at layer {got}, base walk at {la}")
        return _source_site(self.model, self.ids, self.mask, self.kind, la, x) if wanted else None


def _walk(
    model: HeadModel,
    base_ids: torch.Tensor,
    mask: torch.Tensor,
    kind: str,
    layers: Sequence[int],
    source: _Source,
    contract: _Contract,
    scalar: Callable[[torch.Tensor], torch.Tensor],
    base_sparse: dict[int, torch.Tensor],
) -> None:
    """The gradient walk of the base run from the top layer down to the lowest scored layer."""
    L, R = model.n_layers, base_ids.shape[0]
    wanted, bottom = set(layers), min(layers)
    split = has_mid(model)
    g_next: torch.Tensor | None = None  # the gradient reaching the stream leaving the layer
    for la, x_in in inputs_down_chunked(model, base_ids, mask, base_sparse, PARTS):
        # the source's site of the layer: for mlp_out before the layer (its MLP chunks contract it),
        # else after the layer's backward (not alive beside its graph)
        src = source.at(la, la in wanted) if kind == "mlp_out" else None
        x = x_in.detach().requires_grad_(True)
        box: list[torch.Tensor] = []
        node: list[torch.Tensor] = []
        tapped = la in wanted and kind != "resid_pre"
        edits: list[Edit] = []
        if tapped and kind != "mlp_out":
            edits.append(ActivationEdit(_SITE[kind], la, _tap(box, node)))
        top = la == L - 1
        outs: list[torch.Tensor] = []
        g_outs: list[torch.Tensor | None] = []
        if split:
            outs.append(attention_half(model, base_ids, mask, la, x, edits))
            mlp_src = src if kind == "mlp_out" else None
            g_outs.append(_mlp_backward(model, base_ids, la, outs[0], g_next, scalar, mlp_src, contract))
        else:
            if kind == "mlp_out" and tapped:
                edits.append(ActivationEdit("mlp_out", la, _tap(box, node)))
            outs.append(run_layer(model, base_ids, mask, la, x, edits))
            if top:
                with torch.enable_grad():
                    outs[0] = scalar(outs[0])
                g_outs.append(None)
            else:
                g_outs.append(g_next)
        g_next = None
        leaves = [x, *node]
        grads = torch.autograd.grad(outs, leaves, grad_outputs=g_outs, allow_unused=True)
        gx = _zeros_if_none(grads[0], x)
        outs.clear()
        g_outs.clear()
        if kind != "mlp_out":
            src = source.at(la, la in wanted)
        if src is not None:
            if kind == "resid_pre":
                contract.add(la, src, x_in, gx)
            elif len(grads) > 1:
                g_site = _zeros_if_none(grads[1], node[0])
                base = box[0]
                if kind in ("attn_out", "mlp_out"):
                    base, g_site = _as_rows(base, R), _as_rows(g_site, R)
                contract.add(la, src, base, g_site)
        del box, node, grads, src
        if la == bottom:
            break
        g_next = gx


def _mlp_backward(
    model: HeadModel,
    ids: torch.Tensor,
    la: int,
    mid: torch.Tensor,
    g_next: torch.Tensor | None,
    scalar: Callable[[torch.Tensor], torch.Tensor],
    src_mlp: torch.Tensor | None,
    contract: _Contract,
) -> torch.Tensor:
    """The gradient at `resid_mid` of layer `la` from the gradient leaving the layer (`g_next`;
    None at the top layer: the metric's), the MLP half run in position chunks (the top layer's at
    the last position only, the one the logits read); with `src_mlp` the source's `mlp_out` of
    the layer is contracted with the gradient at `mlp_out`, chunk by chunk."""
    R, T = mid.shape[0], mid.shape[1]
    top = g_next is None
    chunk = max(MLP_MIN_ROWS, -(-T // MLP_CHUNKS))
    starts = [T - 1] if top else list(range(0, T, chunk))
    g_mid = torch.zeros_like(mid) if top else cast(torch.Tensor, g_next)
    for a in starts:
        c = 1 if top else min(chunk, T - a)
        piece = mid[:, a : a + c].detach().requires_grad_(True)
        box: list[torch.Tensor] = []
        node: list[torch.Tensor] = []
        edits: list[Edit] = [] if src_mlp is None else [ActivationEdit("mlp_out", la, _tap(box, node))]
        out = mlp_half(model, ids, la, piece, a, edits)
        leaves = [piece, *node]
        if top:
            with torch.enable_grad():
                grads = torch.autograd.grad(scalar(out), leaves, allow_unused=True)
        else:
            grads = torch.autograd.grad(out, leaves, g_mid[:, a : a + c], allow_unused=True)
        if src_mlp is not None:  # before g_mid is written: the gradient at mlp_out may be a view of it
            base, g = _as_rows(box[0], R), _as_rows(_zeros_if_none(grads[1], node[0]), R)
            contract.add(la, src_mlp, base, g, start=a)
        g_mid[:, a : a + c] = _zeros_if_none(grads[0], piece)
        del out, piece, grads
    return g_mid


def run_attribution(
    model: HeadModel,
    pairs: PairBatch,
    kind: str,
    direction: str,
    met: Metric,
    layers: Sequence[int],
    positions: Sequence[int],
    options: SweepOptions,
    report: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attribution patching of `kind` at `layers` (and the padded columns `positions` for the
    by-position kinds) on the checked inputs of `activation.run_patch`: `(raw [S, N] the
    estimated patched metric per site (the grid of `patch` flattened, layer-major) and pair,
    clean metric [N], corrupted metric [N])`. Pairs go `options.max_rows` a walk, sorted by
    length (a walk trims the left padding its pairs share).

    Raises:
        HeadsteerValueError: a kind outside `ATTRIBUTION_KINDS`; a metric whose value does not
            depend on the logits (no gradient), raised at the first walk.
    """
    if kind not in ATTRIBUTION_KINDS:
        raise HeadsteerValueError(
            f"attribution patching estimates {ATTRIBUTION_KINDS}, not kind={kind!r}; use method='activation'"
        )
    N, T, H = pairs.n, pairs.width, model.n_heads
    lengths = pairs.lengths.tolist()
    order = sorted(range(N), key=lambda i: lengths[i])
    base_side, src_side = ("corrupted", "clean") if direction == "denoising" else ("clean", "corrupted")
    P = len(positions)
    cell = {"head_out": (H,), "head_out_by_pos": (H, P)}.get(kind, (P,))
    effect = torch.zeros(len(layers), *cell, N)
    m_clean, m_corrupt = torch.zeros(N), torch.zeros(N)
    done = 0
    for a in range(0, N, options.max_rows):
        rows = torch.tensor(order[a : a + options.max_rows])
        trim = T - max(lengths[i] for i in rows.tolist())
        mask = pairs.attention_mask[rows, trim:]
        base_ids, src_ids = pairs.ids(base_side)[rows, trim:], pairs.ids(src_side)[rows, trim:]
        cols = torch.tensor([p - trim if p >= trim else -1 for p in positions] if _columns(kind) else [])
        source = _Source(model, src_ids, mask, kind, layers, cols)
        base_logits, sparse = record_inputs_chunked(model, base_ids, mask, checkpoint_layers(model.n_layers))
        clean_logits = source.logits if direction == "denoising" else base_logits
        for side, lg in (("base", base_logits), ("source", source.logits)):
            val = met(lg, pairs, rows, clean_logits).cpu()
            (m_corrupt if (side == "base") == (direction == "denoising") else m_clean)[rows] = val

        def scalar(
            last: torch.Tensor, rows: torch.Tensor = rows, clean: torch.Tensor = clean_logits
        ) -> torch.Tensor:
            value = met(last, pairs, rows, clean.to(last.device))
            if not value.requires_grad:
                raise HeadsteerValueError(
                    f"metric {met.name!r} does not depend on the logits it is given (no gradient): "
                    "attribution patching needs a differentiable metric; use method='activation'"
                )
            return value.sum()

        contract = _Contract(kind, cols, mask.bool(), H, source.sites is not None)
        _walk(model, base_ids, mask, kind, layers, source, contract, scalar, sparse)
        for li, la in enumerate(layers):
            got = contract.effects.get(la)
            if got is not None:
                effect[li, ..., rows] = got.movedim(0, -1)
        done += len(rows)
        if report is not None:
            report(done, N)
    m_base = m_corrupt if direction == "denoising" else m_clean
    raw = m_base + effect
    return raw.reshape(-1, N), m_clean, m_corrupt


def attribution_sweep(
    model: HeadModel,
    pairs: PairBatch,
    request: PatchRequest,
    met: Metric,
    layers: Sequence[int],
    positions: Sequence[int],
    options: SweepOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`patch(..., method="attribution")` once `activation.run_patch` has checked its inputs:
    `run_attribution` with a progress bar over the pairs (text pairs only).

    Raises:
        HeadsteerValueError: vision pairs (`ImagePairBatch`: not estimated), a `max_memory` budget
            (not planned for this method), as `run_attribution`.
    """
    if isinstance(pairs, ImagePairBatch):
        raise HeadsteerValueError(
            "method='attribution' takes text pairs; vision pairs (ImagePairBatch) are not estimated: "
            "use method='activation'"
        )
    if options.max_memory is not None:
        raise HeadsteerValueError(
            "method='attribution' has no memory plan, so SweepOptions(max_memory=...) cannot be held "
            "to; leave max_memory None (its peak is about 2.1-2.3x a plain forward's on SmolLM2 at "
            "1k-4k tokens, docs/long-context.md) or use method='activation'"
        )
    with progress_callback(options.progress, f"attribution patching {request.kind}", "pairs") as report:
        return run_attribution(
            model, pairs, request.kind, request.direction, met, layers, positions, options, report
        )
