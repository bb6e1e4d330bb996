"""Bad input to the scorers and steering methods: a clear error naming the value, model untouched."""

import numpy as np
import pytest
import torch

import heads.engine.state as engine_state
from heads import HeadScores, encode_prompts, forward
from heads.engine.variants import check_heads
from heads.scorers.safety.ships import dataset_ships, merge_scores, sahara, ships
from heads.scorers.sinks import massive_activations, sink_stats
from probes.studies.evaluate import evaluate
from steer import Spotlight, SteeredModel
from steer.act.calibration import calibrate_act_heads
from steer.pasta.profiling import profile_heads, select_heads

P = ["Is the sky blue? Answer:", "Is grass red? Answer:"]


def test_a_single_string_is_one_prompt(tiny_llama):
    assert sink_stats(tiny_llama, "abc def").sink_mass.params["n_prompts"] == 1
    assert set(massive_activations(tiny_llama, "abc def", top=2).prompt) == {0}
    prof = profile_heads(tiny_llama, "Bob is a **pilot**. Job:", " pilot", heads=[(0, 0)], chat=False)
    assert prof.params["n_prompts"] == 1
    with pytest.raises(TypeError, match="targets"):
        profile_heads(tiny_llama, ["**a** b", "**c** d"], "ab", chat=False)


def test_massive_activations_top_and_padding(tiny_llama):
    for top in (0, -1, 2.5, True, 10**9):
        with pytest.raises(ValueError, match="top"):
            massive_activations(tiny_llama, P, top=top)
    df = massive_activations(tiny_llama, ["A", "B c d e f g"], top=60)
    assert (df.position >= 0).all()  # never a pad position (negative offsets)


def test_head_selections_are_checked_the_same_everywhere(tiny_llama):
    assert check_heads(tiny_llama, [(np.int64(1), np.int64(0))]) == [(1, 0)]
    assert check_heads(tiny_llama, {"1": [0, 0]}) == [(1, 0)]
    for bad in ([(0, 0, 0)], [(0,)], 5):
        with pytest.raises((ValueError, TypeError)):
            check_heads(tiny_llama, bad)
    with pytest.raises(ValueError, match="no heads"):
        check_heads(tiny_llama, [])
    prof = profile_heads(
        tiny_llama, ["Bob is a **pilot**. Job:"], [" pilot"], heads=[(np.int64(1), 0)], chat=False
    )
    assert not torch.isnan(prof.scores[1, 0])


def test_spotlight_layers_and_long_prefill(tiny_llama, monkeypatch):
    with pytest.raises(ValueError, match="duplicates"):
        Spotlight(layers=(0, 0))
    with pytest.raises(ValueError, match="empty"):
        Spotlight(layers=())
    with pytest.raises(TypeError, match="layers"):
        Spotlight(layers=1)
    monkeypatch.setattr(engine_state, "QUERY_BLOCK", 4)
    sm = SteeredModel(tiny_llama)
    # a pooled SpotLight over a prompt longer than a query block runs on the fused kernel
    # (tests/test_fused.py); without flex_attention it is refused before anything runs
    monkeypatch.setattr("heads.engine.kernels.fused.available", lambda: False)
    with pytest.raises(ValueError, match="query blocks"):
        sm.generate(["The cat **sat on the mat** today"], Spotlight(), chat=False, max_new_tokens=1)
    assert sm.generate(
        ["The cat **sat on the mat** today"], Spotlight(granularity="row"), chat=False, max_new_tokens=1
    ).token_ids


def test_calibration_labels_and_choices(tiny_llama):
    c = [["yes", "no"]] * 2
    for labels in ([0.0, 1.0], [False, True], ["0", "1"]):
        with pytest.raises(TypeError, match="labels"):
            calibrate_act_heads(tiny_llama, P, c, labels)
    with pytest.raises(ValueError, match="at least 2"):
        calibrate_act_heads(tiny_llama, P, [["yes"], ["no"]], [0, 0])
    with pytest.raises(TypeError, match="list of strings"):
        calibrate_act_heads(tiny_llama, P, ["yn", "yn"], [0, 1])
    with pytest.raises(TypeError, match="SinkRule"):
        calibrate_act_heads(tiny_llama, P, c, [0, 1], rule="absolute")
    with pytest.raises(TypeError, match="SinkRule"):
        sink_stats(tiny_llama, P, rule="absolute")


