"""`headsteer demo`: the metric before / after PASTA is measured in the run (equal to
`evaluate` on the same examples), the printed answers are PASTA's fixes, cut at the stop rule."""

from __future__ import annotations

import io
import warnings

from rich.console import Console

from probes.studies.evaluate import evaluate
from viz.cli.demo import DEMO_TASKS, STOP, run_demo, until_stop


def test_until_stop():
    assert until_stop(" Warsaw. Then more") == " Warsaw."
    assert until_stop(" a nurse\nnext") == " a nurse\n"
    assert until_stop(" no stop here") == " no stop here"


def test_demo_measures_the_effect_and_cuts_answers(tiny_llama, tmp_path):
    buf = io.StringIO()
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny model has no shipped profile: span heuristic
        res = run_demo(
            tmp_path,
            model=tiny_llama,
            n=3,
            max_new_tokens=4,
            console=Console(file=buf, width=160),
            progress=lambda d, t: seen.append((d, t)),
        )
    assert [e["task"] for e in res["effects"]] == list(DEMO_TASKS)
    for eff in res["effects"]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = evaluate(tiny_llama, eff["task"], "none", limit=3, progress=False)
            steer = evaluate(
                tiny_llama, eff["task"], "pasta", limit=3, pasta_heads=res["heads"], progress=False
            )
        assert eff["baseline"] == base.table.value.iloc[0] and eff["steered"] == steer.table.value.iloc[0]
        b, s = base.examples.correct, steer.examples.correct
        assert eff["fixed"] == int((~b & s).sum()) and eff["broken"] == int((b & ~s).sum())
        assert f"{eff['baseline']:.2f}" in buf.getvalue()
    for ex in res["examples"]:
        assert ex["steered_choice"] == ex["answer"] != ex["baseline_choice"]  # a fix, not any change
        for text in (ex["baseline"], ex["steered"]):
            cut = [text.find(s) for s in STOP if s in text]
            assert not cut or min(cut) + 1 == len(text)  # nothing after the first stop string
    assert seen[-1] == (8, 8)  # 2 * max_new_tokens over the whole run
    assert (tmp_path / "demo_report.html").is_file() and (tmp_path / "demo_report.csv").is_file()
