"""Gradients one layer at a time: the backward of the gradient-based analyses in memory linear in
the prompt, on the engine's sites (every backend, per thread).

A backward through the whole model keeps every layer's activations (tens of residual-stream
copies per layer). Here a no-grad forward records the residual stream entering a few layers
(`record_inputs`: every `every`-th, or `checkpoint_layers`' segments that shrink towards the
top); the backward then walks the layers from the top: a segment is recomputed without
gradients to get each layer's input (`inputs_down`), and each layer runs alone with gradients
(`run_layer`: the engine's layer-prefix reuse starts the forward at the layer, a `resid_post`
read stops it after the layer), so one layer's graph is alive at a time. The gradient reaching
the stream entering layer l is passed to layer l - 1 as the gradient of its output. Peak memory:
about `L / every + every` residual copies (`sqrt(2 L)` with `checkpoint_layers`), one layer's
graph, and what the analysis keeps.

A layer whose MLP reads the stream its attention wrote (`has_mid`: every family but the
parallel blocks) can also run as two halves: `attention_half` (all positions, stopped at
`resid_mid`) and `mlp_half` on a chunk of positions from their `resid_mid` (the MLP half is
position-wise), so only a chunk of the MLP's graph (four `[T, d_mlp]` tensors on a gated MLP,
its largest part) is alive at a time.

This is exact: a layer's forward alone from its recorded input computes what it computes inside
the whole forward (the same modules, masks, positions and kernels), so the gradients are those of
one backward through the model (up to float rounding in the order of the sums).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import cast

import torch

from heads.engine.activations import ActivationEdit, ActivationRecorder
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Edit
from heads.engine.forward import run_last
from heads.engine.prefix import attention_given, starting_at
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel

__all__ = [
    "attention_half",
    "inputs_down_chunked",
    "layer_output",
    "checkpoint_layers",
    "default_every",
    "has_mid",
    "inputs_down",
    "mlp_half",
    "record_inputs",
    "record_inputs_chunked",
    "run_layer",
]


class _Stop(Exception):
    """Ends a forward once the layer that was asked for has run."""


def default_every(n_layers: int) -> int:
    """Layers per recomputed segment: about sqrt(L) (then L / every + every is smallest)."""
    return max(1, round(math.sqrt(n_layers)))


def checkpoint_layers(n_layers: int) -> list[int]:
    """Layers whose input `record_inputs` keeps for `inputs_down`, segments shrinking to the top.

    While the walk is in the segment starting at checkpoint i (counted from the bottom), the
    checkpoints below it and that segment's inputs are alive: `i + size_i` residual copies. With
    sizes m, m - 1, m - 2, ... from the bottom (m the smallest with m (m + 1) / 2 >= L) that is at
    most m ~ sqrt(2 L) copies everywhere (8 for 30 layers, against L / every + every = 11 for
    evenly spaced ones), and each layer is still recomputed once.
    """
    m = 1
    while m * (m + 1) // 2 < n_layers:
        m += 1
    starts, at = [], 0
    while at < n_layers:
        starts.append(at)
        at += m - len(starts) + 1
    return starts


def _replace(x: torch.Tensor) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor]:
    def fn(old: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return x

    return fn


def _stop(box: list[torch.Tensor]) -> Callable[[torch.Tensor, AttentionCall], None]:
    def fn(y: torch.Tensor, call: AttentionCall) -> None:
        box.append(y)
        raise _Stop

    return fn


@torch.no_grad()
def record_inputs(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    layers: Sequence[int],
    edits: Sequence[Edit] = (),
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """One forward without gradients: `(logits [R, V] fp32 at the last position, {l: [R, T, D] the
    residual entering layer l for l in layers})`, with `edits` applied too."""
    recs = {la: ActivationRecorder("residual", la) for la in sorted(set(layers))}
    with editing(model, [*edits, *recs.values()], require_fired=False):
        out = run_last(model, ids, mask)
    return out.logits[:, -1].float(), {la: r.records[-1] for la, r in recs.items()}


@torch.no_grad()
def _segment(
    model: HeadModel, ids: torch.Tensor, mask: torch.Tensor, start: int, stop: int, x: torch.Tensor
) -> dict[int, torch.Tensor]:
    """The residual entering layers start+1 .. stop-1, from `x` entering `start` (no gradients):
    the stream leaving layers start .. stop-2, the forward stopped after layer stop-2."""
    if stop - start <= 1:
        return {}
    recs = {la + 1: ActivationRecorder("resid_post", la) for la in range(start, stop - 1)}
    box: list[torch.Tensor] = []
    edits: list[Edit] = [ActivationEdit("residual", start, _replace(x)), *recs.values()]
    edits.append(ActivationEdit("resid_post", stop - 2, _stop(box)))  # after its recorder
    with ExitStack() as stack:
        stack.enter_context(starting_at(model, start, x if start else None))
        stack.enter_context(editing(model, edits, require_fired=False))
        try:
            run_last(model, ids, mask)
        except _Stop:
            pass
    return {la: r.records[-1] for la, r in recs.items()}


def inputs_down(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    sparse: dict[int, torch.Tensor],
    every: int | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """`(l, [R, T, D] the residual entering layer l)` for l = L-1 .. 0, from the residuals `sparse`
    recorded at layers 0 < l1 < l2 ... (`record_inputs`: every `every`-th layer, or
    `checkpoint_layers`); the segment from one recorded layer to the next (`every` is not read:
    the next recorded layer ends a segment, the top one ends at L) is recomputed without
    gradients when the walk reaches it, and its entries are dropped once yielded (`sparse` is
    emptied as the walk goes down)."""
    L = model.n_layers
    starts = sorted(sparse)
    ends = dict(zip(starts, [*starts[1:], L], strict=True))
    for start in reversed(starts):
        stop = ends[start]
        x = sparse.pop(start)
        seg = _segment(model, ids, mask, start, stop, x)
        seg[start] = x
        for la in range(stop - 1, start - 1, -1):
            yield la, seg.pop(la)


def run_layer(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    layer: int,
    x: torch.Tensor,
    edits: Sequence[Edit] = (),
) -> torch.Tensor:
    """Layer `layer` alone with gradients from `x` (`[R, T, D]`, the residual entering it; make it
    a leaf that requires grad to get the gradient that reaches it), with `edits` (of that layer):
    the stream leaving the layer `[R, T, D]`, or for the last layer the logits `[R, V]` at the last
    position (the model's dtype)."""
    last = layer == model.n_layers - 1
    box: list[torch.Tensor] = []
    site_edits: list[Edit] = [ActivationEdit("residual", layer, _replace(x)), *edits]
    if not last:
        site_edits.append(ActivationEdit("resid_post", layer, _stop(box)))
    return _from_layer(model, ids, mask, layer, x, site_edits, box)


def _from_layer(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    layer: int,
    start: torch.Tensor,
    site_edits: list[Edit],
    box: list[torch.Tensor],
) -> torch.Tensor:
    """A forward with gradients starting at `layer` from the residual `start` (layer-prefix
    reuse), with `site_edits`: what a `_stop(box)` edit caught, or else the last position's
    logits `[R, V]` (the forward reached the end)."""
    with ExitStack() as stack:
        stack.enter_context(torch.enable_grad())
        stack.enter_context(starting_at(model, layer, start.detach() if layer else None))
        stack.enter_context(editing(model, site_edits, require_fired=False))
        try:
            out = run_last(model, ids, mask)
        except _Stop:
            return box[-1]
    logits: torch.Tensor = out.logits[:, -1]
    return logits


def has_mid(model: HeadModel) -> bool:
    """Whether the model's blocks have a `resid_mid` site (attention, then the MLP on its output:
    `attention_half` / `mlp_half` apply); False for parallel blocks (GPT-J, Falcon, Phi)."""
    try:
        with editing(model, [ActivationEdit("resid_mid", 0, _read)], require_fired=False):
            return True
    except HeadsteerValueError:
        return False


def _read(x: torch.Tensor, call: AttentionCall) -> None:
    return None


def attention_half(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    layer: int,
    x: torch.Tensor,
    edits: Sequence[Edit] = (),
) -> torch.Tensor:
    """The attention half of layer `layer` with gradients from `x` (`[R, T, D]`, the residual
    entering it, a leaf that requires grad), with `edits` (of that layer's attention half): the
    stream between its attention and its MLP, `resid_mid` `[R, T, D]` (the forward stops at the
    MLP). Needs `has_mid(model)`."""
    box: list[torch.Tensor] = []
    site_edits: list[Edit] = [ActivationEdit("residual", layer, _replace(x)), *edits]
    site_edits.append(ActivationEdit("resid_mid", layer, _stop(box)))
    got = _from_layer(model, ids, mask, layer, x, site_edits, box)
    if not box:
        raise RuntimeError(f"the forward never reached the MLP of layer {layer}")
    return got


def mlp_half(
    model: HeadModel,
    ids: torch.Tensor,
    layer: int,
    mid: torch.Tensor,
    start: int,
    edits: Sequence[Edit] = (),
) -> torch.Tensor:
    """The MLP half of layer `layer` with gradients on the positions `start .. start + c - 1`
    only, from `mid` (`[R, c, D]`, their `resid_mid`, a leaf that requires grad), with `edits`
    of its MLP half (`resid_mid`, `mlp_out`, `resid_post`, ...; edits of the attention's sites
    change nothing here): their stream leaving the layer `[R, c, D]`, or for the last layer the
    logits `[R, V]` at position `start + c - 1` (the model's dtype). Exact: the MLP half is
    position-wise (norms, MLP, MoE routing are per token), so its output at a position depends
    on that position's `resid_mid` only. The forward runs the layer on those positions
    (`ids[:, start : start + c]`) from `mid`, `resid_mid` replaced by `mid`, so only the MLP
    half's graph is kept, `c / T` of the whole layer's MLP graph; on the Hugging Face backend
    the attention is not computed at all (`heads.engine.prefix.attention_given`: zeros, which
    nothing reads), elsewhere it is computed on the chunk and dropped. Needs `has_mid(model)`."""
    stop = start + mid.shape[1]
    piece = ids[:, start:stop]
    site_edits: list[Edit] = [
        ActivationEdit("residual", layer, _replace(mid.detach())),
        ActivationEdit("resid_mid", layer, _replace(mid)),
        *edits,
    ]
    box: list[torch.Tensor] = []
    last = layer == model.n_layers - 1
    if not last:
        site_edits.append(ActivationEdit("resid_post", layer, _stop(box)))
    skip: AbstractContextManager[None] = nullcontext()
    if model.backend.kind == "hf":  # the attention's output is replaced anyway: not computed
        skip = attention_given(model, {layer: mid.new_zeros(1, 1, mid.shape[-1]).expand(mid.shape)})
    with skip:
        return _from_layer(model, piece, torch.ones_like(piece), layer, mid, site_edits, box)


# ------------------------------------------------------------------ no-grad passes, MLP in chunks
CHUNKS = 8
"""Position chunks of a layer's MLP half in the no-grad passes below (`layer_output`)."""
CHUNK_MIN_ROWS = 64
"""Fewest positions in such a chunk (shorter prompts: fewer chunks)."""


def _run_stopped(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    layer: int,
    x: torch.Tensor | None,
    edits: list[Edit],
) -> torch.Tensor | None:
    """A forward without gradients from `layer` (from `x`; None: the embedding) with `edits`; the
    last position's logits `[R, V]`, or None when a `_stop` edit ended it."""
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(starting_at(model, layer, x if layer else None))
        stack.enter_context(editing(model, edits, require_fired=False))
        try:
            out = run_last(model, ids, mask)
        except _Stop:
            return None
    logits: torch.Tensor = out.logits[:, -1]
    return logits


def layer_output(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    layer: int,
    x: torch.Tensor,
    mlp_read: Callable[[int, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Layer `layer` alone without gradients from `x` (`[R, T, D]`, the residual entering it): the
    stream leaving it `[R, T, D]`, or for the last layer the logits `[R, V]` at the last position.
    Where the block has a `resid_mid` (`has_mid`) the attention half runs on every position and
    the MLP half `CHUNKS` position chunks at a time from their `resid_mid` (position-wise, as
    `mlp_half`), so a forward's largest transient, the MLP's `[T, d_mlp]` intermediates, exists
    for one chunk at a time; the last layer's MLP runs on the last position only. `mlp_read(start,
    [R, c, D])` gets each chunk's MLP output (`mlp_out`; parallel blocks: once, every position)."""
    box: list[torch.Tensor] = []
    last = layer == model.n_layers - 1
    enter: list[Edit] = [ActivationEdit("residual", layer, _replace(x))]
    reads: list[Edit] = []
    if mlp_read is not None:
        reads.append(ActivationEdit("mlp_out", layer, lambda y, call: mlp_read(0, y)))
    if not has_mid(model):  # parallel blocks: the layer whole
        stop = [] if last else [ActivationEdit("resid_post", layer, _stop(box))]
        logits = _run_stopped(model, ids, mask, layer, x, [*enter, *reads, *stop])
        return box[-1] if box else cast(torch.Tensor, logits)
    _run_stopped(model, ids, mask, layer, x, [*enter, ActivationEdit("resid_mid", layer, _stop(box))])
    mid = box.pop()
    T = mid.shape[1]
    step = max(CHUNK_MIN_ROWS, -(-T // CHUNKS))
    starts = [T - 1] if last else list(range(0, T, step))
    out = mid if last else torch.empty_like(mid)
    skip: AbstractContextManager[None] = nullcontext()
    for a in starts:
        piece = mid[:, a : a + (1 if last else step)]
        edits: list[Edit] = [
            ActivationEdit("residual", layer, _replace(piece)),
            ActivationEdit("resid_mid", layer, _replace(piece)),
        ]
        if mlp_read is not None:
            edits.append(ActivationEdit("mlp_out", layer, _read_at(mlp_read, a)))
        if not last:
            edits.append(ActivationEdit("resid_post", layer, _stop(box)))
        if model.backend.kind == "hf":  # the attention's output is replaced anyway: not computed
            skip = attention_given(model, {layer: piece.new_zeros(1, 1, piece.shape[-1]).expand(piece.shape)})
        p_ids = ids[:, a : a + piece.shape[1]]
        with skip:
            logits = _run_stopped(model, p_ids, torch.ones_like(p_ids), layer, piece, edits)
        if last:
            return cast(torch.Tensor, logits)
        out[:, a : a + piece.shape[1]] = box.pop()
    return out


def _read_at(
    read: Callable[[int, torch.Tensor], None], a: int
) -> Callable[[torch.Tensor, AttentionCall], None]:
    def fn(y: torch.Tensor, call: AttentionCall) -> None:
        read(a, y.detach())

    return fn


@torch.no_grad()
def record_inputs_chunked(
    model: HeadModel, ids: torch.Tensor, mask: torch.Tensor, layers: Sequence[int]
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """`record_inputs` one layer at a time (`layer_output`: the MLP in position chunks), so its
    peak is the kept residuals and one layer's attention, not a whole forward's MLP
    intermediates: `(logits [R, V] fp32 at the last position, {l: [R, T, D] entering l})`."""
    box: list[torch.Tensor] = []
    _run_stopped(model, ids, mask, 0, None, [ActivationEdit("residual", 0, _stop(box))])
    x = box.pop()
    keep = set(layers)
    sparse: dict[int, torch.Tensor] = {}
    for la in range(model.n_layers):
        if la in keep:
            sparse[la] = x
        x = layer_output(model, ids, mask, la, x)
    return x.float(), sparse


def inputs_down_chunked(
    model: HeadModel, ids: torch.Tensor, mask: torch.Tensor, sparse: dict[int, torch.Tensor], parts: int = 1
) -> Iterator[tuple[int, torch.Tensor]]:
    """`inputs_down` whose segments are recomputed one layer at a time (`layer_output`: the MLP in
    position chunks), keeping at most `ceil(size / parts)` of a segment's inputs: each segment is
    recomputed from its checkpoint once per part, top part first (a segment of n layers costs
    about `n (parts + 1) / 2` layer forwards instead of n)."""
    starts = sorted(sparse)
    ends = dict(zip(starts, [*starts[1:], model.n_layers], strict=True))
    for start in reversed(starts):
        x0 = sparse.pop(start)
        stop = ends[start]
        size = -(-(stop - start) // max(1, parts))
        top = stop
        while top > start:
            low = max(start, top - size)
            seg, x = {start: x0} if low == start else {}, x0
            for la in range(start, top - 1):
                x = layer_output(model, ids, mask, la, x)
                if la + 1 >= low:
                    seg[la + 1] = x
            del x
            for la in range(top - 1, low - 1, -1):
                yield la, seg.pop(la)
            top = low
