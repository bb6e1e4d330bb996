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

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from heads._util.progress import ProgressArg, offset_progress, progress_callback
from heads.engine.edits import Edit, HeadScale, QueryScale
from heads.engine.executors import Executor, merge_tables, run_shards
from heads.engine.variants import (
    RowEdits,
    RowScore,
    check_heads,
    check_max_rows,
    clean_run,
    evaluate_variants,
    row_head_masks,
)
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, encode_prompts, normalize_prompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores, HeadSpec
from heads.results.views import html_view, top_heads_text

__all__ = [
    "TEMPLATE",
    "fill_template",
    "SaharaResult",
    "ShipsResult",
    "ablation_edits",
    "dataset_ships",
    "merge_scores",
    "principal_angles",
    "sahara",
    "ships",
]

TEMPLATE = "Query: {query}\nAnswer:"
"""The one prompt template (no chat template, no system prompt: docs/methods/safety.md)."""

Ablation = Literal["ua", "sc"]
Head = tuple[int, int]


def ablation_edits(
    model: HeadModel,
    variants: Sequence[Sequence[Head]],
    n_prompts: int,
    *,
    ablation: Ablation = "ua",
    eps: float = 1e-5,
) -> list[Edit]:
    """Edits that ablate head set `variants[v]` in batch rows `v * n_prompts ... (v + 1) * n_prompts - 1`.

    Raises:
        ValueError: unknown ablation, unknown layer/head, or a non-finite eps.
    """
    rows = [heads for heads in variants for _ in range(n_prompts)]
    return row_ablation_edits(model, rows, ablation=ablation, eps=eps)


def row_ablation_edits(
    model: HeadModel,
    row_variants: Sequence[Sequence[Head]],
    *,
    ablation: Ablation = "ua",
    eps: float = 1e-5,
) -> list[Edit]:
    """Edits that ablate head set `row_variants[r]` in batch row `r` (one edit per layer touched).

    Raises:
        ValueError: unknown ablation, unknown layer/head, or a non-finite eps.
    """
    if ablation not in ("ua", "sc"):
        raise HeadsteerValueError(f"unknown ablation {ablation!r}: use 'ua' or 'sc'")
    kind = QueryScale if ablation == "ua" else HeadScale
    masks = row_head_masks(model, row_variants)
    return [kind(layer=layer, row_heads=m, factor=eps) for layer, m in masks.items()]


def fill_template(template: str | None, queries: list[str]) -> list[str]:
    """Put each query into `template`: every `{query}` is replaced, nothing else is read.

    The one rule for scoring and for generation (ASR): other braces (`{oops}`, JSON)
    stay as they are (no `str.format`). `None` leaves the queries unchanged.

    Raises:
        ValueError: `template` is not None and not a string containing `{query}`.
    """
    if template is None:
        return list(queries)
    if not isinstance(template, str) or "{query}" not in template:
        raise HeadsteerValueError(
            f"template must be None or a string containing '{{query}}', got {template!r}"
        )
    return [template.replace("{query}", q) for q in queries]


def _encode(model: HeadModel, prompts: str | Sequence[str], template: str | None) -> EncodedPrompts:
    items, _ = normalize_prompts(prompts)
    queries = [p for p in items if isinstance(p, str)]
    if len(queries) != len(items):
        raise HeadsteerTypeError("safety-head scoring takes plain string prompts")
    texts = fill_template(template, queries)
    return encode_prompts(model.tokenizer, texts, chat=False, markup=False)


def _ablate(model: HeadModel, ablation: Ablation, eps: float) -> RowEdits:
    def row_edits(rows: list[Sequence[Head]], ps: torch.Tensor, trim: int) -> list[Edit]:
        return row_ablation_edits(model, rows, ablation=ablation, eps=eps)

    return row_edits


