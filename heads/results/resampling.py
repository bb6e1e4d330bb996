"""Resampling helpers on per-sample head values: the `[N, L, H(, T)]` -> bootstrap `Stability`
step every head analysis' `stability=` option and `bootstrap()` share (`heads.results.stability`
holds the bootstrap itself).

Pure arithmetic on a result's kept values (no forward pass), so the results (`DLAResult`,
`PatchResult`) call it without the scorers; `heads.scorers.stability` re-exports it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from heads.errors import HeadsteerValueError
from heads.results.stability import DEFAULT_RESAMPLES, Stability, stability_of

__all__ = ["grid_stability", "position_reduce"]


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
