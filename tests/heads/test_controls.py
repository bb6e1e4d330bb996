import random

import pytest
import torch

from heads.errors import HeadsteerValueError
from heads.scorers.controls import other_heads, random_head_draws


def test_other_heads_leaves_out_the_chosen_layer_major():
    assert other_heads(2, 3, [(0, 1), (1, 2)]) == [(0, 0), (0, 2), (1, 0), (1, 1)]


def test_draws_match_the_generators_they_name():
    pool = other_heads(4, 5, [(0, 0), (3, 4)])
    # torch: one seeded generator, the first `size` of each permutation (the MAPS ablation check)
    g = torch.Generator().manual_seed(7)
    want = [[pool[j] for j in torch.randperm(len(pool), generator=g)[:4].tolist()] for _ in range(3)]
    assert random_head_draws(pool, 4, 3, 7) == want
    # python: random.Random(seed).sample per draw (the safety study)
    rng = random.Random(7)
    assert random_head_draws(pool, 3, 2, 7, generator="python") == [rng.sample(pool, 3) for _ in range(2)]
    for draw in random_head_draws(pool, 4, 5, 1):
        assert len(set(draw)) == 4 and set(draw) <= set(pool)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"size": 99}, "size must be an int in 0..18"),
        ({"draws": -1}, r"draws must be an int in 0\.\.10000"),
        ({"draws": 2**40}, r"draws must be an int in 0\.\.10000.*got 1099511627776"),
        ({"generator": "numpy"}, "generator must be 'torch' or 'python'"),
    ],
)
def test_bad_draws_are_refused(kw, message):
    args = {"size": 2, "draws": 1, "seed": 0, **kw}
    with pytest.raises(HeadsteerValueError, match=message):
        random_head_draws(other_heads(4, 5, [(0, 0), (3, 4)]), **args)
