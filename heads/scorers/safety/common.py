"""What Ships, dataset-level Ships, Sahara and their attribution estimate share.

The prompt template, the two ablations (`"ua"`: query x eps; `"sc"`: head output x eps), the
encoding of plain string queries, the KL and final-state row scores of the variant engine,
the `[L, H]` tables, shard merging and the exact Ships sweep itself. Both
`heads.scorers.safety.ships` and `heads.scorers.safety.attribution` build on this module, and
neither imports the other's private names (Zhou et al., ICLR 2025, arXiv:2410.13708, §3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

from heads._util.progress import progress_callback
from heads._util.validation import check_int, short_repr
from heads.engine.edits import Edit, HeadScale, QueryScale
from heads.engine.executors import Target, run_shards
from heads.engine.options import SweepOptions
from heads.engine.variants import (
    RowEdits,
    RowScore,
    check_heads,
    clean_run,
    evaluate_variants,
    row_head_masks,
)
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, encode_prompts, normalize_prompts
from heads.model.adapter import HeadModel
from heads.results.safety import ShipsResult as ShipsResult  # defined there; imported here as before
from heads.results.scores import HeadScores, HeadSet, HeadSpec
from heads.scorers.safety.request import DEFAULT_TEMPLATE, check_template

__all__ = [
    "TEMPLATE",
    "Ablation",
    "ShipsResult",
    "ablate_rows",
    "ablation_edits",
    "check_scoring",
    "encode_dataset",
    "encode_queries",
    "exact_ships",
    "fill_template",
    "final_state",
    "head_pairs",
    "head_table",
    "kl_from",
    "merge_scores",
    "row_ablation_edits",
    "run_sharded",
    "shard_heads",
]

TEMPLATE = DEFAULT_TEMPLATE
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
        raise HeadsteerValueError(f"unknown ablation {short_repr(ablation)}: use 'ua' or 'sc'")
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
    if check_template(template) is None:  # the requests' check of a template
        return list(queries)
    return [template.replace("{query}", q) for q in queries]  # type: ignore[union-attr]


def encode_queries(model: HeadModel, prompts: str | Sequence[str], template: str | None) -> EncodedPrompts:
    """Plain string prompts put into `template` and tokenized (no chat template, no markup).

    Raises:
        HeadsteerTypeError: a prompt that is not a string.
    """
    items, _ = normalize_prompts(prompts)
    queries = [p for p in items if isinstance(p, str)]
    if len(queries) != len(items):
        raise HeadsteerTypeError("safety-head scoring takes plain string prompts")
    texts = fill_template(template, queries)
    return encode_prompts(model.tokenizer, texts, chat=False, markup=False)


def ablate_rows(model: HeadModel, ablation: Ablation, eps: float) -> RowEdits:
    """The variant engine's row edits: ablate each row's head set (`row_ablation_edits`)."""

    def row_edits(rows: list[Sequence[Head]], ps: torch.Tensor, trim: int) -> list[Edit]:
        return row_ablation_edits(model, rows, ablation=ablation, eps=eps)

    return row_edits


def kl_from(base_logp: torch.Tensor) -> RowScore:
    """KL(base || variant) per row, from fp32 log-softmax."""

    def score(logp: torch.Tensor, final: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
        base = base_logp[ps]
        # KL >= 0; batch-dependent float rounding can leave about -1e-9, clamped to 0
        return (base.exp() * (base - logp)).sum(-1).clamp(min=0.0)

    return score


def final_state(logp: torch.Tensor, final: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """The variant engine's row score of dataset-level Ships: the final-norm last-token state `[R, D]`."""
    return final


def shard_heads(heads: list[Head], shard: tuple[int, int] | None) -> list[Head]:
    """Heads of shard i of n (every n-th head from i; `shard` checked by `SweepOptions`)."""
    return heads if shard is None else heads[shard[0] :: shard[1]]


