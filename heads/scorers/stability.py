"""The `stability=` option of the head analyses: their per-pair values to a `Stability`.

Every head analysis keeps its per-sample values (`PatchResult.raw` `[*grid, N]`,
`DLAResult.heads` `[N, L, H, T]`, `ShipsResult.per_prompt` `[N, L, H]` for Ships and the
attribution estimate (AtP), the pattern detectors' per-sequence scores, CHG's per-fit gates), so
the bootstrap (`heads.results.stability`) is arithmetic on them: no new forward pass. This
module turns each result's values into the `[N, ...]` tensor and the reduction the analysis
uses, and reads the pairs' template ids.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from heads.errors import HeadsteerValueError
from heads.results.scores import HeadScores
from heads.results.stability import DEFAULT_RESAMPLES, Stability, check_stability, stability_of

__all__ = [
    "attach",
    "check_samples",
    "grid_stability",
    "pair_templates",
    "patch_stability",
    "position_reduce",
]


def check_samples(n: int, stability: int, what: str = "pairs") -> None:
    """Refuse `stability` > 0 with fewer than 2 samples (nothing to resample), before any work."""
    if stability and n < 2:
        raise HeadsteerValueError(f"stability={stability} needs at least 2 {what}, got {n}")


def pair_templates(pairs: Any) -> list | None:
    """The template id of every pair of a `PairBatch` (its `PromptPair.meta["template"]`), or
    None when any pair has none (pairs built from token ids, or a set without templates)."""
    src = getattr(pairs, "pairs", None) or []
    if len(src) != getattr(pairs, "n", -1):
        return None
    ids = [None if p is None else p.meta.get("template") for p in src]
    return None if any(t is None for t in ids) else ids


def position_reduce(reduce: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """`[R, L, H, T] -> [R, L * H]`: `"max"` (the signed value of largest |.| over positions, as
    `PatchResult.head_scores`) or `"sum"` (NaN-skipping sum)."""
    if reduce not in ("max", "sum"):
        raise HeadsteerValueError(f"reduce must be 'max' or 'sum', got {reduce!r}")

    def red(m: torch.Tensor) -> torch.Tensor:
        if reduce == "sum":
            out = m.nansum(-1)
        else:
            idx = m.nan_to_num(0).abs().argmax(-1, keepdim=True)
            out = m.gather(-1, idx)[..., 0]
        return out.reshape(m.shape[0], -1)

    return red


def grid_stability(
    per: torch.Tensor,
    n_resamples: int = DEFAULT_RESAMPLES,
    *,
    k: int = 10,
    seed: int = 0,
    absolute: bool = False,
    templates: list | None = None,
    by: str = "pairs",
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    method: str = "",
    model: str = "",
    params: dict | None = None,
) -> Stability:
    """`Stability` of a head ranking from per-sample values `per` `[N, L, H]` (or `[N, L, H, T]`
    with a `reduce` over positions, `position_reduce`). See `heads.results.stability.stability_of`."""
    if per.ndim not in (3, 4):
        raise HeadsteerValueError(f"per-sample head values must be [N, L, H(, T)], got {tuple(per.shape)}")
    return stability_of(
        per,
        n_resamples=n_resamples,
        k=k,
        seed=seed,
        absolute=absolute,
        reduce=reduce,
        shape=list(per.shape[1:3]),
        templates=templates,
        by=by,
        method=method,
        model=model,
        params=params,
    )


def attach(
    scores: HeadScores, per: torch.Tensor, stability: int, templates: list | None = None
) -> HeadScores:
    """Set `scores.stability` from per-sample values `per [N, L, H]` (`stability` resamples,
    top 10, seed 0) when `stability` > 0; returns `scores`.

    Raises:
        ValueError: a bad `stability` (`check_stability`) or fewer than 2 samples.
    """
    if check_stability(stability):
        check_samples(per.shape[0], stability)
        scores.stability = grid_stability(
            per,
            stability,
            templates=templates,
            method=scores.method,
            model=scores.model,
            params={"n_samples": int(per.shape[0])},
        )
    return scores


def patch_stability(
    result: Any,  # a `heads.scorers.patching.activation.PatchResult` (that module builds on this one)
    n_resamples: int = DEFAULT_RESAMPLES,
    *,
    k: int = 10,
    seed: int = 0,
    templates: list | None = None,
    by: str = "pairs",
    reduce: str = "max",
) -> Stability:
    """The bootstrap `Stability` of an activation-patching head ranking over its N pairs, from
    the per-pair normalised scores `result.scores` `[*grid, N]` (NaN for zero-gap pairs).

    Args:
        templates: one id per pair (`pair_templates(pairs)`), for the agreement across templates.
        reduce: over positions for `head_out_by_pos` (`"max"` or `"sum"`, as `head_scores`).

    Raises:
        ValueError: a kind without a head axis, fewer than 2 pairs, bad arguments.
    """
    if result.grid[:2] not in (("layer", "head"), ("layer", "kv_head")):
        raise HeadsteerValueError(f"patching kind {result.kind!r} has no head axis to rank")
    per = result.scores.movedim(-1, 0)  # [N, L, H(, T)]
    st = grid_stability(
        per,
        n_resamples,
        k=k,
        seed=seed,
        templates=templates,
        by=by,
        reduce=position_reduce(reduce) if per.ndim == 4 else None,
        method=f"patching.{result.kind}",
        model=result.model,
        params={"direction": result.direction, "metric": result.metric, "reduce": reduce},
    )
    layers = result.params.get("layers")
    if isinstance(layers, list) and len(layers) == per.shape[1]:  # a sweep of some layers: their names
        h = per.shape[2]
        st.names = [f"L{layers[i // h]}.H{i % h}" for i in range(len(st.names))]
    return st