def _kl_from(base_logp: torch.Tensor) -> RowScore:
    """KL(base || variant) per row, from fp32 log-softmax."""

    def score(logp: torch.Tensor, final: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
        base = base_logp[ps]
        # KL >= 0; batch-dependent float rounding can leave about -1e-9, clamped to 0
        return (base.exp() * (base - logp)).sum(-1).clamp(min=0.0)

    return score


def _final_state(logp: torch.Tensor, final: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    return final


def _shard(heads: list[Head], shard: tuple[int, int] | None) -> list[Head]:
    """Heads of shard i of n (every n-th head from i), for splitting a sweep across machines."""
    if shard is None:
        return heads
    if (
        not isinstance(shard, tuple)
        or len(shard) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in shard)
        or not 0 <= shard[0] < shard[1]
    ):
        raise HeadsteerValueError(f"shard must be (i, n) with 0 <= i < n, got {shard!r}")
    return heads[shard[0] :: shard[1]]


def _encode_dataset(
    model: HeadModel, prompts: Sequence[str], template: str | None, r_main: object
) -> EncodedPrompts:
    """Encode prompts for a dataset-level score: at least 2 prompts (one final state spans a
    1-dimensional space whose angle to any other is 0) and `r_main` in 1..N."""
    enc = _encode(model, prompts, template)
    if enc.batch < 2:
        raise HeadsteerValueError("dataset-level Ships / Sahara need at least 2 prompts")
    if (
        isinstance(r_main, bool)
        or not isinstance(r_main, numbers.Integral)
        or not 1 <= int(r_main) <= enc.batch
    ):
        raise HeadsteerValueError(f"r_main must be an int in 1..{enc.batch}, got {r_main!r}")
    return enc


def _sharded(target: str, model: HeadModel, executor, shard, kwargs: dict) -> list:
    """Run `target` over the executor's shards (each with `shard=(i, n)`); the parts in order."""
    if shard is not None:
        raise HeadsteerValueError("pass either shard= or executor=, not both")
    if isinstance(prompts := kwargs["prompts"], str):
        kwargs["prompts"] = [prompts]
    kwargs["prompts"] = list(kwargs["prompts"])
    n_heads = len(kwargs["heads"])
    return run_shards(target, model, executor, lambda i, n: dict(kwargs, shard=(i, n)), max_shards=n_heads)


def merge_scores(parts: Sequence[HeadScores]) -> HeadScores:
    """Merge the HeadScores of shards (NaN = not scored in that shard).

    Raises:
        ValueError: no parts, different shapes or methods, or a head scored twice.
    """
    if not parts:
        raise HeadsteerValueError("no shards to merge")
    first = parts[0]
    out = torch.full_like(first.scores, math.nan)
    for p in parts:
        if p.scores.shape != first.scores.shape or p.method != first.method:
            raise HeadsteerValueError("shards differ in shape or method")
        if p.params != first.params or p.model != first.model:
            raise HeadsteerValueError(
                f"shards were scored with different models or parameters: {p.params} vs {first.params}"
            )
        seen = ~torch.isnan(p.scores)
        if (seen & ~torch.isnan(out)).any():
            raise HeadsteerValueError("a head is scored in two shards")
        out[seen] = p.scores[seen]
    return HeadScores(out, first.method, dict(first.params), first.model, first.n_kv_heads, first.seed)


def _head_table(model: HeadModel, heads: Sequence[Head], values: torch.Tensor) -> torch.Tensor:
    """`[L, H, *rest]` table with `values[..., k]` at `heads[k]`, NaN elsewhere.

    `values` is `[*rest, len(heads)]`.
    """
    out = torch.full((model.n_layers, model.n_heads, *values.shape[:-1]), math.nan)
    for k, (layer, head) in enumerate(heads):
        out[layer, head] = values[..., k]
    return out


def _check(
    model: HeadModel, eps: float, exact: bool, max_rows: int, heads: HeadSpec | None
) -> tuple[float, list[Head]]:
    if model.tokenizer is None:
        raise HeadsteerValueError("safety-head scoring needs a HeadModel with a tokenizer")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps <= 1:
        raise HeadsteerValueError(f"eps must be a number in [0, 1], got {eps!r}")
    if not isinstance(exact, bool):
        raise HeadsteerTypeError(f"exact must be a bool, got {exact!r}")
    check_max_rows(max_rows)
    return (0.0 if exact else float(eps)), check_heads(model, heads)


@dataclass
class ShipsResult:
    """Per-prompt Ships `[N, L, H]` (nats; NaN = head not scored) and their mean.

    `estimate` is set by `method="attribution"`: the attribution estimate of every head
    (`heads.scorers.safety.attribution`), kept apart from the exact `scores`.
    """

    per_prompt: torch.Tensor
    scores: HeadScores
    estimate: HeadScores | None = None

    def top(self, prompt: int, k: int = 10) -> list[Head]:
        """The `k` heads with the largest Ships on prompt `prompt` (the paper keeps 10)."""
        s = HeadScores(self.per_prompt[prompt], "ships")
        return s.ranked(k)

    def __repr__(self) -> str:
        n, n_layers, n_heads = self.per_prompt.shape
        scored = int((~torch.isnan(self.scores.scores)).sum())
        return (
            f"ShipsResult({self.scores.model}: {n} prompts x {scored} of {n_layers * n_heads} heads; "
            f"mean KL (nats) top {top_heads_text(self.scores)})"
        )

    def _repr_html_(self) -> str:
        rows = [(f"L{la}.H{h}", self.scores.scores[la, h].item()) for la, h in self.scores.ranked(10)]
        return html_view(repr(self), rows, ("head", "mean KL (nats)")) + self.scores._repr_html_()


def ships(
    model: HeadModel,
    prompts: str | Sequence[str],
    *,
    heads: HeadSpec | None = None,
    ablation: Ablation = "ua",
    eps: float = 1e-5,
    exact: bool = False,
    template: str | None = TEMPLATE,
    max_rows: int = 64,
    shard: tuple[int, int] | None = None,
    progress: ProgressArg = True,
    method: Literal["exact", "attribution"] = "exact",
    confirm: int = 0,
    controls: int = 10,
    seed: int = 0,
    executor: str | Executor | None = None,
) -> ShipsResult:
    """Ships: KL(p_base || p_ablated) of the next-token distribution at the last prompt position.

    Args:
        model: the model; prompts are plain strings put into `template` (no chat template).
        heads: heads to score (a `HeadSpec`; default all `L x H`), each ablated alone.
        ablation: `"ua"` (query x eps, default) or `"sc"` (output x eps).
        eps: the ablation scale (default 1e-5); `exact=True` uses 0.
        max_rows: batch rows per forward (memory bound); variants x prompts are chunked.
        shard: `(i, n)` scores only every n-th head from i; merge shards with `merge_scores`.
        progress: True (default: a tqdm bar), False / None (off) or `progress(done, total)`
            after each batch (`heads._util.progress`), in (head, prompt) rows: `total` is
            `len(heads) * N`.
        method: `"exact"` (default) or `"attribution"`: estimate every head in one pass and
            rerun only the top `confirm` plus `controls` random heads (seeded by `seed`)
            exactly; see `heads.scorers.safety.attribution.confirm_ships` (not with `shard`).
        executor: `"local"`, `"ray"` or a `heads.engine.executors.Executor`: split the sweep into the
            executor's shards, run them (Ray: as tasks, each worker loading the model once)
            and merge them; default None runs here without sharding.

    Returns:
        ShipsResult: per-prompt KL `[N, L, H]` (natural log, fp32 from log-softmax) and
        HeadScores of the mean over prompts (method `"ships"`).

    Raises:
        ValueError: empty prompts, unknown heads, bad eps/ablation/max_rows/method/confirm.
    """
    if method == "attribution":  # one-pass estimate + exact confirmation (heads/attribution.py)
        from heads.scorers.safety.attribution import confirm_ships

        if shard is not None:
            raise HeadsteerValueError("method='attribution' does not take a shard")
        return confirm_ships(
            model,
            prompts,
            confirm=confirm,
            controls=controls,
            seed=seed,
            heads=heads,
            ablation=ablation,
            eps=eps,
            exact=exact,
            template=template,
            max_rows=max_rows,
            progress=progress,
        )
    if method != "exact" or confirm != 0:
        why = f"confirm={confirm!r} needs 'attribution'"
        raise HeadsteerValueError(f"method must be 'exact' or 'attribution' ({why}), got {method!r}")
    eps, heads = _check(model, eps, exact, max_rows, heads)
    if executor is not None:
        kw = dict(
            prompts=prompts, heads=heads, ablation=ablation, eps=eps, template=template, max_rows=max_rows
        )
        kw["progress"] = False  # workers draw no bars
        parts = _sharded("heads.scorers.safety.ships:ships", model, executor, shard, kw)
        per_prompt = merge_tables([p.per_prompt for p in parts])
        return ShipsResult(per_prompt, merge_scores([p.scores for p in parts]))
    heads = _shard(heads, shard)
    enc = _encode(model, prompts, template)
    with progress_callback(progress, "ships", "rows") as report:
        clean = clean_run(model, enc)
        kl = evaluate_variants(
            model,
            clean,
            [[h] for h in heads],
            _ablate(model, ablation, eps),
            _kl_from(clean.logp),
            max_rows=max_rows,
            progress=report,
        )  # [M, N]
    per_prompt = _head_table(model, heads, kl.T).permute(2, 0, 1)  # [N, L, H]
    params = {"ablation": ablation, "eps": eps, "template": template, "n_prompts": enc.batch}
    mean = HeadScores(per_prompt.mean(0), "ships", params, model.name, model.n_kv_heads)
    return ShipsResult(per_prompt, mean)


def principal_angles(a: torch.Tensor, b: torch.Tensor, r_main: int = 1) -> torch.Tensor:
    """Sum of the first `r_main` principal angles (radians) between the spans of the top-`r_main`
    left singular vectors of `a` and `b` (`[N, D]` each, not centred). Sign-invariant.
    """
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
    max_rows: int = 64,
    shard: tuple[int, int] | None = None,
    progress: ProgressArg = True,
    executor: str | Executor | None = None,
) -> HeadScores:
    """Dataset-level Ships: principal angle between base and ablated final-state matrices.

    M is the `[N, D]` matrix of last-token states after the final norm (fp32, not centred);
    the score of a head is the sum of the first `r_main` principal angles between the top
    left singular vectors of M_base and M_ablated (docs/methods/safety.md). Radians unless
    `degrees=True` (ranking is the same). `shard` and `executor` as in `ships`. `progress`
    (default True: a tqdm bar; False off; or `progress(done, total)`) counts (head, prompt)
    rows as in `ships`.

    Raises:
        ValueError: as `ships`, and `r_main` outside 1..N.
    """
    eps, heads = _check(model, eps, exact, max_rows, heads)
    if executor is not None:
        kw = dict(prompts=prompts, heads=heads, ablation=ablation, eps=eps, r_main=r_main, degrees=degrees)
        kw.update(template=template, max_rows=max_rows, progress=False)
        return merge_scores(_sharded("heads.scorers.safety.ships:dataset_ships", model, executor, shard, kw))
    heads = _shard(heads, shard)
    enc = _encode_dataset(model, prompts, template, r_main)
    if not isinstance(degrees, bool):
        raise HeadsteerTypeError(f"degrees must be a bool, got {degrees!r}")
    with progress_callback(progress, "dataset ships", "rows") as report:
        clean = clean_run(model, enc)
        states = evaluate_variants(
            model,
            clean,
            [[h] for h in heads],
            _ablate(model, ablation, eps),
            _final_state,
            max_rows=max_rows,
            progress=report,
        )
    ang = _angles(clean.final, states, r_main)
    if degrees:
        ang = torch.rad2deg(ang)
    out = _head_table(model, heads, ang)
    params = {
        "ablation": ablation,
        "eps": eps,
        "r_main": r_main,
        "degrees": degrees,
        "template": template,
        "n_prompts": enc.batch,
    }
    return HeadScores(out, "dataset_ships", params, model.name, model.n_kv_heads)


