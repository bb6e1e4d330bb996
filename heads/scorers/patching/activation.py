"""Activation patching (causal tracing) at every site of a kind, in batched sweeps.

Denoising (default; Meng et al. 2022, "causal tracing"): run the corrupted prompt, replace the
activation at one site by its value on the clean prompt, measure the metric. Noising: run the
clean prompt and write the corrupted value. Denoising finds components *sufficient* to restore
the behaviour; noising finds the *necessary* ones (Heimersheim & Nanda 2024, Sec. 2).

Sites (`KINDS`), each scored on a grid:

* `"resid_pre"`: the residual stream entering layer l at position t, `[L, T]`;
* `"attn_out"` / `"mlp_out"`: the attention / MLP block output of layer l at t, `[L, T]`;
* `"head_out"`: head h's output z (its slice of the `o_proj` input, TransformerLens' `hook_z`)
  at every position, `[L, H]`; `"head_out_by_pos"`: at one position, `[L, H, T]`;
* `"q"`: head h's query (all positions) as the attention function reads it, after any QK-norm
  and RoPE (the engine's query site), `[L, H]`; `"k"` / `"v"`: KV head g's columns of the key /
  value projection output (before RoPE / QK-norm, which act per position and head), in every
  fused layout, `[L, G]` (under GQA a KV head feeds a group of query heads; results are per KV
  head). Refused by name where a family has no such site (`PatchRequest.check_config`): `k` / `v` on latent
  attention, `k` where the key norm spans all heads, `mlp_out` where the MLP is not one module or
  a residual multiplier other than 1 scales it;
* `"pattern"`: head h's attention pattern (all positions), `[L, H]`.

Speed (all exact): every (site, pair) is one batch row, `options.max_rows` rows per forward;
each batch starts at the patched layer from the base run's residual stream
(`heads.engine.prefix.starting_at`: layer-prefix reuse); by-position kinds also skip the
positions before the patched one, whose keys and values come from the base run's cache
(position-prefix reuse); `head_out_by_pos` at position p of layer l changes only column p of
layer l's output, so that layer runs on column p alone and the later layers start from it
beside the base run's residual of the columns after p; only the last position is unembedded,
and for a metric that reads a few tokens (`logit_diff`) only their columns (`unembed_only`).
A (site, pair) whose source activation equals the base run's bitwise (e.g. at every position
before the first token where the two prompts differ) patches nothing: it gets the base run's
metric without a forward. These reuses read both runs' full caches (`record.cache_bytes`, about
141 residual-stream copies per run on a 30-layer model). A long prompt (both caches over 512 MiB:
every kind and position spec), few sites on a shorter one, or a `max_memory` that does not hold
those caches take the lean path instead
(`heads.scorers.patching.lean`: only the patched sites and the residual entering each patched
layer are kept, each patched forward runs from its layer over every column; 1.08-1.17x a plain
forward's peak for one site at 1k-8k tokens, docs/long-context.md), equal within fp32 rounding.
The patches are engine edits (`head_output`, `residual`, `query`, `probs`, `k` / `v`, `mlp_out`
sites; `attn_out` is written as every head's output z, which o_proj turns into the source
attention output bitwise), and the recorded runs read engine sites (`record.record_run`), so a
sweep runs on every backend, acts only on the calling thread's forwards and leaves the model
bitwise unchanged. Each kind equals a one-hook whole-model loop on every family headsteer
accepts, prompts longer than a sliding window included (tests/heads/patching/
test_family_patching.py).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from heads._util.progress import progress_callback
from heads._util.validation import short_repr
from heads.engine.edits import Edit
from heads.engine.options import SweepOptions
from heads.engine.variants import run_rows
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.scorers.patching.capture import PatchStream, _one_column_output
from heads.scorers.patching.lean import _Site, choose_lean, run_lean
from heads.scorers.patching.metrics import Metric, base_and_source, get_metric
from heads.scorers.patching.pairs import PairBatch, check_pairs_differ, check_vocab
from heads.scorers.patching.record import (
    RunCache,
    _qkv_modules,  # noqa: F401 - importable from here as before
    _qkv_slices,  # noqa: F401 - importable from here as before
    cache_bytes,  # noqa: F401 - importable from here as before
    prefix_cache,  # importable from here as before
    record_run,
)
from heads.scorers.patching.request import BY_POSITION, KINDS, PatchRequest
from heads.scorers.patching.vision import (
    ImagePairBatch,
    check_image_model,
    language_model_inputs,
    replaced_embeddings,
)

__all__ = ["KINDS", "PatchResult", "patch", "run_patch"]
# internal helpers, importable by this module path but not its public API (nor the reference):
# `RunCache`, `record_run` (heads.scorers.patching.record), `unembed_only`, `check_sweep_inputs`,
# `prefix_cache`

# KINDS (the activation-patching site kinds, see the module docstring) and BY_POSITION (the kinds
# scored per position) are defined beside the request (heads.scorers.patching.request)

# the patch edits and the result live beside this module; imported here as before
from heads.results.patching import SCHEMA, SCHEMA_VERSION, PatchResult, _grid_names  # noqa: E402, F401
from heads.scorers.patching.edits import (  # noqa: E402, F401
    _PatchKV,
    _PatchPattern,
    _PatchQuery,
    _PatchResid,
    _PatchZ,
    unembed_only,
)


def _check_positions(pairs: PairBatch, positions: Sequence[int] | str | None) -> list[int]:
    T = pairs.width
    if positions is None:
        return list(range(T))
    if isinstance(positions, str) and positions == "image":
        if not isinstance(pairs, ImagePairBatch):
            raise HeadsteerValueError("positions='image' needs vision pairs (encode_image_pairs)")
        return pairs.image_columns()
    if isinstance(positions, (str, bytes)) or not isinstance(positions, Sequence) or not positions:
        raise HeadsteerValueError(
            f"positions must be a non-empty list of columns, got {short_repr(positions)}"
        )
    out = []
    for p in positions:
        if isinstance(p, bool) or not isinstance(p, int):
            raise HeadsteerTypeError(f"position must be an int, got {short_repr(p)}")
        q = p + T if p < 0 else p
        if not 0 <= q < T:
            raise HeadsteerValueError(
                f"position {short_repr(p)} is out of range for padded length {T} (0..{T - 1})"
            )
        out.append(q)
    return sorted(set(out))


def _sites(model: HeadModel, kind: str, layers: list[int], positions: list[int]) -> tuple[list[_Site], tuple]:
    H, G = model.n_heads, model.n_kv_heads
    if kind in ("resid_pre", "attn_out", "mlp_out"):
        return [_Site(la, -1, p) for la in layers for p in positions], (len(layers), len(positions))
    if kind == "head_out_by_pos":
        return [_Site(la, h, p) for la in layers for h in range(H) for p in positions], (
            len(layers),
            H,
            len(positions),
        )
    n = G if kind in ("k", "v") else H
    return [_Site(la, h, -1) for la in layers for h in range(n)], (len(layers), n)


def check_sweep_inputs(
    model: HeadModel,
    pairs: object,
    options: SweepOptions | None,
    metric: str | Metric | Callable,
    *,
    what: str,
    images: bool = False,
) -> tuple[Metric, SweepOptions]:
    """The checks every patching sweep makes before any forward: `pairs` a `PairBatch` whose ids
    are in the vocabulary, `options` a `SweepOptions` or None, a local backend (Hugging Face,
    TransformerLens or nnsight without `remote=True`), a metric the pairs can feed. Returns
    `(metric, options)` (default `SweepOptions()`). Vision pairs only with `images=True`, on a
    model `vision.check_image_model` accepts.

    Raises:
        HeadsteerTypeError: model not a `HeadModel`, pairs not a `PairBatch`, options not a
            `SweepOptions`.
        HeadsteerValueError: no pairs, ids outside the vocabulary, nnsight with `remote=True` (named with
            `what`), a metric the pairs cannot feed, a pair that cannot show an effect (same
            prompts, or a counterfactual equal to the answer for a metric that reads it:
            `pairs.check_pairs_differ`), vision pairs without `images=True` or on a text-only /
            unsupported model.
    """
    if not isinstance(model, HeadModel):
        raise HeadsteerTypeError(f"model must be a HeadModel (load_model), got {type(model).__name__}")
    if not isinstance(pairs, PairBatch):
        raise HeadsteerTypeError(f"pairs must be a PairBatch (encode_pairs), got {type(pairs).__name__}")
    if options is not None and not isinstance(options, SweepOptions):
        raise HeadsteerTypeError(f"options must be a SweepOptions or None, got {short_repr(options)}")
    if pairs.has_images and images:
        check_image_model(model)  # a text-only model named before the vocabulary check
    check_vocab(pairs, model.d_vocab, images=images)
    if getattr(model.backend, "remote", False):
        raise HeadsteerValueError(
            f"{what} cannot run on nnsight with remote=True: its patches are local hooks and edits "
            "that NDIF does not run; use remote=False"
        )
    met = get_metric(metric)
    met.check(pairs)
    check_pairs_differ(pairs, counterfactual=met.needs_counterfactual)
    return met, options or SweepOptions()


def patch(
    model: HeadModel,
    pairs: PairBatch,
    kind: str = "head_out",
    *,
    metric: str | Metric | Callable = "logit_diff",
    direction: str = "denoising",
    layers: Sequence[int] | None = None,
    positions: Sequence[int] | str | None = None,
    options: SweepOptions | None = None,
    stability: int = 0,
    method: str = "activation",
) -> PatchResult:
    """Activation patching of every site of `kind` (see `KINDS`) on the pairs, or its
    first-order estimate, attribution patching (`method="attribution"`).

    Args:
        model: the `HeadModel` on any local backend (Hugging Face, TransformerLens, nnsight;
            tests/heads/patching/test_backends.py: equal within 1e-5); fp32 recommended.
        pairs: an encoded `PairBatch` (`encode_pairs`), or vision pairs (`ImagePairBatch`,
            `heads.scorers.patching.vision.encode_image_pairs`) on a supported VLM: the
            positions then include the image tokens (labels `"<image k>"`).
        kind: the site kind (default `"head_out"`, all positions).
        metric: `"logit_diff"` (default), `"log_prob"`, `"prob"`, `"kl"`, a `Metric` or a user
            function (`heads.scorers.patching.metrics`), read at the last position.
        direction: `"denoising"` (default: clean values into the corrupted run) or `"noising"`.
        layers: layers to score (default all); the grid's layer axis follows this list
            (`PatchResult.layer_ids`), and `head_scores` / `to_frame` report the real layer numbers.
        positions: padded columns to score for the by-position kinds (default all; negative
            counts from the end), or `"image"` (vision pairs: the image-token columns,
            `ImagePairBatch.image_columns`).
        options: `SweepOptions` (rows per forward, progress, `max_memory`: rows per forward
            within the budget beside the recorded clean and corrupted runs, the lean path's
            sites alone where their full caches do not fit (module docstring), refused before
            any forward when one row does not fit); default `SweepOptions()`. Progress
            counts work in token-layers (each forward's rows x the columns it recomputes x the
            layers it runs), not rows: rows patched at an early layer or position cost more;
            `method="attribution"`: in pairs (a walk per chunk of pairs).
        stability: bootstrap resamples of the pairs for the head ranking's stability (default 0:
            none; e.g. 100): `result.stability`, from the per-pair scores with no extra forward
            (`PatchResult.bootstrap`; the pairs' template ids give the agreement across templates).
        method: `"activation"` (default: one patched forward per site and pair) or
            `"attribution"`: attribution patching (AtP; Nanda 2023, Syed et al. 2023, Kramar et
            al. 2024 Sec. 3.1), `raw` = base metric + `(a_source - a_base) . dM/da` with the
            gradient taken on the base run (the corrupted one when denoising, the clean one
            when noising), for every site at once from one backward of each run, in memory
            linear in the prompt (`heads.scorers.patching.attribution`; kinds `resid_pre`,
            `attn_out`, `mlp_out`, `head_out`, `head_out_by_pos`; text pairs). A choice of
            `patch`, not a function of its own: the same question on the same pairs, sites and
            metric, the same `PatchResult` (compare the two cell by cell).
            `heads.attribution_patching` is AtP of head *ablations* on single prompts.

    Returns:
        a `PatchResult` (raw metric per site and pair, the clean/corrupt metrics, normalised
        scores, intervals, `.head_scores()`, `.to_frame()`, `.save()`).

    Warns:
        UserWarning: a by-position kind (`resid_pre`, `attn_out`, `mlp_out`, `head_out_by_pos`)
            on pairs whose clean prompts differ in length (`mixed_lengths_note`): a padded
            column then holds different tokens in different pairs, and the labels are pair 0's;
            or on pairs of one length whose named positions differ at a patched column
            (`PairBatch.misaligned_names`: IOI's ABBA / BABA templates put IO and S1 there).

    Raises:
        TypeError: pairs not a `PairBatch`, options not a `SweepOptions`.
        ValueError: an unknown kind / direction / metric, a kind the family does not have
            (`PatchRequest.check_config`), layers or positions out of range, positions for a kind that patches
            every position, ids outside the vocabulary, a metric that needs counterfactuals the
            pairs lack, a pair that cannot show an effect (`pairs.check_pairs_differ`: names
            it), nnsight with `remote=True`, vision
            pairs on a text-only or unsupported model (`vision.check_image_model`),
            `positions="image"` without vision pairs — all before any forward.
    """
    request = PatchRequest(
        kind=kind,
        direction=direction,
        metric=metric,
        layers=layers,
        positions=positions,
        stability=stability,
        method=method,
    )
    return run_patch(model, pairs, request, options)


def run_patch(
    model: HeadModel, pairs: PairBatch, request: PatchRequest, options: SweepOptions | None = None
) -> PatchResult:
    """Run a `PatchRequest` on `pairs` (what `patch` does once it has built the request: the
    request's values are checked there, its geometry here against `model`; see `patch` for the
    arguments, the result and the errors)."""
    if not isinstance(request, PatchRequest):
        raise HeadsteerTypeError(f"request must be a PatchRequest, got {type(request).__name__}")
    kind, direction, stability = request.kind, request.direction, request.stability
    met, options = check_sweep_inputs(model, pairs, options, request.metric, what="patching", images=True)
    request.check_config(model)  # layers in range, the kind on this family (check_kind's refusals)
    lays = list(range(model.n_layers)) if request.layers is None else list(request.layers)
    by_pos = kind in BY_POSITION
    poss = _check_positions(pairs, request.positions if by_pos else None)
    model.check_length(pairs.width)
    mixed = (mixed_lengths_note(pairs) or pairs.misaligned_names(poss)) if by_pos else None
    if mixed is not None:
        warnings.warn(f"{kind} patching by position: {mixed}", UserWarning, stacklevel=3)
    if stability:
        from heads.scorers.stability import check_samples

        check_samples(pairs.n, stability)
    sites, shape = _sites(model, kind, lays, poss)
    if request.method == "attribution":  # AtP: the first-order estimate (heads.scorers.patching.attribution)
        from heads.scorers.patching.attribution import attribution_sweep

        raw, m_clean, m_corrupt = attribution_sweep(model, pairs, request, met, lays, poss, options)
        return _result(
            model, pairs, request, met, raw.reshape(*shape, pairs.n), m_clean, m_corrupt, lays, poss, mixed
        )
    # the fast path (both runs' full caches) or the lean one (only the patched sites), within
    # max_memory beside what each keeps (heads.scorers.patching.lean)
    lean, options = choose_lean(model, pairs, kind, sites, lays, len(poss), options)
    mask = pairs.attention_mask
    emb: dict[str, torch.Tensor | None] = {"clean": None, "corrupted": None}
    if isinstance(pairs, ImagePairBatch):  # the vision tower runs once per side
        for side in emb:
            emb[side] = language_model_inputs(model, pairs.ids(side), mask, pairs.image_inputs(side))
    if lean:
        with progress_callback(options.progress, f"patching {kind}", "token-layers") as report:
            raw, m_clean, m_corrupt = run_lean(
                model, pairs, kind, direction, met, sites, lays, poss, options, emb, report
            )
    else:
        raw, m_clean, m_corrupt = _run_full(model, pairs, kind, direction, met, sites, by_pos, options, emb)
    return _result(
        model, pairs, request, met, raw.reshape(*shape, pairs.n), m_clean, m_corrupt, lays, poss, mixed
    )


def _result(
    model: HeadModel,
    pairs: PairBatch,
    request: PatchRequest,
    met: Metric,
    raw: torch.Tensor,
    m_clean: torch.Tensor,
    m_corrupt: torch.Tensor,
    lays: list[int],
    poss: list[int],
    mixed: str | None,
) -> PatchResult:
    """The `PatchResult` of a sweep's `raw [*grid, N]` and metrics (both methods)."""
    kind, by_pos = request.kind, request.kind in BY_POSITION
    result = PatchResult(
        kind,
        request.direction,
        met.name,
        raw,
        m_clean.cpu(),
        m_corrupt.cpu(),
        _grid_names(kind),
        [pairs.position_labels(0, getattr(model, "tokenizer", None))[p] for p in poss] if by_pos else [],
        model.name,
        model.n_kv_heads,
        _params(pairs, lays, poss if by_pos else None, model.n_layers),
    )
    if by_pos:
        result.params["labels_from"] = pairs.labels_from + ("" if mixed is None else f" ({mixed})")
    if request.method != "activation":
        result.params["method"] = request.method
    if request.stability:
        from heads.scorers.stability import pair_templates

        result.stability = result.bootstrap(request.stability, templates=pair_templates(pairs))
    return result


def _run_full(
    model: HeadModel,
    pairs: PairBatch,
    kind: str,
    direction: str,
    met: Metric,
    sites: list[_Site],
    by_pos: bool,
    options: SweepOptions,
    emb: dict[str, torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fast path: both runs' full caches, layer- and position-prefix reuse, one-column
    outputs; `(raw [S, N], clean metric [N], corrupted metric [N])`."""
    mask = pairs.attention_mask
    rec = {"pattern": kind == "pattern", "query": kind == "q", "keys": kind in ("k", "v")}
    clean = record_run(model, pairs.clean_ids, mask, embeds=emb["clean"], **rec)
    corrupt = record_run(model, pairs.corrupted_ids, mask, embeds=emb["corrupted"], **rec)
    base, src, base_ids, m_clean, m_corrupt, m_base = base_and_source(clean, corrupt, pairs, met, direction)

    raw = torch.full((len(sites), pairs.n), math.nan)
    lengths = pairs.lengths.tolist()
    width = pairs.width
    # rows (site, pair), grouped by (layer, first recomputed column), chunks of max_rows
    # a row whose source activation equals the base run's bitwise patches nothing: its metric is
    # the base run's (e.g. every position before the first token where the prompts differ)
    same = _unchanged(model, kind, base, src, sites, pairs.n)
    raw[same] = m_base.cpu().expand(len(sites), -1)[same]
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for s_i, s in enumerate(sites):
        for i in range(pairs.n):
            if not same[s_i, i]:
                groups.setdefault((s.layer, s.pos if by_pos else 0), []).append((s_i, i))
    chunks = []
    for _, rows in sorted(groups.items()):
        rows.sort(key=lambda r: (lengths[r[1]], r[0]))
        chunks += [rows[a : a + options.max_rows] for a in range(0, len(rows), options.max_rows)]
    # each chunk's forward: its first layer, the left padding it trims and the first column it
    # recomputes (the columns before it come from the base run's cache)
    plan = []
    for chunk in chunks:
        trim = width - max(lengths[i] for _, i in chunk)
        split = trim
        if by_pos:
            split = max(trim, min(sites[chunk[0][0]].pos, width - 1))
        plan.append((chunk, sites[chunk[0][0]].layer, trim, split))
    # progress counts work, not rows: a chunk costs its rows x the columns it recomputes x the
    # layers it runs, so an early layer or position weighs up to L x T times a late one (rows
    # of equal cost would make the ETA swing from minutes to an hour and back)
    work = [len(c) * (width - sp) * (model.n_layers - la) for c, la, _, sp in plan]
    total_work = sum(work)
    columns = met.columns(pairs) if met.columns is not None else None
    with (
        progress_callback(options.progress, f"patching {kind}", "token-layers") as report,
        unembed_only(model, columns),
    ):
        done = 0
        for (chunk, layer, trim, split), cost in zip(plan, work, strict=True):
            si = torch.tensor([s for s, _ in chunk])
            ps = torch.tensor([i for _, i in chunk])
            logits = _run_chunk(
                model,
                kind,
                base,
                src,
                base_ids,
                mask,
                [sites[s] for s in si.tolist()],
                ps,
                layer,
                trim,
                split,
            )
            raw[si, ps] = met(logits, pairs, ps, clean.logits[ps]).cpu()
            done += cost
            if report is not None:
                report(done, total_work)
    return raw, m_clean, m_corrupt


def mixed_lengths_note(pairs: PairBatch) -> str | None:
    """None when every pair's clean prompt has one length (one template: a padded column holds
    the same role in every pair); else why a by-position score mixes tokens: the count of pairs
    and lengths, and the advice (one template per call, `pairs.select(...)`)."""
    n_lengths = len(set(pairs.lengths.tolist()))
    if n_lengths <= 1:
        return None
    return (
        f"the {pairs.n} pairs' clean prompts have {n_lengths} different lengths, so a column holds "
        "different tokens in different pairs and its mean mixes them; the position labels are pair "
        "0's tokens. Patch one template per call (e.g. pairs.select([...]) of the pairs of one length)"
    )


def _params(pairs: PairBatch, layers: list[int], positions: list[int] | None, n_layers: int) -> dict:
    """The result's `params`; for vision pairs also `image_positions`: the indices along the
    position axis whose columns are image tokens in pair 0."""
    out: dict[str, Any] = {"layers": layers, "n_layers": n_layers, "positions": positions, "n_pairs": pairs.n}
    if isinstance(pairs, ImagePairBatch):
        cols = set(pairs.image_mask[0].nonzero().flatten().tolist())
        out["image_positions"] = [j for j, p in enumerate(positions or []) if p in cols]
    return out


def _unchanged(
    model: HeadModel, kind: str, base: RunCache, src: RunCache, sites: list[_Site], n: int
) -> torch.Tensor:
    """`[S, N]` bool: site s of pair i reads a source activation bitwise equal to the base
    run's at that site (all its positions / columns), so patching it is the identity."""
    G, d = model.n_kv_heads, model.d_head
    maps: dict[int, torch.Tensor] = {}

    def eq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a == b).cpu()

    def equal_map(la: int) -> torch.Tensor:
        if kind in ("head_out", "head_out_by_pos"):
            m = eq(src.z[la], base.z[la]).all(-1)  # [N, T, H]
            return m if kind == "head_out_by_pos" else m.all(1)
        if kind in ("resid_pre", "attn_out", "mlp_out"):
            a = {"resid_pre": src.residuals, "attn_out": src.attn_out, "mlp_out": src.mlp_out}[kind][la]
            b = {"resid_pre": base.residuals, "attn_out": base.attn_out, "mlp_out": base.mlp_out}[kind][la]
            return eq(a, b).all(-1)  # [N, T]
        if kind == "pattern":
            return eq(cast(list, src.pattern)[la], cast(list, base.pattern)[la]).all(-1).all(-1)  # [N, H]
        if kind == "q":
            return eq(cast(list, src.query)[la], cast(list, base.query)[la]).all(-1).all(1)  # [N, H]
        j = "qkv".index(kind)
        a, b = src.qkv[la][j], base.qkv[la][j]
        return eq(a.reshape(*a.shape[:2], G, d), b.reshape(*b.shape[:2], G, d)).all(-1).all(1)

    out = torch.zeros(len(sites), n, dtype=torch.bool)
    for s_i, s in enumerate(sites):
        if s.layer not in maps:
            maps[s.layer] = equal_map(s.layer)
        m = maps[s.layer]
        if kind == "head_out_by_pos":
            out[s_i] = m[:, s.pos, s.index]
        elif kind in ("resid_pre", "attn_out", "mlp_out"):
            out[s_i] = m[:, s.pos]
        else:
            out[s_i] = m[:, s.index]
    return out


def _run_chunk(
    model: HeadModel,
    kind: str,
    base: RunCache,
    src: RunCache,
    base_ids: torch.Tensor,
    mask: torch.Tensor,
    sites: list[_Site],
    ps: torch.Tensor,
    layer: int,
    trim: int,
    split: int,
) -> torch.Tensor:
    """One forward of a chunk of rows (site, pair) from `layer` and column `split`; `[R, V]` logits."""
    R, H = len(sites), model.n_heads
    dev = model.device
    ids, m = base_ids[ps, split:], mask[ps, trim:]
    residual = base.residuals[layer][ps, split:] if layer else None
    past = None
    if split > trim:
        past = prefix_cache(base, ps, trim, split, layer)
    cols = torch.zeros(R, mask.shape[1] - trim, dtype=torch.bool)
    for r, s in enumerate(sites):
        if s.pos >= trim:
            cols[r, s.pos - trim] = True
    offset = split - trim
    edits: list[Edit] = []
    if base.embeds is not None:  # vision pairs: the base run's image features
        edits.append(replaced_embeddings(model, base.embeds[ps.to(base.embeds.device), split:]))
    if kind in ("head_out", "head_out_by_pos"):
        rh = torch.zeros(R, H, dtype=torch.bool)
        for r, s in enumerate(sites):
            rh[r, s.index] = True
        edits.append(
            _PatchZ(
                layer=layer,
                row_heads=rh,
                source=src.z[layer][ps, trim:].to(dev),
                cols=cols if kind == "head_out_by_pos" else None,
            )
        )
    elif kind == "resid_pre":
        edits.append(_PatchResid(layer=layer, source=src.residuals[layer][ps, trim:].to(dev), cols=cols))
    elif kind == "pattern":
        rh = torch.zeros(R, H, dtype=torch.bool)
        for r, s in enumerate(sites):
            rh[r, s.index] = True
        edits.append(
            _PatchPattern(
                layer=layer, row_heads=rh, source=src.pattern[layer][ps][:, :, trim:, trim:].to(dev)
            )
        )  # type: ignore[index]
    elif kind == "attn_out":
        # the block's attention output is o_proj of every head's output z, one position at a time:
        # writing every head's source z at the columns gives the source attention output there,
        # bitwise, on every family (also where a residual multiplier scales it afterwards)
        rh = torch.ones(R, H, dtype=torch.bool)
        edits.append(_PatchZ(layer=layer, row_heads=rh, source=src.z[layer][ps, trim:].to(dev), cols=cols))
    elif kind == "mlp_out":
        source = src.mlp_out[layer][ps, trim:].to(dev)
        edits.append(PatchStream(kind, layer, source, cols.to(dev)))
    elif kind == "q":  # the query heads as attention reads them (after QK-norm and RoPE)
        rh = torch.zeros(R, H, dtype=torch.bool)
        for r, s in enumerate(sites):
            rh[r, s.index] = True
        edits.append(
            _PatchQuery(layer=layer, row_heads=rh, source=cast(list, src.query)[layer][ps, trim:].to(dev))
        )
    else:  # k / v: one KV head's key / value (before RoPE / QK-norm), all positions
        rg = torch.zeros(R, model.n_kv_heads, dtype=torch.bool)
        for r, s in enumerate(sites):
            rg[r, s.index] = True
        j = "qkv".index(kind)
        source = src.qkv[layer][j][ps, trim:].to(dev)  # [R, T', G * d] head-major
        source = source.reshape(*source.shape[:2], model.n_kv_heads, -1)
        edits.append(_PatchKV(kind, layer, row_heads=rg, source=source))
    one_column = base.embeds is None  # vision pairs: the embeddings hook covers every column
    if (
        one_column
        and kind == "head_out_by_pos"
        and layer < model.n_layers - 1
        and trim <= split < mask.shape[1] - 1
    ):
        # the patch changes only column `split` of layer `layer`'s output (the later columns'
        # keys, values and queries in that layer are the base run's): run that one column
        # through `layer`, then layers `layer + 1 ..` on columns `split ..` from its output
        # beside the base run's residual of the later columns
        entering = _one_column_output(model, ids[:, :1], m[:, : offset + 1], edits, layer, residual, past)
        later = base.residuals[layer + 1][ps, split + 1 :].to(entering.device, entering.dtype)
        residual = torch.cat([entering, later], dim=1)
        out = run_rows(model, ids, m, [], start=layer + 1, residual=residual, past=past)
    else:
        out = run_rows(model, ids, m, edits, start=layer, residual=residual, past=past)
    return out.logits[:, -1].float()
