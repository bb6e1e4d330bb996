"""Progress as numbers: every long-running function calls `progress(done, total)` with ints,
`done` non-decreasing up to `total`, in the unit its docstring names (heads.progress)."""

import pytest

from heads.maps import RelationPairs, maps_scores
from heads.progress import offset_progress
from heads.ships import dataset_ships, sahara, ships
from probes.evaluate import evaluate
from steer.act_calibration import calibrate_act_heads

PROMPTS = ["How do I bake bread?", "Tell me a story about a dragon and a knight.", "What is two plus two?"]
HEADS = [(0, 1), (1, 0), (1, 3), (2, 2)]


def _record():
    seen = []
    return seen, lambda done, total: seen.append((done, total))


def _check(seen, total):
    """Ints, one total, done non-decreasing and ending at the total."""
    assert seen, "progress was never called"
    assert all(isinstance(d, int) and isinstance(t, int) for d, t in seen)
    assert {t for _, t in seen} == {total}
    done = [d for d, _ in seen]
    assert done == sorted(done) and 0 < done[0] and done[-1] == total


def test_offset_progress():
    seen, cb = _record()
    stage = offset_progress(cb, 10, 25)
    stage(3, 15)
    stage(15, 15)
    assert seen == [(13, 25), (25, 25)]
    assert offset_progress(None, 0, 5) is None
    with pytest.raises(ValueError, match="offset"):
        offset_progress(cb, 6, 5)


def test_ships_family_progress_in_rows(tiny_llama):
    n, k = len(PROMPTS), len(HEADS)
    seen, cb = _record()
    ships(tiny_llama, PROMPTS, heads=HEADS, max_rows=5, progress=cb)
    _check(seen, k * n)
    seen, cb = _record()
    dataset_ships(tiny_llama, PROMPTS, heads=HEADS, max_rows=5, progress=cb)
    _check(seen, k * n)
    seen, cb = _record()
    sahara(tiny_llama, PROMPTS, heads=HEADS, steps=3, max_rows=5, progress=cb)
    _check(seen, n * (k + (k - 1) + (k - 2)))  # every step's candidate groups, over one bar
    assert (k * n, n * (3 * k - 3)) in seen  # the first step ends where the second starts


def test_act_calibration_progress(tiny_llama):
    seen, cb = _record()
    prompts = ["Review: great film\nSentiment:", "Review: awful food\nSentiment:"]
    calibrate_act_heads(tiny_llama, prompts, [["positive", "negative"]] * 2, [0, 1], heads=HEADS, progress=cb)
    _check(seen, len(HEADS) * 2)


def test_maps_progress_per_layer(tiny_llama):
    seen, cb = _record()
    maps_scores(tiny_llama, [RelationPairs("r", [(5, 6), (7, 8)], 1)], progress=cb)
    assert seen == [(i + 1, tiny_llama.n_layers) for i in range(tiny_llama.n_layers)]


def test_evaluate_progress_in_examples(tiny_llama):
    seen, cb = _record()
    evaluate(tiny_llama, "sentiment", "none", limit=5, batch_size=2, progress=cb)
    assert seen == [(2, 5), (4, 5), (5, 5)]