def test_safety_scorers_reject_degenerate_input(tiny_llama):
    with pytest.raises(ValueError, match="r_main"):
        sahara(tiny_llama, P, steps=1, r_main=0)
    with pytest.raises(ValueError, match="at least 2 prompts"):
        dataset_ships(tiny_llama, ["x y"])
    with pytest.raises(ValueError, match="query"):
        ships(tiny_llama, P, heads=[(0, 0)], template="fixed text")
    with pytest.raises(ValueError, match="eps"):
        ships(tiny_llama, P, heads=[(0, 0)], eps=-1)
    with pytest.raises(TypeError, match="exact"):
        ships(tiny_llama, P, heads=[(0, 0)], exact="yes")
    with pytest.raises(TypeError, match="degrees"):
        dataset_ships(tiny_llama, P, heads=[(0, 0)], degrees="no")
    a = ships(tiny_llama, P, shard=(0, 2), eps=0.5).scores
    b = ships(tiny_llama, P, shard=(1, 2)).scores
    with pytest.raises(ValueError, match="parameters"):
        merge_scores([a, b])


def test_select_heads_and_evaluate_inputs(tiny_llama):
    a, b = HeadScores(torch.rand(3, 4), "pasta_profile"), HeadScores(torch.rand(2, 4), "pasta_profile")
    with pytest.raises(ValueError, match="shapes"):
        select_heads({"a": a, "b": b}, 2)
    with pytest.raises(TypeError, match="HeadScores"):
        select_heads({"a": "x"}, 2)
    with pytest.raises(ValueError, match="task="):
        select_heads({"a": a}, 2, task="a")
    for bs in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="batch_size"):
            evaluate(tiny_llama, "sentiment", "none", limit=2, batch_size=bs)


def test_model_unchanged_after_errors(tiny_llama):
    enc = encode_prompts(tiny_llama.tokenizer, P, chat=False)
    before = forward(tiny_llama, enc)
    with pytest.raises(ValueError):
        calibrate_act_heads(tiny_llama, P, [["yes", "no"]] * 2, [0, 5])
    with pytest.raises(ValueError):
        SteeredModel(tiny_llama).generate(["no span"], Spotlight(), chat=False, max_new_tokens=1)
    assert all("forward" not in block.__dict__ for block in tiny_llama.layers)
    assert torch.equal(forward(tiny_llama, enc), before)


def test_scorers_check_the_prompt_against_the_position_limit(tokenizer):
    """A 100-token prompt on a 64-position model is refused before any forward pass."""
    from tests.support import make_tiny

    hm = make_tiny("llama", tokenizer, max_position_embeddings=64)
    long = "word " * 100
    ok = "Is the sky blue?"
    runs = []
    handle = hm.model.register_forward_pre_hook(lambda m, a: runs.append(1))
    calls = {
        "ships": lambda: ships(hm, [ok, long], heads=[(0, 0)]),
        "dataset_ships": lambda: dataset_ships(hm, [ok, long], heads=[(0, 0)]),
        "sahara": lambda: sahara(hm, [ok, long], heads=[(0, 0), (1, 1)], steps=1),
        "profile_heads": lambda: profile_heads(
            hm, [f"**{long}** Job:"], [" pilot"], heads=[(1, 0)], chat=False
        ),
        "calibrate_act_heads": lambda: calibrate_act_heads(hm, [ok, long], [["yes", "no"]] * 2, [0, 1]),
    }
    try:
        for name, call in calls.items():
            with pytest.raises(ValueError, match="limit of 64 positions"):
                call()
            assert runs == [], name
    finally:
        handle.remove()
    assert ships(hm, [ok], heads=[(0, 0)]).per_prompt.shape == (1, hm.n_layers, hm.n_heads)


@pytest.mark.real
def test_embedded_model_refuses_a_prompt_beyond_8192_positions(smol):
    with pytest.raises(ValueError, match="limit of 8192 positions"):
        ships(smol, ["word " * 8300], heads=[(0, 0)])
