"""PASTA head profiling (Zhang et al., ICLR 2024, §3.2 Algorithm 1; docs/methods/pasta.md).

It lives beside PASTA in `steer/` (not in `heads/`) because it scores heads with PASTA's own
edit (`steer.pasta.method.PastaBias`); `heads` imports nothing from `steer`.

Every single head is steered alone with PASTA (alpha 0.01, `exclude`) and scored on a task:
the mean change, against the unsteered model, of the log-probability of the task's target
token at the last prompt position (a cheap likelihood metric: the first token of the right
answer, e.g. `{` for a JSON answer or the new fact's first token). Heads are packed into batch
rows (one head per row) on the shared variant engine (`heads.engine.variants`), which reuses the
clean layer prefix below each head's layer and, because PASTA leaves every row before the
first span unchanged (all the columns such a row sees get the same bias, which softmax
cancels), the clean keys/values of the positions before the span.

`select_heads` turns per-task profiles into one head set (intersection / union / one task),
the `{"layer": [heads]}` shape that `Pasta`, `SteeredModel` and `headsteer generate
--pasta-heads FILE` accept; with `n_heads=` it picks the smallest top-k that gives at least
that many heads (`smallest_k`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from heads._util.progress import progress_callback
from heads._util.validation import check_bool, short_repr
from heads.engine.edits import Edit
from heads.engine.options import SweepOptions, sweep_options
from heads.engine.variants import check_heads, clean_run, evaluate_variants, row_head_masks
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, encode_prompts, normalize_prompts
from heads.model.adapter import HeadModel
from heads.results.roles import RoleScores
from heads.results.scores import HeadScores, HeadSet, HeadSpec, _positive_int
from steer.pasta.method import PastaBias, check_alpha, pasta_column_bias

__all__ = ["profile_heads", "select_heads", "smallest_k", "target_ids"]

Head = tuple[int, int]
Selection = Literal["intersection", "union", "task"]


def target_ids(tokenizer: Any, targets: Sequence[str]) -> torch.Tensor:
    """`[N]` first token id of each target string (encoded without special tokens).

    Raises:
        ValueError: an empty target or one that encodes to no token.
    """
    out = []
    for t in targets:
        if not isinstance(t, str) or not t:
            raise HeadsteerValueError(f"targets must be non-empty strings, got {short_repr(t)}")
        ids = tokenizer(t, add_special_tokens=False)["input_ids"]
        if not ids:
            raise HeadsteerValueError(f"target {short_repr(t)} encodes to no token")
        out.append(ids[0])
    return torch.tensor(out)


def _first_span_start(enc: EncodedPrompts) -> torch.Tensor:
    """`[N]` padded position of each prompt's first span start (rows before it are unchanged)."""
    starts = []
    for b, spans in enumerate(enc.spans):
        if not spans:
            raise HeadsteerValueError(
                f"prompt {b} has no emphasized span: PASTA profiling needs one per prompt"
            )
        starts.append(min(s for s, _ in spans))
    return torch.tensor(starts)


