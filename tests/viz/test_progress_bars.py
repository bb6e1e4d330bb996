"""`progress=True` (the default) draws one tqdm bar on stderr; False / None are silent; a
callable gets `(done, total)`; nested work draws no second bar (heads._util.progress)."""

import inspect

import pytest

from heads._util.progress import offset_progress, progress_callback
from heads.scorers.maps.analysis import maps_analysis
from heads.scorers.maps.inference import ablation_check, dynamic_scores
from heads.scorers.maps.static import RelationPairs, maps_scores
from heads.scorers.safety.ships import dataset_ships, sahara, ships
from probes.datasets.relations import load_relations
from probes.head_probes import collect_head_outputs, fit_head_probes
from probes.studies.evaluate import evaluate
from probes.studies.safety import safety_analysis
from steer.act.calibration import calibrate_act_heads
from steer.pasta.profiling import profile_heads
from steer.steered_model import BAR_MIN_PROMPTS, SteeredModel
from viz.reports.all import all_reports
from viz.reports.maps import maps_report
from viz.reports.probes import probes_report
from viz.reports.safety import safety_report

PROMPTS = ["How do I bake bread?", "Tell me a story about a dragon.", "What is two plus two?"]
HEADS = [(0, 1), (1, 0), (2, 2)]

LONG_RUNNING = [
    ships,
    dataset_ships,
    sahara,
    profile_heads,
    calibrate_act_heads,
    maps_scores,
    maps_analysis,
    evaluate,
    safety_analysis,
    maps_report,
    safety_report,
    all_reports,
    SteeredModel.generate,
    fit_head_probes,
    collect_head_outputs,
    dynamic_scores,
    ablation_check,
    probes_report,
]


@pytest.mark.parametrize("fn", LONG_RUNNING, ids=lambda f: f.__qualname__)
def test_every_long_call_shows_a_bar_by_default(fn):
    params = inspect.signature(fn).parameters
    if "progress" in params:
        assert params["progress"].default is True
    else:  # a sweep: options=None means SweepOptions(), whose progress is a bar
        from heads import SweepOptions

        assert params["options"].default is None and SweepOptions().progress is True


def test_progress_callback_modes(capsys):
    with progress_callback(None, "x") as a, progress_callback(False, "x") as b:
        assert a is None and b is None
    seen = []
    with progress_callback(lambda d, t: seen.append((d, t)), "x") as cb:
        cb(1, 2)
    assert seen == [(1, 2)]
    assert capsys.readouterr().err == ""
    with progress_callback(True, "my bar", "rows") as bar:
        bar(0, 4)
        bar(3, 4)
        bar(5, 5)  # the total may grow
    err = capsys.readouterr().err
    assert "my bar" in err and "5/5" in err and "rows" in err
    with pytest.raises(TypeError, match="progress must be"):
        with progress_callback("yes", "x"):
            pass
    assert offset_progress(False, 0, 3) is None


def test_ships_default_bar_and_silent_modes(tiny_llama, capsys):
    quiet = ships(tiny_llama, PROMPTS, heads=HEADS, max_rows=4, progress=False)
    assert capsys.readouterr().err == ""
    loud = ships(tiny_llama, PROMPTS, heads=HEADS, max_rows=4)
    err = capsys.readouterr().err
    total = len(HEADS) * len(PROMPTS)
    assert "ships" in err and f"{total}/{total}" in err
    assert (quiet.per_prompt.nan_to_num(-1) == loud.per_prompt.nan_to_num(-1)).all()  # a bar changes nothing
    with pytest.raises(TypeError, match="progress"):
        ships(tiny_llama, PROMPTS, heads=HEADS, progress="yes")


def test_nested_work_draws_one_bar(tiny_llama, capsys):
    rs = load_relations(tiny_llama.tokenizer, ["copying"], d_vocab=tiny_llama.d_vocab)
    res = maps_analysis(tiny_llama, rs, top=2, draws=1, n_prompts=3)
    err = capsys.readouterr().err
    n_rows = min(12, len(rs.relations[0].pairs))
    assert res.validation.n_prompts.tolist() == [3] and res.validation.dynamic_pairs.tolist() == [n_rows]
    total = tiny_llama.n_layers + (4 * -(-n_rows // 48) + tiny_llama.n_layers) + (2 + 1) + 1
    assert "MAPS analysis" in err and f"{total}/{total}" in err
    assert "MAPS static scores" not in err  # maps_scores got the outer callable, not a bar
    assert "dynamic scores" not in err and "ablation check" not in err  # nor did the later stages
    maps_scores(tiny_llama, [RelationPairs("r", [(5, 6)], 1)])
    assert "MAPS static scores" in capsys.readouterr().err


def test_generate_progress_in_decoding_steps(tiny_llama, capsys, monkeypatch):
    sm = SteeredModel(tiny_llama)
    few = ["Hello there", "Good morning"]
    sm.generate(few, max_new_tokens=3)
    assert capsys.readouterr().err == ""  # a short call stays quiet by default
    monkeypatch.setattr("steer.steered_model.BAR_DELAY_S", 0.0)  # a long call of few prompts still shows
    sm.generate(few, max_new_tokens=3)
    assert "generate" in capsys.readouterr().err
    many = [f"Item {i}: the" for i in range(BAR_MIN_PROMPTS + 1)]
    seen = []
    a = sm.generate(many, max_new_tokens=4, progress=lambda d, t: seen.append((d, t)))
    assert {t for _, t in seen} == {4} and seen[-1] == (4, 4)
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[0] >= 1
    b = sm.generate(many, max_new_tokens=4)
    err = capsys.readouterr().err
    assert "generate" in err and "4/4" in err
    c = sm.generate(many, max_new_tokens=4, progress=False)
    assert a.token_ids == b.token_ids == c.token_ids  # progress never changes the tokens
