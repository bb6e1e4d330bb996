"""Random-head controls: draws of heads outside a chosen set, for "is it these heads or any heads?".

A causal claim about a set of heads (MAPS' top heads of a relation, Sahara's safety heads) is
checked against the same intervention on random heads outside the set. `other_heads` lists the
candidates, `random_head_draws` draws them reproducibly from a seed.

Two generators are kept so that every published number stays reproducible: `"torch"` (a seeded
`torch.Generator` and `torch.randperm`, the first `size` of each permutation; the MAPS ablation
check) and `"python"` (`random.Random(seed).sample`; the safety study and the attribution
controls).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence

import torch

from heads._util.validation import check_int, check_seed, short_repr
from heads.errors import HeadsteerValueError

__all__ = ["MAX_DRAWS", "Head", "check_draws", "other_heads", "random_head_draws"]

Head = tuple[int, int]

MAX_DRAWS = 10_000
"""The most random-head draws a control takes: each draw is at least one forward pass (more is
never a sensible baseline, and `2**40` draws were built as a list until memory ran out)."""


def check_draws(draws: object, lo: int = 1) -> int:
    """`draws` as an int in `lo..MAX_DRAWS`, or a `HeadsteerValueError` naming the value."""
    return check_int("draws", draws, lo=lo, hi=MAX_DRAWS, what=f"an int in {lo}..{MAX_DRAWS}")


def other_heads(n_layers: int, n_heads: int, exclude: Collection[Head]) -> list[Head]:
    """Every `(layer, head)` of an `n_layers x n_heads` model not in `exclude`, layer-major."""
    chosen = set(map(tuple, exclude))
    return [(la, h) for la in range(n_layers) for h in range(n_heads) if (la, h) not in chosen]


def random_head_draws(
    pool: Sequence[Head], size: int, draws: int, seed: int, *, generator: str = "torch"
) -> list[list[Head]]:
    """`draws` random draws of `size` distinct heads from `pool`, reproducible from `seed`.

    Args:
        pool: the candidate heads (e.g. `other_heads(...)`).
        size: heads per draw, at most `len(pool)`.
        draws: how many draws (>= 0).
        seed: the generator's seed; one generator serves all draws in turn.
        generator: `"torch"` (default: `torch.randperm` with a seeded `torch.Generator`, the first
            `size` of each permutation) or `"python"` (`random.Random(seed).sample(pool, size)`).

    Returns:
        `draws` lists of `size` heads, each in the order drawn.

    Raises:
        HeadsteerValueError: `size` not in 0..len(pool), `draws` not in 0..`MAX_DRAWS`, or an
            unknown generator.
    """
    size = check_int("size", size, lo=0, hi=len(pool))
    draws = check_draws(draws, lo=0)
    seed = check_seed("seed", seed)
    if generator == "torch":
        g = torch.Generator().manual_seed(seed)
        perms = [torch.randperm(len(pool), generator=g)[:size].tolist() for _ in range(draws)]
        return [[pool[j] for j in perm] for perm in perms]
    if generator == "python":
        rng = random.Random(seed)
        return [rng.sample(list(pool), size) for _ in range(draws)]
    raise HeadsteerValueError(f"generator must be 'torch' or 'python', got {short_repr(generator)}")
