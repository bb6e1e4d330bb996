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
  the layers above the sender is not run at all (its output is the base run's); with head
  receivers step 2 stops at the last receiver layer;
* for a metric that reads a few tokens (`logit_diff`) only their logits are computed
  (`heads.scorers.patching.activation.unembed_only`);
* step 3 starts at the first receiver layer above the sender;
* with sender `positions` given, the columns before the first of them are unchanged in both
  steps and come from the base run's cache (position-prefix reuse).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch

from heads._util.progress import progress_callback
from heads._util.validation import short_repr
from heads.engine.edits import Edit
from heads.engine.options import SweepOptions
from heads.engine.variants import check_heads, run_rows
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.results.scores import HeadSet, HeadSpec
from heads.scorers.patching.activation import (
    PatchResult,
    _check_positions,
    _output_patch,
    _PatchQuery,
    _PatchZ,
    check_sweep_inputs,
    prefix_cache,
    unembed_only,
)
from heads.scorers.patching.metrics import DIRECTIONS, Metric
from heads.scorers.patching.pairs import PairBatch
from heads.scorers.patching.record import (
    RunCache,
    _qkv_modules,
    _QueryRecorder,
    check_kv_kind,
    kv_columns,
    record_run,
)

__all__ = ["MLP_MODES", "RECEIVER_INPUTS", "path_patch"]

RECEIVER_INPUTS = ("q", "k", "v")
"""Receiver head inputs that `path_patch(receivers=heads, inputs=...)` patches."""

MLP_MODES = ("recompute", "frozen")
"""`mlp=` values: MLPs recomputed in step 2 (default, Wang et al.) or frozen to the base run."""


class _Stop(Exception):
    """Raised by a hook once step 2 has recorded every receiver input (nothing later is needed)."""


def _check_receivers(
    model: HeadModel, receivers: object, inputs: object
) -> tuple[list[tuple[int, int]] | None, tuple[str, ...]]:
    """(`None` for the logits or the sorted receiver heads, the receiver inputs)."""
    if isinstance(inputs, str):
        comps: tuple[str, ...] = (inputs,)
    elif isinstance(inputs, Sequence) and inputs and all(isinstance(c, str) for c in inputs):
        comps = tuple(dict.fromkeys(inputs))
    else:
        raise HeadsteerValueError(
            f"inputs must be one of {RECEIVER_INPUTS} or a list of them, got {short_repr(inputs)}"
        )
    for c in comps:
        if c not in RECEIVER_INPUTS:
            raise HeadsteerValueError(f"unknown receiver input {short_repr(c)}; use one of {RECEIVER_INPUTS}")
    if isinstance(receivers, str) and receivers == "logits":
        if comps != ("q",):
            raise HeadsteerValueError(
                f"inputs={short_repr(inputs)} needs receiver heads; receivers='logits' patches the "
                "residual stream"
            )
        return None, comps
    if isinstance(receivers, str) and not receivers.endswith(".json"):
        raise HeadsteerValueError(
            f"receivers must be 'logits' or a head selection, got {short_repr(receivers)}"
        )
    for c in comps:
        check_kv_kind(model, c)
    kv = any(c in ("k", "v") for c in comps)
    if kv and "q" in comps and model.n_kv_heads != model.n_heads:
        raise HeadsteerValueError(
            "receiver inputs mix q (query heads) with k/v (KV heads) on a GQA model; patch them in "
            "separate calls"
        )
    n = model.n_kv_heads if kv else model.n_heads
    sel = HeadSet.parse(receivers, model.n_layers, n)  # type: ignore[arg-type]
    if not len(sel):
        raise HeadsteerValueError("no receiver heads selected")
    return sorted(sel.heads), comps


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
        options: `SweepOptions` (rows per forward, progress); default `SweepOptions()`.

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
    if direction not in DIRECTIONS:
        raise HeadsteerValueError(f"direction must be one of {DIRECTIONS}, got {short_repr(direction)}")
    if mlp not in MLP_MODES:
        raise HeadsteerValueError(f"mlp must be one of {MLP_MODES}, got {short_repr(mlp)}")
    met, options = check_sweep_inputs(model, pairs, options, metric, what="path patching")
    sends = check_heads(model, senders)
    recv, comps = _check_receivers(model, receivers, inputs)
    poss = None if positions is None else _check_positions(pairs, positions)
    model.check_length(pairs.width)

    mask = pairs.attention_mask
    clean = record_run(model, pairs.clean_ids, mask)
    corrupt = record_run(model, pairs.corrupted_ids, mask)
    idx = torch.arange(pairs.n)
    m_clean = met(clean.logits, pairs, idx, clean.logits)
    m_corrupt = met(corrupt.logits, pairs, idx, clean.logits)
    base, src = (clean, corrupt) if direction == "noising" else (corrupt, clean)
    base_ids = pairs.ids("clean" if direction == "noising" else "corrupted")
    m_base = m_clean if direction == "noising" else m_corrupt

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
    total = sum(len(c) for c in chunks)
    columns = met.columns(pairs) if met.columns is not None else None
    with progress_callback(options.progress, "path patching", "rows") as report, unembed_only(model, columns):
        done = 0
        for chunk in chunks:
            ps = torch.tensor([i for _, i in chunk])
            heads = [sends[s] for s, _ in chunk]
            logits = _run_chunk(model, base, src, base_ids, mask, heads, ps, recv, comps, mlp, poss, width)
            m = met(logits, pairs, ps, clean.logits[ps]).cpu()
            for r, (la, h) in enumerate(heads):
                raw[la, h, int(ps[r])] = m[r]
            done += len(chunk)
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


def _receiver_columns(
    model: HeadModel, layer: int, heads: list[int], comps: tuple[str, ...]
) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """Per projection module of `layer`, the bool `[width]` mask of the receiver KV heads' key /
    value columns (every fused layout, `record.kv_columns`)."""
    mods = _qkv_modules(model, layer)
    out: dict[int, tuple[torch.nn.Module, list[int]]] = {}
    for c in comps:
        j = "qkv".index(c)
        cols = out.setdefault(id(mods[j]), (mods[j], []))[1]
        cols.extend(kv_columns(model, j, heads).tolist())
    res = []
    for module, cols in out.values():
        w = getattr(module, "out_features", None) or _out_width(model, mods, module)
        colmask = torch.zeros(w, dtype=torch.bool)
        colmask[cols] = True
        res.append((module, colmask))
    return res


def _out_width(model: HeadModel, mods: tuple[torch.nn.Module, ...], module: torch.nn.Module) -> int:
    """The output width of a projection without `out_features` (GPT-2's `Conv1D`: `nf`)."""
    nf = getattr(module, "nf", None)
    if isinstance(nf, int):
        return nf
    q_w, kv_w = model.n_heads * model.d_head, model.n_kv_heads * model.d_head
    return q_w + 2 * kv_w if model.family.fused_qkv else (q_w if module is mods[0] else kv_w)


@contextmanager
def _frozen_attention(module: torch.nn.Module, output: torch.Tensor) -> Iterator[None]:
    """Within the block `module` (an attention module) is not computed: it returns `(output,
    None)`, `output [R, T', D]` (the base run's attention output: every head frozen), as the
    decoder layers of `transformers` unpack it. Only for a module without an instance `forward`
    (the caller checks). Restored on exit."""

    def forward(*args, **kwargs):
        return output, None

    module.__dict__["forward"] = forward  # an instance attribute shadows the class method
    try:
        yield
    finally:
        module.__dict__.pop("forward", None)


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
    edits: list[Edit] = [
        _PatchZ(layer=layer, row_heads=rh, source=src.z[layer][ps, trim:].to(dev), cols=cols)
    ]
    last = L - 1 if recv is None else max(la for la, _ in recv)
    # every head above the sender is frozen; with receivers = the logits (Hugging Face backend)
    # those layers' attention is not run at all: its output is the base run's (`_frozen_attention`)
    skip = (
        recv is None
        and model.backend.kind == "hf"
        and not any("forward" in model.attentions[la].__dict__ for la in range(layer + 1, L))
    )  # not under accelerate's device hooks (device_map), which wrap `forward` on the instance
    if not skip:
        for la in range(layer + 1, min(last + 1, L)):
            edits.append(_PatchZ(layer=la, source=base.z[la][ps, trim:].to(dev)))  # every head frozen
    recorded: dict[tuple[int, int], torch.Tensor] = {}
    targets = [] if recv is None else [la for la in sorted({la for la, _ in recv}) if la > layer]
    residual, past = prefix(layer)
    with ExitStack() as stack:
        if skip:
            for la in range(layer + 1, L):
                source = base.attn_out[la][ps, split:].to(dev)
                stack.enter_context(_frozen_attention(model.attentions[la], source))
        if mlp == "frozen":
            for la in range(layer, min(last + 1, L)):
                source = base.mlp_out[la][ps, split:].to(dev)
                stack.enter_context(_output_patch(model.mlp(la), lambda o, s=source: s.to(o.dtype)))
        plan: dict[int, list[tuple[torch.nn.Module, torch.Tensor]]] = {}
        queries: dict[int, _QueryRecorder] = {}
        kv_comps = tuple(c for c in comps if c != "q")
        for la in targets:
            if "q" in comps:  # the receivers' queries as attention reads them (engine query site)
                queries[la] = _QueryRecorder(layer=la)
                edits.append(queries[la])
            plan[la] = _receiver_columns(model, la, [h for lr, h in recv or () if lr == la], kv_comps)
            for module, _ in plan[la]:
                mid = id(module)

                def keep(mod, args, out, la=la, key=mid):
                    o = out[0] if isinstance(out, tuple) else out
                    recorded[(la, key)] = o.detach().clone()

                stack.callback(module.register_forward_hook(keep).remove)
        if targets:

            def stop(mod, args, out):
                raise _Stop

            stack.callback(model.attentions[targets[-1]].register_forward_hook(stop).remove)
        try:
            out = run_rows(model, ids, m, edits, start=layer, residual=residual, past=past)
        except _Stop:
            out = None
    if recv is None:
        return out.logits[:, -1].float()
    # step 3: the base run with only the receivers' inputs replaced
    start = targets[0]
    residual, past = prefix(start)
    put_q: list[Edit] = []
    for la, rec_q in queries.items():
        rq = torch.zeros(R, H, dtype=torch.bool)
        rq[:, [h for lr, h in recv or () if lr == la]] = True
        put_q.append(_PatchQuery(layer=la, row_heads=rq, source=rec_q.records[0], start=split - trim))
    with ExitStack() as stack:
        for la in targets:
            for module, colmask in plan[la]:
                rec = recorded[(la, id(module))]
                cm = colmask.to(dev)

                def put(mod, args, out, rec=rec, cm=cm):
                    o = out[0] if isinstance(out, tuple) else out
                    new = torch.where(cm, rec.to(o.dtype), o)
                    return (new, *out[1:]) if isinstance(out, tuple) else new

                stack.callback(module.register_forward_hook(put).remove)
        out = run_rows(model, ids, m, put_q, start=start, residual=residual, past=past)
    return out.logits[:, -1].float()
