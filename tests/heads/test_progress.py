"""Progress as numbers: every long-running function calls `progress(done, total)` with ints,
`done` non-decreasing up to `total`, in the unit its docstring names (heads._util.progress)."""

import pytest
import torch

from heads._util.progress import offset_progress
from heads.scorers.maps.static import RelationPairs, maps_scores
from heads.scorers.safety.ships import dataset_ships, sahara, ships
from probes.studies.evaluate import evaluate
from steer.act.calibration import calibrate_act_heads

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


def test_maps_inference_progress(tiny_llama):
    from heads.results.scores import HeadScores
    from heads.scorers.maps.inference import ablation_check, dynamic_scores
    from probes.datasets.relations import load_relations

    rel = load_relations(tiny_llama.tokenizer, "plural", d_vocab=tiny_llama.d_vocab)["plural"]
    seen, cb = _record()
    dynamic_scores(tiny_llama, rel, templates=["a {x}", "b {x}"], max_pairs=5, batch_size=2, progress=cb)
    total = 2 * 3 + tiny_llama.n_layers  # 2 templates x 3 batches of 5 rows, then one step per layer
    assert seen == [(i, total) for i in range(1, total + 1)]
    s = torch.zeros(tiny_llama.n_layers, tiny_llama.n_heads)
    s[0, 1] = s[1, 0] = 0.5
    scores = HeadScores(s, "x")
    seen, cb = _record()
    ablation_check(tiny_llama, rel, scores, draws=2, n_prompts=3, min_base=0.0, progress=cb)
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]  # base, top heads, one per draw
    seen, cb = _record()
    res = ablation_check(tiny_llama, rel, scores, draws=2, n_prompts=3, min_base=1.1, progress=cb)
    assert res.skipped and seen == [(1, 4), (4, 4)]  # a skipped relation jumps to the end


def test_evaluate_progress_in_examples(tiny_llama):
    seen, cb = _record()
    evaluate(tiny_llama, "sentiment", "none", limit=5, batch_size=2, progress=cb)
    assert seen == [(2, 5), (4, 5), (5, 5)]


def test_evaluate_progress_moves_while_a_batch_decodes(tiny_llama):
    seen, cb = _record()
    evaluate(tiny_llama, "json_format", "none", limit=4, batch_size=4, max_new_tokens=4, progress=cb)
    _check(seen, 4)
    assert sorted({d for d, _ in seen}) == [1, 2, 3, 4]  # 4 * step // 4 after each decoding step


def test_hf_progress_bars_off_nests_and_restores_both_switches():
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    from heads._util.progress import hf_progress_bars_off

    was = hf_logging.is_progress_bar_enabled(), not hub_utils.are_progress_bars_disabled()
    try:
        for transformers_on, hub_on in ((True, True), (True, False), (False, True), (False, False)):
            hf_logging.enable_progress_bar() if transformers_on else hf_logging.disable_progress_bar()
            hub_utils.enable_progress_bars() if hub_on else hub_utils.disable_progress_bars()
            with hf_progress_bars_off():
                with hf_progress_bars_off():
                    assert not hf_logging.is_progress_bar_enabled()
                assert not hf_logging.is_progress_bar_enabled()  # the outer block still holds it
                assert hub_utils.are_progress_bars_disabled()
            assert hf_logging.is_progress_bar_enabled() == transformers_on
            assert (not hub_utils.are_progress_bars_disabled()) == hub_on
            with pytest.raises(KeyError), hf_progress_bars_off():
                raise KeyError("x")
            assert hf_logging.is_progress_bar_enabled() == transformers_on
    finally:
        hf_logging.enable_progress_bar() if was[0] else hf_logging.disable_progress_bar()
        hub_utils.enable_progress_bars() if was[1] else hub_utils.disable_progress_bars()
