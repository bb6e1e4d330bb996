"""Batched head-variant evaluation: the one core behind every head scorer.

A *variant* is a set of `(layer, head)` pairs to intervene on (ablate, steer, calibrate).
`evaluate_variants` runs M variants x N prompts as batch rows, `max_rows` per forward, each
row with its own head mask, and returns one score per (variant, prompt). Three kinds of
reuse make a sweep much cheaper than one forward per head (docs/architecture.md, "Batched variants"):

* **Layer prefix.** A head in layer `l` changes nothing below `l`: each batch starts at the
  lowest layer its variants touch, from the clean residual stream entering that layer
  (`heads.engine.prefix.starting_at`).
* **Position prefix** (optional). When an intervention provably leaves the first `s_i`
  positions of prompt `i` unchanged in every layer (PASTA: rows before the span see only
  columns with the same bias, so softmax cancels it), only positions `>= s` are run, with
  the clean keys/values of the earlier positions passed as a KV cache.
* **Unembedding.** Only the last position is unembedded (`logits_to_keep=1`).

Rows are sorted by prompt length and every batch is trimmed to its own longest prompt (left
padding), so short prompts do not pay for long ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from heads._util.progress import Progress
from heads._util.validation import check_int, short_repr
from heads.engine.context import editing
from heads.engine.edits import Edit
from heads.engine.prefix import starting_at
from heads.engine.unembed import column_logits, wanted_columns
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, position_ids
from heads.model.adapter import HeadModel

if TYPE_CHECKING:  # pragma: no cover
    from heads.results.scores import HeadSpec

__all__ = [
    "CleanRun",
    "check_heads",
    "check_max_rows",
    "clean_run",
    "evaluate_variants",
    "first_layer",
    "row_head_masks",
    "run_rows",
]

Head = tuple[int, int]
RowEdits = Callable[[list[Sequence[Head]], torch.Tensor, int], list[Edit]]
"""`(row_variants, prompt_index [R], trim) -> edits` for a batch of R rows whose columns are
the prompt columns `trim:` of the padded batch."""
RowScore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""`(last_logp [R, V] fp32, final_state [R, D] fp32, prompt_index [R]) -> [R, *]` scores."""


