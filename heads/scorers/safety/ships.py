"""Safety-head attribution: Ships, dataset-level Ships and Sahara (Zhou et al., ICLR 2025).

Spec: docs/methods/safety.md. Source: *On the Role of Attention Heads in Large Language
Model Safety*, arXiv:2410.13708, §3 (Ships, Eq. 4-5), §4 (Sahara), App. D (prompt format).

All scorers evaluate many head *variants* (sets of ablated heads) in one forward pass:
M variants x N prompts are packed into batch rows in memory-bounded chunks, each row
carrying its own per-layer head mask (`row_heads`). Ablations:

* `"ua"` (default): the head's query slice times eps (`QueryScale`), so its pattern
  tends to uniform over the causal prefix; `exact=True` uses eps = 0 (exactly uniform).
* `"sc"`: the head's output (o_proj-input slice) times eps (`HeadScale`); eps = 0 is
  zero ablation. Under GQA both act on one query head, never on the shared K/V.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch

from heads._util.progress import offset_progress, progress_callback
from heads._util.validation import check_int
from heads.engine.executors import merge_tables
from heads.engine.options import SWEEP_KEYS, SweepOptions, sweep_options
from heads.engine.variants import check_heads, clean_run, evaluate_variants
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.results.safety import SaharaResult as SaharaResult  # defined there; imported here as before
from heads.results.scores import HeadScores, HeadSpec
from heads.scorers.safety.common import (
    TEMPLATE,
    Ablation,
    Head,
    ShipsResult,
    ablate_rows,
    ablation_edits,
    check_scoring,
    encode_dataset,
    exact_ships,
    fill_template,
    final_state,
    head_pairs,
    head_table,
    merge_scores,
    run_sharded,
    shard_heads,
)
from heads.scorers.safety.request import DatasetShipsRequest, SaharaRequest, ShipsRequest
from heads.scorers.stability import attach, check_samples

__all__ = [
    "TEMPLATE",
    "fill_template",
    "SaharaResult",
    "ShipsResult",
    "ablation_edits",
    "dataset_ships",
    "merge_scores",
    "principal_angles",
    "run_dataset_ships",
    "run_sahara",
    "run_ships",
    "sahara",
    "ships",
]


def ships(
    model: HeadModel,
    prompts: str | Sequence[str],
    *,
    heads: HeadSpec | None = None,
    ablation: Ablation = "ua",
    eps: float = 1e-5,
    exact: bool = False,
    template: str | None = TEMPLATE,
    method: Literal["exact", "attribution"] = "exact",
    confirm: int = 0,
    controls: int | None = None,
    options: SweepOptions | None = None,
    stability: int = 0,
    **deprecated: Any,
) -> ShipsResult:
    """Ships: KL(p_base || p_ablated) of the next-token distribution at the last prompt position.

    Builds the `ShipsRequest` (its checks; a list of layers in `heads` is read with the model's
    head count first) and runs it (`run_ships`, as `heads.run` does).

    Args:
        model: the model; prompts are plain strings put into `template` (no chat template).
        heads: heads to score (a `HeadSpec`; default all `L x H`), each ablated alone.
        ablation: `"ua"` (query x eps, default) or `"sc"` (output x eps).
        eps: the ablation scale (default 1e-5); `exact=True` uses 0.
        method: `"exact"` (default) or `"attribution"`: estimate every head in one pass and
            rerun only the top `confirm` plus `controls` random heads (default None: 10, or
            every head left when fewer; seeded by `options.seed`) exactly; see
            `heads.scorers.safety.attribution.confirm_ships` (not with a shard; an executor is
            not used). Read the result's `scores` (the
            confirmed ranking) first: its `estimate` is a ranking to confirm, not a result.
        options: how the sweep runs (`heads.SweepOptions`: `max_rows` batch rows per forward,
            variants x prompts chunked; `shard=(i, n)` scores only every n-th head from i,
            merge shards with `merge_scores`; `executor` `"local"`, `"ray"` or an `Executor`
            splits the sweep into its shards, runs them (Ray: as tasks, each worker loading the
            model once) and merges them; `progress` a tqdm bar by default, counted in
            (head, prompt) rows: `total` is `len(heads) * N`; `seed`; `max_memory` a budget
            per device: fewer rows per forward where the plan needs it, refused before any
            forward when one row does not fit). Default `SweepOptions()`.
        stability: bootstrap resamples of the prompts (default 0: none; e.g. 100) for the
            ranking's stability, `result.scores.stability` (from `per_prompt`, no extra forward).
        **deprecated: `max_rows=`, `shard=`, `progress=`, `seed=`, `executor=` as keywords
            (0.1 style): still accepted for this release, with a `DeprecationWarning`.

    Returns:
        ShipsResult: per-prompt KL `[N, L, H]` (natural log, fp32 from log-softmax) and
        HeadScores of the mean over prompts (method `"ships"`).

    Raises:
        HeadsteerValueError: empty prompts, unknown heads, bad eps/ablation/method/confirm,
            `controls` beyond the heads left after the confirmed ones, bad options.
    """
    opts = sweep_options(options, deprecated, "ships", takes=_SHIPS_TAKES)
    request = ShipsRequest(
        heads=head_pairs(model, heads),
        ablation=ablation,
        eps=eps,
        exact=exact,
        template=template,
        method=method,
        confirm=confirm,
        controls=controls,
        stability=stability,
    )
    return run_ships(model, prompts, request, opts)


_SHIPS_TAKES = (*SWEEP_KEYS, "max_memory")


def run_ships(
    model: HeadModel,
    prompts: str | Sequence[str],
    request: ShipsRequest,
    options: SweepOptions | None = None,
) -> ShipsResult:
    """Run a `ShipsRequest` on `prompts` (what `ships` does once it has built the request: its
    values are checked there, its heads here against `model`; see `ships` for the arguments, the
    options, the result and the errors)."""
    if not isinstance(request, ShipsRequest):
        raise HeadsteerTypeError(f"request must be a ShipsRequest, got {type(request).__name__}")
    opts = sweep_options(options, {}, "ships", takes=_SHIPS_TAKES)
    request.check_config(model)
    if request.stability:
        check_samples(1 if isinstance(prompts, str) else len(prompts), request.stability, "prompts")
        res = run_ships(model, prompts, dataclasses.replace(request, stability=0), opts)
        attach(res.scores, res.per_prompt, request.stability)
        return res
    if request.method == "attribution":  # one-pass estimate + exact confirmation (attribution.py)
        from heads.scorers.safety.attribution import confirmed_ships

        if opts.shard is not None:
            raise HeadsteerValueError("method='attribution' does not take a shard")
        chosen = check_heads(model, request.heads)
        return confirmed_ships(
            model,
            prompts,
            chosen,
            request.confirm,
            request.controls,
            request.ablation,
            request.eps,
            request.exact,
            request.template,
            4,  # kl_tokens: attribute's default
            opts.replace(executor=None),
        )
    eps, chosen = check_scoring(model, request.eps, request.exact, request.heads)
    ablation, template = request.ablation, request.template
    if opts.executor is not None:
        kw = dict(prompts=prompts, heads=chosen, ablation=ablation, eps=eps, template=template)
        parts = run_sharded(ships, model, opts, kw)
        per_prompt = merge_tables([p.per_prompt for p in parts])
        return ShipsResult(per_prompt, merge_scores([p.scores for p in parts]))
    return exact_ships(model, prompts, chosen, ablation, eps, template, opts)


def principal_angles(a: torch.Tensor, b: torch.Tensor, r_main: int = 1) -> torch.Tensor:
    """Sum of the first `r_main` principal angles (radians) between the spans of the top-`r_main`
    left singular vectors of `a` and `b` (`[N, D]` each, not centred). Sign-invariant.

    Raises:
        HeadsteerValueError: `a` and `b` not 2-D of one shape, `r_main` not an int in
            1..min(N, D) (the singular vectors there are; a larger one was cut silently, a
            negative one dropped the last vectors).
    """
    if a.ndim != 2 or a.shape != b.shape:
        raise HeadsteerValueError(
            "principal_angles takes two [N, D] tensors of one shape, "
            f"got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    check_int("r_main", r_main, lo=1, hi=min(a.shape))
    ua = torch.linalg.svd(a.double(), full_matrices=False).U[:, :r_main]
    ub = torch.linalg.svd(b.double(), full_matrices=False).U[:, :r_main]
    cos = torch.linalg.svdvals(ua.T @ ub).clamp(-1.0, 1.0)
    return torch.arccos(cos).sum()


def _angles(base: torch.Tensor, states: torch.Tensor, r_main: int) -> torch.Tensor:
    return torch.stack([principal_angles(base, s, r_main) for s in states]).float()


def dataset_ships(
    model: HeadModel,
    prompts: Sequence[str],
    *,
    heads: HeadSpec | None = None,
    ablation: Ablation = "ua",
    eps: float = 1e-5,
    exact: bool = False,
    r_main: int = 1,
    degrees: bool = False,
    template: str | None = TEMPLATE,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> HeadScores:
    """Dataset-level Ships: principal angle between base and ablated final-state matrices.
    Builds the `DatasetShipsRequest` (its checks) and runs it (`run_dataset_ships`).

    M is the `[N, D]` matrix of last-token states after the final norm (fp32, not centred);
    the score of a head is the sum of the first `r_main` principal angles between the top
    left singular vectors of M_base and M_ablated (docs/methods/safety.md). Radians unless
    `degrees=True` (ranking is the same). `options` (`heads.SweepOptions`: `max_rows`,
    `shard`, `executor`, `progress`) as in `ships`; the bar counts (head, prompt) rows.
    The 0.1 keywords (`max_rows=`, `shard=`, ...) still work, with a `DeprecationWarning`.

    Raises:
        HeadsteerValueError: as `ships`, and `r_main` outside 1..N.
        HeadsteerTypeError: a non-bool `degrees`.
    """
    opts = sweep_options(options, deprecated, "dataset_ships", takes=_DATASET_TAKES)
    request = DatasetShipsRequest(
        heads=head_pairs(model, heads),
        ablation=ablation,
        eps=eps,
        exact=exact,
        r_main=r_main,
        degrees=degrees,
        template=template,
    )
    return run_dataset_ships(model, prompts, request, opts)


_DATASET_TAKES = ("max_rows", "shard", "executor", "progress", "max_memory")


def run_dataset_ships(
    model: HeadModel,
    prompts: Sequence[str],
    request: DatasetShipsRequest,
    options: SweepOptions | None = None,
) -> HeadScores:
    """Run a `DatasetShipsRequest` on `prompts` (what `dataset_ships` does once it has built the
    request: its values are checked there, its heads here against `model` and `r_main` against
    the prompts; see `dataset_ships` for the rest)."""
    if not isinstance(request, DatasetShipsRequest):
        raise HeadsteerTypeError(f"request must be a DatasetShipsRequest, got {type(request).__name__}")
    opts = sweep_options(options, {}, "dataset_ships", takes=_DATASET_TAKES)
    request.check_config(model)
    eps, heads = check_scoring(model, request.eps, request.exact, request.heads)
    ablation, r_main, degrees, template = request.ablation, request.r_main, request.degrees, request.template
    if opts.executor is not None:
        kw = dict(prompts=prompts, heads=heads, ablation=ablation, eps=eps, r_main=r_main, degrees=degrees)
        kw.update(template=template)
        return merge_scores(run_sharded(dataset_ships, model, opts, kw))
    heads = shard_heads(heads, opts.shard)
    enc = encode_dataset(model, prompts, template, r_main)
    opts = opts.within(model, enc.length, whole=enc.batch)  # max_memory (the clean run: every prompt)
    with progress_callback(opts.progress, "dataset ships", "rows") as report:
        clean = clean_run(model, enc)
        states = evaluate_variants(
            model,
            clean,
            [[h] for h in heads],
            ablate_rows(model, ablation, eps),
            final_state,
            max_rows=opts.max_rows,
            progress=report,
        )
    ang = _angles(clean.final, states, r_main)
    if degrees:
        ang = torch.rad2deg(ang)
    out = head_table(model, heads, ang)
    params = {
        "ablation": ablation,
        "eps": eps,
        "r_main": r_main,
        "degrees": degrees,
        "template": template,
        "n_prompts": enc.batch,
    }
    return HeadScores(out, "dataset_ships", params, model.name, model.n_kv_heads)


def sahara(
    model: HeadModel,
    prompts: Sequence[str],
    *,
    steps: int = 3,
    heads: HeadSpec | None = None,
    ablation: Ablation = "ua",
    eps: float = 1e-5,
    exact: bool = False,
    r_main: int = 1,
    template: str | None = TEMPLATE,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> SaharaResult:
    """Sahara: greedy head-group search by dataset-level Ships (docs/methods/safety.md).
    Builds the `SaharaRequest` (its checks) and runs it (`run_sahara`, as `heads.run` does).

    At each of `steps` steps, every head not yet chosen is scored by the angle between the
    base model and the model with the chosen group plus that head ablated (always against
    the unablated base); the argmax joins the group. Ties go to the lowest (layer, head).
    No threshold and no early stop. `options` (`heads.SweepOptions`) gives `max_rows` and
    `progress` (default a tqdm bar), which counts (candidate group, prompt) rows over all
    steps: `total` is `N * (M + (M - 1) + ... + (M - steps + 1))` for M candidate heads; the
    greedy steps depend on each other, so Sahara takes no shard or executor. The 0.1 keywords
    (`max_rows=`, `progress=`) still work, with a `DeprecationWarning`.

    Raises:
        HeadsteerValueError: `steps` < 1 or more steps than candidate heads, a shard or
            executor, and as `dataset_ships`.
    """
    opts = sweep_options(options, deprecated, "sahara", takes=_SAHARA_TAKES)
    request = SaharaRequest(
        steps=steps,
        heads=head_pairs(model, heads),
        ablation=ablation,
        eps=eps,
        exact=exact,
        r_main=r_main,
        template=template,
    )
    return run_sahara(model, prompts, request, opts)


_SAHARA_TAKES = ("max_rows", "progress", "max_memory")


def run_sahara(
    model: HeadModel,
    prompts: Sequence[str],
    request: SaharaRequest,
    options: SweepOptions | None = None,
) -> SaharaResult:
    """Run a `SaharaRequest` on `prompts` (what `sahara` does once it has built the request: its
    values are checked there, its heads and steps here against `model`, `r_main` against the
    prompts; see `sahara` for the rest)."""
    if not isinstance(request, SaharaRequest):
        raise HeadsteerTypeError(f"request must be a SaharaRequest, got {type(request).__name__}")
    opts = sweep_options(options, {}, "sahara", takes=_SAHARA_TAKES)
    request.check_config(model)  # steps at most the heads
    eps, heads = check_scoring(model, request.eps, request.exact, request.heads)
    steps, ablation, r_main = request.steps, request.ablation, request.r_main
    enc = encode_dataset(model, prompts, request.template, r_main)
    opts = opts.within(model, enc.length, whole=enc.batch)  # max_memory (the clean run: every prompt)
    with progress_callback(opts.progress, "sahara", "rows") as report:
        clean = clean_run(model, enc)
        chosen: list[Head] = []
        tables = []
        total = enc.batch * sum(len(heads) - i for i in range(steps))
        for step in range(steps):
            cands = [h for h in heads if h not in chosen]
            states = evaluate_variants(
                model,
                clean,
                [[*chosen, h] for h in cands],
                ablate_rows(model, ablation, eps),
                final_state,
                max_rows=opts.max_rows,
                progress=offset_progress(report, enc.batch * sum(len(heads) - i for i in range(step)), total),
            )
            ang = _angles(clean.final, states, r_main)
            table = head_table(model, cands, ang)
            params = {
                "step": step + 1,
                "group": [list(h) for h in chosen],
                "ablation": ablation,
                "eps": eps,
                "r_main": r_main,
            }
            scores = HeadScores(table, "sahara_step", params, model.name, model.n_kv_heads)
            tables.append(scores)
            chosen.append(scores.ranked(1)[0])
    return SaharaResult(chosen, tables)
