"""Path patching: the effect of each sender head on a set of receivers through the direct path only.

Wang et al. 2022 ("Interpretability in the Wild", arXiv:2211.00593, Sec. 3.1 and App. B) and
Goldowsky-Dill et al. 2023 (arXiv:2304.05969). For a sender head s and receivers R (the logits,
or chosen heads' query / key / value inputs), with base prompt x and source prompt x~:

1. run x and x~ and cache every head output (and MLP output);
2. run x with s's output replaced by its x~ value and every *other* head's output frozen to its
   x value; MLPs are recomputed (default, as in the IOI paper) or frozen to x (`mlp="frozen"`);
   record the receivers' inputs;
3. run x with only the receivers' inputs replaced by the values recorded in 2; measure the
   metric. With receivers = the logits, step 3 is the logits of step 2 (the direct effect on
   the output, through the MLPs when they are recomputed).

`direction="noising"` (default, the paper's: x is the clean prompt, x~ the corrupted one) or
`"denoising"` (x corrupted, x~ clean). Scores are normalised as activation patching's
(`heads.scorers.patching.metrics.normalise`).

Receivers' inputs: a q receiver's query as the attention function reads it (after any QK-norm
and RoPE, the engine's query site); a k / v receiver's KV-head columns of the key / value
projection output (before RoPE and QK-norm, which act per position and head), in every fused
layout; `k` / `v` are refused where `activation.patch` refuses them (latent attention; `k` where
the key norm spans all heads). Under GQA, keys and values belong to a KV head: k / v receivers
are `(layer, kv_head)` pairs, and patching one changes the keys / values every query head of its
group reads.
With `mlp="frozen"` and `direction="denoising"` a q receiver's result equals TransformerLens'
`patching.get_act_patch_direct_path` (the sender's write added to the receiver's own copy of
the residual, everything else corrupted), tested.

Speed (all exact): every (sender, pair) is one batch row, `options.max_rows` rows per forward,
on the engine's row forward (`heads.engine.variants.run_rows`):

* step 2 starts at the sender's layer from the base run's residual (layer-prefix reuse);
* every later head's output is frozen, so positions no longer interact above the sender's
  layer: with receivers = the logits only the last position is computed (the earlier ones' keys
  and values come from the base run's cache) and, on the Hugging Face backend, the attention of
  the layers above the sender is not run at all (it returns o_proj of the base run's head
  outputs: `heads.engine.prefix.attention_given`, per thread); with head receivers step 2 stops
  at the last receiver layer's attention (`capture.StopAt`);
* for a metric that reads a few tokens (`logit_diff`) only their logits are computed
  (`heads.scorers.patching.activation.unembed_only`);
* step 3 starts at the first receiver layer above the sender;
* with sender `positions` given, the columns before the first of them are unchanged in both
  steps and come from the base run's cache (position-prefix reuse).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import cast

import torch

from heads._util.progress import progress_callback
from heads.engine.activations import ActivationRecorder
from heads.engine.edits import Edit
from heads.engine.options import SweepOptions
from heads.engine.prefix import attention_given
from heads.engine.variants import run_rows
from heads.errors import HeadsteerTypeError
from heads.model.adapter import HeadModel
from heads.results.scores import HeadSpec
from heads.scorers.patching.activation import (
    PatchResult,
    _check_positions,
    _PatchKV,
    _PatchQuery,
    _PatchZ,
    check_sweep_inputs,
    prefix_cache,
    unembed_only,
)
from heads.scorers.patching.capture import ForwardStopped, PatchStream, StopAt
from heads.scorers.patching.metrics import Metric, base_and_source
from heads.scorers.patching.pairs import PairBatch
from heads.scorers.patching.record import RunCache, cache_bytes, record_run
from heads.scorers.patching.request import MLP_MODES, RECEIVER_INPUTS, PathPatchRequest
from heads.scorers.request_base import expand_layers

__all__ = ["MLP_MODES", "RECEIVER_INPUTS", "path_patch", "run_path_patch"]


def path_patch(
    model: HeadModel,
    pairs: PairBatch,
    senders: HeadSpec | None = None,
    receivers: HeadSpec | str = "logits",
    *,
    inputs: str | Sequence[str] = "q",
    mlp: str = "recompute",
    direction: str = "noising",
    metric: str | Metric | Callable = "logit_diff",
    positions: Sequence[int] | None = None,
    options: SweepOptions | None = None,
) -> PatchResult:
    """Path patching of every sender head to `receivers`, in batched sweeps.

    Args:
        model: the `HeadModel` on any local backend (HF, TransformerLens, nnsight); fp32 recommended.
        pairs: an encoded `PairBatch` (`encode_pairs`).
        senders: the sender heads, any `HeadSpec` form (default: every head); each is patched
            alone.
        receivers: `"logits"` (default: the residual stream at the end, i.e. the direct effect
            on the output) or a head selection whose `inputs` are patched: query heads for
            `"q"`, KV heads (`(layer, kv_head)`) for `"k"` / `"v"`.
        inputs: the receivers' input(s) patched: `"q"` (default), `"k"`, `"v"` or a list.
        mlp: `"recompute"` (default) or `"frozen"`: the MLPs in step 2.
        direction: `"noising"` (default, Wang et al.: the clean run with the sender's corrupted
            output) or `"denoising"`.
        metric: as `heads.scorers.patching.activation.patch` (default logit difference).
        positions: padded columns where the sender's output is replaced (default all;
            negative counts from the end).
        options: `SweepOptions` (rows per forward, progress, `max_memory` as in `patch`);
            default `SweepOptions()`. Progress counts work in token-layers (rows x recomputed
            columns x layers run), not rows.

    Returns:
        a `PatchResult` of kind `"path"`, grid `("layer", "head")` over every head: raw metric
        `[L, H, N]` per sender and pair (NaN for heads that are not senders); a sender with no
        receiver above its layer has the base run's metric (no path). `.head_scores()` gives the
        mean normalised scores as `HeadScores`.

    Raises:
        TypeError: pairs not a `PairBatch`, options not a `SweepOptions`.
        ValueError: unknown senders / receivers / inputs / mlp mode / direction / metric, inputs
            other than "q" with receivers "logits", a k / v input the family does not have,
            ids outside the vocabulary, positions out of range, a pair that cannot show an
            effect (`pairs.check_pairs_differ`), nnsight with `remote=True` — before any
            forward.
    """
    if isinstance(inputs, str):
        kv = inputs in ("k", "v")
    else:
        kv = isinstance(inputs, Sequence) and any(c in ("k", "v") for c in inputs)
    if not (isinstance(receivers, str) and receivers == "logits"):
        receivers = expand_layers(receivers, model.n_layers, model.n_kv_heads if kv else model.n_heads)  # type: ignore[assignment]
    request = PathPatchRequest(
        senders=expand_layers(senders, model.n_layers, model.n_heads),  # type: ignore[arg-type]
        receivers=receivers,  # type: ignore[arg-type]
        inputs=inputs,
        mlp=mlp,
        direction=direction,
        metric=metric,
        positions=positions,
    )
    return run_path_patch(model, pairs, request, options)


def run_path_patch(
    model: HeadModel, pairs: PairBatch, request: PathPatchRequest, options: SweepOptions | None = None
) -> PatchResult:
    """Run a `PathPatchRequest` on `pairs` (what `path_patch` does once it has built the request:
    the request's values are checked there, its geometry here against `model`, with the pairs
    and the options; see `path_patch` for the result and the errors)."""
    if not isinstance(request, PathPatchRequest):
        raise HeadsteerTypeError(f"request must be a PathPatchRequest, got {type(request).__name__}")
    mlp, direction, comps = request.mlp, request.direction, tuple(request.inputs)
    met, options = check_sweep_inputs(model, pairs, options, request.metric, what="path patching")
    request.check_config(model)  # heads in range, k / v and mlp='frozen' on this family, GQA mixing
    every = [(la, h) for la in range(model.n_layers) for h in range(model.n_heads)]
    sends = every if request.senders is None else list(request.senders)
    recv: list[tuple[int, int]] | None = None
    if request.receivers != "logits":
        recv = sorted(cast("Sequence[tuple[int, int]]", request.receivers))
    poss = None if request.positions is None else _check_positions(pairs, request.positions)
    model.check_length(pairs.width)
    kept = 2 * cache_bytes(model, pairs.n, pairs.width, keys=False)
    options = options.within(model, pairs.width, reserve=kept, whole=pairs.n)  # max_memory

    mask = pairs.attention_mask
    clean = record_run(model, pairs.clean_ids, mask, keys=False)
    corrupt = record_run(model, pairs.corrupted_ids, mask, keys=False)
    base, src, base_ids, m_clean, m_corrupt, m_base = base_and_source(clean, corrupt, pairs, met, direction)

    L, H, N = model.n_layers, model.n_heads, pairs.n
    raw = torch.full((L, H, N), math.nan)
    lengths = pairs.lengths.tolist()
    width = pairs.width
    recv_layers = sorted({la for la, _ in recv}) if recv is not None else []
    groups: dict[int, list[tuple[int, int]]] = {}
    for s_i, (la, _) in enumerate(sends):
        if recv is not None and not any(r > la for r in recv_layers):
            for i in range(N):  # no receiver above the sender: nothing on the path changes
                raw[la, sends[s_i][1], i] = m_base[i]
            continue
        groups.setdefault(la, []).extend((s_i, i) for i in range(N))
    chunks = []
    for _, rows in sorted(groups.items()):
        rows.sort(key=lambda r: (lengths[r[1]], r[0]))
        chunks += [rows[a : a + options.max_rows] for a in range(0, len(rows), options.max_rows)]
    # progress counts work, not rows (as `patch`): a chunk costs its rows x the columns it
    # recomputes x the layers from its sender's to the last one it runs
    last = L if recv is None else max(la for la, _ in recv) + 1
    work = []
    for chunk in chunks:
        trim = width - max(lengths[i] for _, i in chunk)
        split = width - 1 if recv is None else trim if poss is None else max(trim, min(poss[0], width - 1))
        work.append(len(chunk) * (width - split) * max(1, last - sends[chunk[0][0]][0]))
    total = sum(work)
    columns = met.columns(pairs) if met.columns is not None else None
    with (
        progress_callback(options.progress, "path patching", "token-layers") as report,
        unembed_only(model, columns),
    ):
        done = 0
        for chunk, cost in zip(chunks, work, strict=True):
            ps = torch.tensor([i for _, i in chunk])
            heads = [sends[s] for s, _ in chunk]
            logits = _run_chunk(model, base, src, base_ids, mask, heads, ps, recv, comps, mlp, poss, width)
            m = met(logits, pairs, ps, clean.logits[ps]).cpu()
            for r, (la, h) in enumerate(heads):
                raw[la, h, int(ps[r])] = m[r]
            done += cost
            if report is not None:
                report(done, total)
    params = {
        "senders": [list(h) for h in sends],
        "receivers": "logits" if recv is None else [list(h) for h in recv],
        "inputs": None if recv is None else list(comps),
        "mlp": mlp,
        "positions": poss,
        "n_pairs": N,
    }
    return PatchResult(
        "path",
        direction,
        met.name,
        raw,
        m_clean.cpu(),
        m_corrupt.cpu(),
        ("layer", "head"),
        [],
        model.name,
        model.n_kv_heads,
        params,
    )


def _run_chunk(
    model: HeadModel,
    base: RunCache,
    src: RunCache,
    base_ids: torch.Tensor,
    mask: torch.Tensor,
    heads: list[tuple[int, int]],
    ps: torch.Tensor,
    recv: list[tuple[int, int]] | None,
    comps: tuple[str, ...],
    mlp: str,
    poss: list[int] | None,
    width: int,
) -> torch.Tensor:
    """Steps 2 (and 3) for a chunk of rows (sender, pair) sharing the sender's layer; `[R, V]`."""
    R, H, L = len(heads), model.n_heads, model.n_layers
    dev = model.device
    layer = heads[0][0]
    lengths = mask[ps].sum(-1)
    trim = width - int(lengths.max())
    if recv is None:
        split = width - 1  # positions are independent above the sender: the last one suffices
    elif poss is not None:
        split = max(trim, min(poss[0], width - 1))
    else:
        split = trim
    ids, m = base_ids[ps, split:], mask[ps, trim:]

    def prefix(start: int):
        residual = base.residuals[start][ps, split:] if start else None
        past = None
        if split > trim:
            past = prefix_cache(base, ps, trim, split, start)
        return residual, past

    rh = torch.zeros(R, H, dtype=torch.bool)
    for r, (_, h) in enumerate(heads):
        rh[r, h] = True
    cols = None
    if poss is not None:
        cols = torch.zeros(R, width - trim, dtype=torch.bool)
        for p in poss:
            if p >= trim:
                cols[:, p - trim] = True
    # the forward computes the columns from `split` on: the sources hold only those (a copy of
    # every layer's outputs at every column would cost more than the attention it replaces)
    at = split - trim
    edits: list[Edit] = [
        _PatchZ(
            layer=layer,
            row_heads=rh,
            source=src.z[layer][ps, split:].to(dev),
            cols=None if cols is None else cols[:, at:],
            start=at,
        )
    ]
    last = L - 1 if recv is None else max(la for la, _ in recv)
    # every head above the sender is frozen; with receivers = the logits (Hugging Face backend)
    # those layers' attention is not run at all: it returns o_proj of the base run's head outputs
    # (`heads.engine.prefix.attention_given`, per thread), the output it would compute
    given: dict[int, torch.Tensor] = {}
    if recv is None and model.backend.kind == "hf":
        with torch.no_grad():
            for la in range(layer + 1, L):
                given[la] = model.out_projs[la](base.z[la][ps, split:].to(dev).flatten(-2))
    else:
        for la in range(layer + 1, min(last + 1, L)):
            edits.append(_PatchZ(layer=la, source=base.z[la][ps, split:].to(dev), start=at))
    if mlp == "frozen":
        every = torch.ones(R, width - trim, dtype=torch.bool, device=dev)
        for la in range(layer, min(last + 1, L)):
            edits.append(PatchStream("mlp_out", la, base.mlp_out[la][ps, trim:].to(dev), every))
    targets = [] if recv is None else [la for la in sorted({la for la, _ in recv}) if la > layer]
    seen: dict[tuple[int, str], ActivationRecorder] = {}
    for la in targets:  # the receivers' inputs in step 2 (q: as attention reads it)
        for c in comps:
            seen[(la, c)] = ActivationRecorder("query" if c == "q" else c, la)
            edits.append(seen[(la, c)])
    if targets:  # nothing after the last receiver layer's attention is needed
        edits.append(StopAt("head_output", targets[-1]))
    residual, past = prefix(layer)
    try:
        with attention_given(model, given) if given else nullcontext():
            out = run_rows(model, ids, m, edits, start=layer, residual=residual, past=past)
    except ForwardStopped:
        out = None
    if recv is None:
        return out.logits[:, -1].float()
    # step 3: the base run with only the receivers' inputs replaced
    start = targets[0]
    residual, past = prefix(start)
    put: list[Edit] = []
    for la in targets:
        here = [h for lr, h in recv if lr == la]
        for c in comps:
            mask_h = torch.zeros(R, H if c == "q" else model.n_kv_heads, dtype=torch.bool)
            mask_h[:, here] = True
            rec = seen[(la, c)].records[0]
            if c == "q":
                put.append(_PatchQuery(layer=la, row_heads=mask_h, source=rec, start=split - trim))
            else:
                put.append(_PatchKV(c, la, row_heads=mask_h, source=rec, start=split - trim))
    out = run_rows(model, ids, m, put, start=start, residual=residual, past=past)
    return out.logits[:, -1].float()