@dataclass
class SaharaResult:
    """Sahara's chosen heads in order, and every step's full score table."""

    heads: list[Head]
    steps: list[HeadScores] = field(default_factory=list)

    def _rows(self) -> list[tuple[int, str, float]]:
        """(step, head added, its score at that step) per step."""
        return [
            (i + 1, f"L{la}.H{h}", table.scores[la, h].item())
            for i, ((la, h), table) in enumerate(zip(self.heads, self.steps, strict=False))
        ]

    def __repr__(self) -> str:
        chosen = ", ".join(f"{head} ({score:.3g})" for _, head, score in self._rows())
        return f"SaharaResult({len(self.heads)} steps; heads added (angle): {chosen or 'none'})"

    def _repr_html_(self) -> str:
        return html_view(repr(self), self._rows(), ("step", "head added", "angle at that step"))


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
    max_rows: int = 64,
    progress: ProgressArg = True,
) -> SaharaResult:
    """Sahara: greedy head-group search by dataset-level Ships (docs/methods/safety.md).

    At each of `steps` steps, every head not yet chosen is scored by the angle between the
    base model and the model with the chosen group plus that head ablated (always against
    the unablated base); the argmax joins the group. Ties go to the lowest (layer, head).
    No threshold and no early stop. `progress` (default True: a tqdm bar; False off; or
    `progress(done, total)`) counts (candidate group, prompt) rows over all steps: `total`
    is `N * (M + (M - 1) + ... + (M - steps + 1))`
    for M candidate heads.

    Raises:
        ValueError: `steps` < 1 or more steps than candidate heads, and as `dataset_ships`.
    """
    eps, heads = _check(model, eps, exact, max_rows, heads)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= len(heads):
        raise HeadsteerValueError(f"steps must be an int in 1..{len(heads)}, got {steps!r}")
    enc = _encode_dataset(model, prompts, template, r_main)
    with progress_callback(progress, "sahara", "rows") as report:
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
                _ablate(model, ablation, eps),
                _final_state,
                max_rows=max_rows,
                progress=offset_progress(report, enc.batch * sum(len(heads) - i for i in range(step)), total),
            )
            ang = _angles(clean.final, states, r_main)
            table = _head_table(model, cands, ang)
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