def profile_heads(
    model: HeadModel,
    prompts: Sequence,
    targets: Sequence[str],
    *,
    emphasize: Sequence | None = None,
    chat: bool | None = None,
    alpha: float = 0.01,
    heads: HeadSpec | None = None,
    task: str = "task",
    reuse_positions: bool = True,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> HeadScores:
    """Profile single heads with PASTA on one task (Algorithm 1, steps 2-3).

    Args:
        model: the model (with a tokenizer).
        prompts: N prompts (strings or chats); the span to emphasize is marked with `**...**`
            or given by `emphasize` (one substring per prompt).
        targets: N strings; the score reads the log-prob of each one's first token at the
            last prompt position (include a leading space where the answer follows one).
        chat: apply the chat template (default: when the tokenizer has one); the last
            position is then the start of the assistant turn.
        alpha: PASTA's coefficient (default 0.01, mode `exclude`).
        heads: heads to profile, any `HeadSpec` (default all `L x H`).
        task: task name recorded in the scores' params.
        reuse_positions: take positions before the span from the clean KV cache (exact up to
            float rounding; turn off to recompute everything).
        options: how the sweep runs (`heads.SweepOptions`): `max_rows` batch rows per forward
            (fewer where `max_memory` needs it; refused before any forward below one row);
            `progress` a tqdm bar by default, in (head, prompt) rows (`total` is
            `len(heads) * N`); `executor` (`"local"`, `"ray"` or a
            `heads.engine.executors.Executor`) splits the heads into the executor's shards,
            runs them (Ray: as tasks, each worker loading the model once) and merges them with
            `merge_scores`; default None runs here. No `shard` (pass `heads=` instead).
        **deprecated: the 0.1 keywords `max_rows=`, `progress=`, `executor=`: still accepted
            for this release, with a `DeprecationWarning`.

    Returns:
        HeadScores (method `"pasta_profile"`): per head, the mean over prompts of
        `log p_steered(target) - log p_base(target)` in nats (higher = the head helps);
        heads not profiled are NaN. `params["base_logp"]` is the unsteered mean log-prob.

    Raises:
        ValueError: prompt/target count mismatch, a prompt without a span, bad alpha or heads.
    """
    takes = ("max_rows", "progress", "executor", "max_memory")
    opts = sweep_options(options, deprecated, "profile_heads", takes=takes)
    if model.tokenizer is None:
        raise HeadsteerValueError("PASTA profiling needs a HeadModel with a tokenizer")
    check_alpha(alpha)  # validates alpha; warns on a no-op (alpha = 1) or de-emphasizing value
    check_bool("reuse_positions", reuse_positions, what="a bool")
    items, single = normalize_prompts(prompts)
    if isinstance(targets, str):
        if not single:
            raise HeadsteerTypeError("targets must be a list of strings, one per prompt")
        targets = [targets]
    if emphasize is not None:
        if single and not isinstance(emphasize, (list, tuple)):
            emphasize = [emphasize]
        if isinstance(emphasize, (str, bytes)) or len(emphasize) != len(items):
            raise HeadsteerValueError(
                f"{len(items)} prompts but emphasize={short_repr(emphasize)}: give one span per prompt"
            )
        # batch-major: one span (or a list of spans) per prompt
        emphasize = [e if isinstance(e, (list, tuple)) else [e] for e in emphasize]
    enc = encode_prompts(model.tokenizer, items, emphasize=emphasize, chat=chat)
    if len(targets) != enc.batch:
        raise HeadsteerValueError(f"{enc.batch} prompts but {len(targets)} targets")
    tgt = target_ids(model.tokenizer, targets)
    starts = _first_span_start(enc)
    heads = check_heads(model, heads)
    kv = 2 * model.n_layers * model.n_kv_heads * model.d_head * enc.batch * enc.length * model.dtype.itemsize
    opts = opts.within(model, enc.length, reserve=kv if reuse_positions else 0, whole=enc.batch)  # max_memory
    if opts.executor is not None:
        from heads.engine.executors import run_head_shards
        from heads.scorers.safety.common import merge_scores

        kw = dict(
            prompts=items, targets=list(targets), emphasize=emphasize, chat=chat, alpha=alpha, task=task
        )
        kw.update(reuse_positions=reuse_positions)
        kw.update(options=SweepOptions(max_rows=opts.max_rows, progress=False))
        parts = run_head_shards(profile_heads, model, opts.executor, kw, heads)
        return merge_scores(parts)
    bias = pasta_column_bias(enc, alpha)  # [N, T]

    def row_edits(rows: list[Sequence[Head]], ps: torch.Tensor, trim: int) -> list[Edit]:
        cb = bias[ps, trim:]
        masks = row_head_masks(model, rows)
        return [PastaBias(layer=la, row_heads=m, column_bias=cb) for la, m in masks.items()]

    def score(logp: torch.Tensor, final: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
        return logp.gather(1, tgt[ps, None])[:, 0]

    with progress_callback(opts.progress, f"PASTA profile {task}", "rows") as report:
        clean = clean_run(model, enc, keep_kv=reuse_positions)
        base = clean.logp.gather(1, tgt[:, None])[:, 0]  # [N]
        got = evaluate_variants(
            model,
            clean,
            [[h] for h in heads],
            row_edits,
            score,
            unchanged_before=starts if reuse_positions else None,
            max_rows=opts.max_rows,
            progress=report,
        )  # [K, N]
    delta = (got - base[None]).mean(1)
    table = torch.full((model.n_layers, model.n_heads), float("nan"))
    for k, (layer, head) in enumerate(heads):
        table[layer, head] = delta[k]
    params = {"task": task, "alpha": alpha, "n_prompts": enc.batch, "base_logp": float(base.mean())}
    return HeadScores(table, "pasta_profile", params, model.name, model.n_kv_heads)


def _rankings(profiles: Mapping[str, HeadScores]) -> dict[str, list[Head]]:
    """Each task's full head ranking (descending score, ties by (layer, head), NaN dropped)."""
    if isinstance(profiles, RoleScores):  # the detectors' scores: read without the dict warning
        profiles = profiles.as_dict()
    if not isinstance(profiles, Mapping) or not profiles:
        raise HeadsteerValueError(
            f"profiles must be a non-empty {{task: HeadScores}} mapping, got {short_repr(profiles)}"
        )
    shapes = set()
    for name, p in profiles.items():
        if not isinstance(p, HeadScores):
            raise HeadsteerTypeError(
                f"profile {short_repr(name)} must be a HeadScores, got {type(p).__name__}"
            )
        shapes.add(tuple(p.scores.shape))
    if len(shapes) > 1:
        raise HeadsteerValueError(f"profiles come from models of different shapes: {sorted(shapes)}")
    return {name: p.ranked() for name, p in profiles.items()}


def _combine(rankings: Mapping[str, list[Head]], k: int, mode: Selection, task: str | None) -> set[Head]:
    tops = {name: set(r[:k]) for name, r in rankings.items()}
    if mode == "task":
        if task is None:  # unreachable: `_check_mode` ran first
            raise HeadsteerValueError("mode='task' needs task=")
        return tops[task]
    if mode == "intersection":
        return set.intersection(*tops.values())
    return set.union(*tops.values())


def _check_mode(rankings: Mapping[str, list[Head]], mode: object, task: str | None) -> None:
    if mode not in ("intersection", "union", "task"):
        raise HeadsteerValueError(
            f"unknown selection mode {short_repr(mode)}: use 'intersection', 'union' or 'task'"
        )
    if task is not None and mode != "task":
        raise HeadsteerValueError(f"task= is only used with mode='task', got mode={short_repr(mode)}")
    if mode == "task" and task not in rankings:
        raise HeadsteerValueError(
            f"mode='task' needs task= one of {sorted(rankings)}, got {short_repr(task)}"
        )


def smallest_k(
    profiles: Mapping[str, HeadScores],
    n_heads: int,
    *,
    mode: Selection = "intersection",
    task: str | None = None,
) -> int:
    """The smallest top-`k` whose selection (`select_heads(profiles, k, mode=mode)`) holds at
    least `n_heads` heads.

    Selections only grow with `k`, so this is the first `k` in `1..n_layers * n_heads` that
    reaches `n_heads`. With `"intersection"`, heads that are NaN (not profiled) in some task
    never enter, so the largest selection can hold fewer than `n_heads`.

    Raises:
        ValueError: as `select_heads`; `n_heads` not a positive int, or more heads than any
            `k` selects (the message gives the largest selection size).
    """
    rankings = _rankings(profiles)
    _check_mode(rankings, mode, task)
    n_heads = _positive_int(n_heads)
    k_max = max(len(r) for r in rankings.values())
    most = len(_combine(rankings, k_max, mode, task))
    if most < n_heads:
        raise HeadsteerValueError(
            f"n_heads={n_heads} is more than any top-k {mode} selects (at most {most} heads)"
        )
    lo, hi = 1, k_max  # binary search: the selection size is non-decreasing in k
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_combine(rankings, mid, mode, task)) >= n_heads:
            hi = mid
        else:
            lo = mid + 1
    return lo


def select_heads(
    profiles: Mapping[str, HeadScores],
    k: int | None = None,
    *,
    n_heads: int | None = None,
    mode: Selection = "intersection",
    task: str | None = None,
) -> HeadSet:
    """Combine per-task profiles (Algorithm 1, step 4): the top-`k` heads of each task's ranking
    (descending score, ties by (layer, head), NaN dropped), then their intersection (paper
    default), union, or one task's (`mode="task"`, `task=` its name).

    Give either `k` or `n_heads`: with `n_heads`, `k` is the smallest top-k whose selection
    has at least `n_heads` heads (`smallest_k`; the selection can hold more, since raising
    `k` by one can add several heads at once).

    Raises:
        ValueError: no profiles, both or neither of `k` and `n_heads`, a non-positive `k` or
            `n_heads`, `n_heads` above what any `k` selects, an unknown mode, profiles of
            different shapes, or `mode="task"` without a known task.
        TypeError: a profile that is not a `HeadScores`.
    """
    rankings = _rankings(profiles)
    _check_mode(rankings, mode, task)
    if (k is None) == (n_heads is None):
        raise HeadsteerValueError(
            f"give exactly one of k and n_heads, got k={short_repr(k)}, n_heads={short_repr(n_heads)}"
        )
    if n_heads is not None:
        k = smallest_k(profiles, n_heads, mode=mode, task=task)
    return HeadSet(_combine(rankings, _positive_int(k), mode, task))
