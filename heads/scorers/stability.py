"""The `stability=` option of the head analyses: their per-pair values to a `Stability`.

Every head analysis keeps its per-sample values (`PatchResult.raw` `[*grid, N]`,
`DLAResult.heads` `[N, L, H, T]`, `ShipsResult.per_prompt` `[N, L, H]` for Ships and the
attribution estimate (AtP), the pattern detectors' per-sequence scores, CHG's per-fit gates), so
the bootstrap (`heads.results.stability`) is arithmetic on them: no new forward pass. This
module turns each result's values into the `[N, ...]` tensor and the reduction the analysis
uses, and reads the pairs' template ids. The arithmetic on a result's values (`grid_stability`,
`position_reduce`, `patch_stability`) lives with the results (`heads.results.resampling`,
`heads.results.patching`) and is imported here under the same names.
"""

from __future__ import annotations

from typing import Any

import torch

from heads.errors import HeadsteerValueError
from heads.results.patching import patch_stability
from heads.results.resampling import grid_stability, position_reduce
from heads.results.scores import HeadScores
from heads.results.stability import check_stability

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