def encode_dataset(
    model: HeadModel, prompts: Sequence[str], template: str | None, r_main: object
) -> EncodedPrompts:
    """Encode prompts for a dataset-level score: at least 2 prompts (one final state spans a
    1-dimensional space whose angle to any other is 0) and `r_main` in 1..N."""
    enc = encode_queries(model, prompts, template)
    if enc.batch < 2:
        raise HeadsteerValueError("dataset-level Ships / Sahara need at least 2 prompts")
    check_int("r_main", r_main, lo=1, hi=enc.batch)
    return enc


def run_sharded(target: Target, model: HeadModel, options: SweepOptions, kwargs: dict) -> list:
    """Run `target(model, **kwargs, options=...)` over the executor's shards of `kwargs["heads"]`
    (shard i of n gets `options.shard = (i, n)`, no bar); the parts in order."""
    if isinstance(prompts := kwargs["prompts"], str):
        kwargs["prompts"] = [prompts]
    kwargs["prompts"] = list(kwargs["prompts"])
    base = SweepOptions(
        max_rows=options.max_rows, progress=False, seed=options.seed, max_memory=options.max_memory
    )
    assert options.executor is not None
    return run_shards(
        target,
        model,
        options.executor,
        lambda i, n: dict(kwargs, options=base.replace(shard=(i, n))),
        max_shards=len(kwargs["heads"]),
    )


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


def head_table(model: HeadModel, heads: Sequence[Head], values: torch.Tensor) -> torch.Tensor:
    """`[L, H, *rest]` table with `values[..., k]` at `heads[k]`, NaN elsewhere.

    `values` is `[*rest, len(heads)]`.
    """
    out = torch.full((model.n_layers, model.n_heads, *values.shape[:-1]), math.nan)
    for k, (layer, head) in enumerate(heads):
        out[layer, head] = values[..., k]
    return out


def check_scoring(
    model: HeadModel, eps: float, exact: bool, heads: HeadSpec | None
) -> tuple[float, list[Head]]:
    """The ablation scale (0 with `exact`) and the heads of a Ships-family scorer as a list (None:
    every head). `eps` and `exact` are a request's, checked there (`heads.scorers.safety.request`).

    Raises:
        HeadsteerValueError: no tokenizer, no head or an unknown one.
    """
    if model.tokenizer is None:
        raise HeadsteerValueError("safety-head scoring needs a HeadModel with a tokenizer")
    return (0.0 if exact else float(eps)), check_heads(model, heads)


def exact_ships(
    model: HeadModel,
    prompts: str | Sequence[str],
    heads: list[Head],
    ablation: Ablation,
    eps: float,
    template: str | None,
    options: SweepOptions,
) -> ShipsResult:
    """The exact Ships sweep here (no executor) over `heads` (checked, `options.shard` applied):
    each head ablated alone, KL(p_base || p_ablated) at the last position per prompt."""
    heads = shard_heads(heads, options.shard)
    enc = encode_queries(model, prompts, template)
    rows = options.rows_for(model, enc.length)  # a budget too small is refused before any forward
    with progress_callback(options.progress, "ships", "rows") as report:
        clean = clean_run(model, enc)
        kl = evaluate_variants(
            model,
            clean,
            [[h] for h in heads],
            ablate_rows(model, ablation, eps),
            kl_from(clean.logp),
            max_rows=rows,
            progress=report,
        )  # [M, N]
    per_prompt = head_table(model, heads, kl.T).permute(2, 0, 1)  # [N, L, H]
    params = {"ablation": ablation, "eps": eps, "template": template, "n_prompts": enc.batch}
    mean = HeadScores(per_prompt.mean(0), "ships", params, model.name, model.n_kv_heads)
    return ShipsResult(per_prompt, mean)


def head_pairs(model: HeadModel, heads: HeadSpec | None) -> tuple[Head, ...] | None:
    """A head selection as `(layer, head)` pairs for a request: a list of layers (every head of
    each) needs the model's head count, so it is read here (`HeadSet.parse`, its messages)."""
    if heads is None or isinstance(heads, (list, tuple)) and not heads:
        return None if heads is None else ()
    if not isinstance(model, HeadModel):
        raise HeadsteerTypeError(f"model must be a HeadModel, got {type(model).__name__}")
    return tuple(HeadSet.parse(heads, model.n_layers, model.n_heads).heads)