@dataclass
class CleanRun:
    """The unedited forward of a batch, kept for reuse by every variant.

    Attributes:
        enc: the encoded prompts (left-padded, `[N, T]`).
        logp: `[N, V]` fp32 log-probs at the last position.
        final: `[N, D]` fp32 final normed state at the last position.
        residuals: `n_layers + 1` tensors `[N, T, D]`; `residuals[l]` enters layer `l`.
        kv: per layer `(keys, values)` `[N, G, T, d]`, or None.
    """

    enc: EncodedPrompts
    logp: torch.Tensor
    final: torch.Tensor
    residuals: tuple[torch.Tensor, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None


@torch.no_grad()
def _forward(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    edits: Sequence[Edit],
    *,
    start: int = 0,
    residual: torch.Tensor | None = None,
    past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    keep_cache: bool = False,
    hidden_states: bool = True,
) -> Any:
    """One forward of `ids` (the positions after `past`, if any) with the full-length `mask`."""
    from transformers import DynamicCache

    dev = model.device
    pos = position_ids(mask)[:, mask.shape[1] - ids.shape[1] :]
    # full-length cache layers on every layer (no `config`): a config makes sliding-window and
    # chunked layers keep only their last window of keys, so a kept cache would miss the columns a
    # later row forward reads and a passed prefix would be cut; the model's own mask still applies
    # each layer's window over the full keys
    cache = None
    if past is not None:
        data = [(k.to(dev), v.to(dev)) for k, v in past]
        cache = DynamicCache(ddp_cache_data=data)
    elif keep_cache:
        cache = DynamicCache()
    # under `unembed_columns` the LM head runs on no position; the wanted columns of the last
    # position's logits come from the final normed state (`heads.engine.unembed`)
    columns = wanted_columns(model)
    hidden_states = hidden_states or columns is not None  # the wanted columns read the final state
    keep: int | torch.Tensor = 1 if columns is None else torch.empty(0, dtype=torch.long, device=dev)
    with editing(model, list(edits)), starting_at(model, start, residual):
        out = model.run(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=pos.to(dev),
            past_key_values=cache,
            use_cache=cache is not None,
            output_hidden_states=hidden_states,
            logits_to_keep=keep,
        )
    if columns is not None:
        out.logits = column_logits(model, out.hidden_states[-1][:, -1:], columns)
    return out


run_rows = _forward
"""Public name of the engine's row forward: `run_rows(model, ids, mask, edits, *, start=0,
residual=None, past=None, keep_cache=False)` runs `ids [R, T']` (the columns after `past`, if
any) with the full-length `mask [R, T]`, the `edits` applied, starting at layer `start` from
`residual [R, T', D]` (layer-prefix reuse) and with `past` (per layer `(keys, values)`
`[R, G, T - T', d]`: position-prefix reuse); only the last position is unembedded (within
`heads.engine.unembed.unembed_columns` only its wanted vocabulary columns, the others NaN).
Returns the model output (`logits [R, 1, V]`, `hidden_states`, `past_key_values` with
`keep_cache`); `hidden_states=False` keeps no per-layer hidden states (unless the column-only
unembedding needs the last: a forward's peak then holds no `L + 1` stream copies)."""


def _last(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1).cpu()
    return logp, out.hidden_states[-1][:, -1].float().cpu()


def clean_run(
    model: HeadModel, enc: EncodedPrompts, edits: Sequence[Edit] = (), *, keep_kv: bool = False
) -> CleanRun:
    """Run `enc` once (with `edits`, usually none) and keep what variants reuse.

    Every scorer on the variant engine (Ships, dataset-level Ships, Sahara, PASTA profiling,
    ACT calibration) starts here, so the prompt length is checked here, before any compute.

    Args:
        keep_kv: also keep every layer's keys/values (needed for position-prefix reuse).

    Raises:
        ValueError: the padded batch is longer than the model's position limit.
    """
    model.check_length(enc.length)
    out = _forward(model, enc.input_ids, enc.attention_mask, edits, keep_cache=keep_kv)
    logp, final = _last(out)
    kv = None
    if keep_kv:
        kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    return CleanRun(enc, logp, final, out.hidden_states, kv)


def first_layer(variant: Sequence[Head]) -> int:
    """The lowest layer a head variant touches: everything below it equals the clean run."""
    return min((layer for layer, _ in variant), default=0)


def _row_chunks(
    variants: Sequence[Sequence[Head]], lengths: Sequence[int], max_rows: int
) -> list[list[tuple[int, int]]]:
    """(variant, prompt) rows grouped by the variant's first layer (ascending), sorted by prompt
    length inside a group, cut into chunks of at most `max_rows` rows."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for v, heads in enumerate(variants):
        groups.setdefault(first_layer(heads), []).extend((v, i) for i in range(len(lengths)))
    chunks = []
    for _, rows in sorted(groups.items()):
        rows.sort(key=lambda r: (lengths[r[1]], r[0], r[1]))
        chunks += [rows[a : a + max_rows] for a in range(0, len(rows), max_rows)]
    return chunks


def row_head_masks(model: HeadModel, rows: Sequence[Sequence[Head]]) -> dict[int, torch.Tensor]:
    """Per layer touched, the `[len(rows), H]` bool mask of the heads of each row's variant.

    Raises:
        ValueError / TypeError: an unknown layer or head.
    """
    masks: dict[int, torch.Tensor] = {}
    for r, variant in enumerate(rows):
        for layer, head in variant:
            model.check_head(layer, head)
            masks.setdefault(layer, torch.zeros(len(rows), model.n_heads, dtype=torch.bool))[r, head] = True
    return dict(sorted(masks.items()))


def check_heads(model: HeadModel, heads: HeadSpec | None, layers: Sequence[int] | None = None) -> list[Head]:
    """`heads` as a checked, duplicate-free list of `(layer, head)` int tuples, sorted; None
    means every head of `layers` (default all layers). Accepts what `HeadSet.parse` accepts
    (pairs, a `{"layer": [heads]}` dict, a list of layers, a `HeadSet`, a JSON file).

    Raises:
        ValueError / TypeError: an empty selection, a malformed item, an unknown layer/head.
    """
    from heads.results.scores import HeadSet

    if heads is None:
        layers = range(model.n_layers) if layers is None else layers
        heads = [(la, h) for la in layers for h in range(model.n_heads)]
    selected = HeadSet.parse(heads, model.n_layers, model.n_heads)  # any form Pasta accepts
    if not len(selected):
        raise HeadsteerValueError("no heads selected")
    return list(selected.heads)


def check_max_rows(max_rows: object) -> int:
    """Raise `ValueError` unless `max_rows` is a positive int."""
    return check_int("max_rows", max_rows, lo=1)


def evaluate_variants(
    model: HeadModel,
    clean: CleanRun,
    variants: Sequence[Sequence[Head]],
    row_edits: RowEdits,
    score: RowScore,
    *,
    unchanged_before: torch.Tensor | None = None,
    max_rows: int = 64,
    progress: Progress | None = None,
) -> torch.Tensor:
    """Score every head variant on every prompt of `clean.enc`; returns `[M, N, *]` (fp32).

    Args:
        clean: `clean_run(model, enc)` (with `keep_kv=True` when `unchanged_before` is given).
        variants: M head sets; an empty set is the unedited model.
        row_edits: builds the edits of one batch from its rows' head sets (see `RowEdits`).
        score: turns one batch's last-position log-probs and final states into scores.
        unchanged_before: optional `[N]` long, padded position before which the caller
            guarantees the intervention changes no row of prompt `i` in any layer. Those
            positions are taken from the clean KV cache instead of recomputed.
        max_rows: batch rows per forward (the memory bound).
        progress: `progress(done, total)` after each batch (`heads._util.progress`), in
            (variant, prompt) rows: `total` is `M * N`. The engine takes only a callable
            or None (the scorers built on it turn `progress=True` into a bar).

    Raises:
        ValueError: bad `max_rows`, or `unchanged_before` given without the clean KV.
    """
    check_max_rows(max_rows)
    enc = clean.enc
    n, width = enc.batch, enc.input_ids.shape[1]
    lengths = enc.attention_mask.sum(-1).tolist()
    if isinstance(variants, (str, bytes)) or not isinstance(variants, Sequence) or not variants:
        raise HeadsteerValueError(
            f"variants must be a non-empty list of head sets, got {short_repr(variants)}"
        )
    variants = [check_heads(model, v) if len(v) else [] for v in variants]
    clean_kv = clean.kv
    if unchanged_before is not None:
        if clean_kv is None:
            raise HeadsteerValueError("position-prefix reuse needs clean_run(..., keep_kv=True)")
        if not isinstance(unchanged_before, torch.Tensor) or tuple(unchanged_before.shape) != (n,):
            raise HeadsteerValueError(
                f"unchanged_before must be a [{n}] tensor of positions, got {short_repr(unchanged_before)}"
            )
        unchanged_before = unchanged_before.long()
    out: torch.Tensor | None = None
    done = 0
    for chunk in _row_chunks(variants, lengths, max_rows):
        vs = torch.tensor([v for v, _ in chunk])
        ps = torch.tensor([i for _, i in chunk])
        start = first_layer(variants[chunk[0][0]])
        trim = width - max(lengths[i] for _, i in chunk)  # columns that are padding in every row
        split = trim
        if unchanged_before is not None:
            # keep at least the last position; never split inside the trimmed padding
            split = max(trim, min(int(unchanged_before[ps].min()), width - 1))
        ids, mask = enc.input_ids[ps, split:], enc.attention_mask[ps, trim:]
        residual = None
        if start:
            residual = clean.residuals[start][ps.to(clean.residuals[start].device), split:]
        past = None
        if split > trim and clean_kv is not None:  # split > trim only with unchanged_before (checked)
            kv_rows = ps.to(clean_kv[0][0].device)
            past = [(k[kv_rows, :, trim:split], v[kv_rows, :, trim:split]) for k, v in clean_kv]
        edits = row_edits([variants[v] for v, _ in chunk], ps, trim)
        result = _forward(model, ids, mask, edits, start=start, residual=residual, past=past)
        rows = score(*_last(result), ps).float()
        if out is None:
            out = torch.full((len(variants), n, *rows.shape[1:]), math.nan)
        out[vs, ps] = rows
        done += len(chunk)
        if progress is not None:
            progress(done, len(variants) * n)
    if out is None:
        raise HeadsteerValueError("no head variants to evaluate")
    return out
