"""Prompting baselines: the instruction table, `evaluate(prompt=True)`, the four-condition report
with paired bootstrap intervals, and `headsteer eval --prompt / --baselines` (tiny model).

Oracles: a plain forward on the instructed prompts written here, and cases whose bootstrap
answer is known (a constant difference; a fair coin's interval width).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from heads import HeadSet, encode_prompts, forward
from heads.errors import HeadsteerValueError
from probes.datasets.instructions import INSTRUCTIONS, with_instruction
from probes.datasets.tasks import TASKS, load_task
from probes.studies.baselines import baseline_table, bootstrap_interval, evaluate_baselines
from probes.studies.evaluate import evaluate
from steer.act.calibration import choice_ids
from tests.support.cli import one_line_error
from viz.cli.main import app

runner = CliRunner()


def test_every_task_has_an_instruction_that_keeps_the_span():
    assert set(INSTRUCTIONS) == set(TASKS)
    for task in TASKS:
        for e in load_task(task).examples:
            got = with_instruction(e)
            assert got.prompt == f"{INSTRUCTIONS[task]}\n{e.prompt}"
            assert got.emphasize == e.emphasize and got.choices == e.choices and got.label == e.label
            if e.emphasize:
                assert got.prompt.count(e.emphasize) == 1


def test_prompt_baseline_matches_a_plain_forward(tiny_llama):
    res = evaluate(tiny_llama, "sentiment", "none", limit=5, batch_size=5, prompt=True)
    ex = load_task("sentiment", "test").examples[:5]
    texts = [INSTRUCTIONS["sentiment"] + "\n" + e.prompt for e in ex]
    enc = encode_prompts(tiny_llama.tokenizer, texts, chat=False, markup=False)
    lp = torch.log_softmax(forward(tiny_llama, enc)[:, -1], -1).gather(
        1, choice_ids(tiny_llama.tokenizer, [e.choices for e in ex])
    )
    want = [int(row.argmax()) == e.label for row, e in zip(lp, ex, strict=True)]
    assert res.examples["correct"].tolist() == want
    assert bool(res.table.prompt.iloc[0]) and "prompt" in repr(res)


def test_bootstrap_table_on_known_cases():
    ids = [f"t-{i}" for i in range(40)]
    frame = lambda v: pd.DataFrame({"id": ids, "correct": v})  # noqa: E731
    rng = np.random.default_rng(1)
    base = rng.integers(0, 2, 40).astype(bool)
    t = baseline_table(
        "counterfact",
        "pasta",
        {
            "none": frame(base),
            "prompt": frame(np.zeros(40, bool)),
            "method": frame(np.ones(40, bool)),
            "prompt + method": frame(np.zeros(40, bool)),
        },
    )
    row = t.set_index("condition")
    assert row.loc["method", "diff"] == 1.0 and row.loc["method", "diff_low"] == 1.0
    assert bool(row.loc["method", "beats_prompt"])
    assert not row.loc["prompt + method", "beats_prompt"]  # equal to the prompt: does not beat it
    assert row.loc["none", "low"] <= base.mean() <= row.loc["none", "high"]
    lo, hi = bootstrap_interval(np.r_[np.ones(200), np.zeros(200)], n_boot=2000)
    assert hi - lo == pytest.approx(2 * 1.96 * 0.5 / np.sqrt(400), rel=0.15)  # the normal width
    with pytest.raises(HeadsteerValueError, match="'prompt' condition"):
        baseline_table("counterfact", "pasta", {"none": frame(base)})


def test_evaluate_baselines_runs_the_four_conditions(tiny_llama, tmp_path):
    heads = tmp_path / "heads.json"
    HeadSet([(1, 0), (2, 1)]).save(heads)
    res = evaluate_baselines(
        tiny_llama, "counterfact", "pasta", limit=3, pasta_heads=str(heads), progress=False
    )
    assert list(res.table.condition) == ["none", "prompt", "method", "prompt + method"]
    none = evaluate(tiny_llama, "counterfact", "none", limit=3, progress=False)
    assert res.table.value.iloc[0] == pytest.approx(none.table.value.iloc[0])
    assert len(res.examples) == 12 and set(res.examples.condition) == {
        "none",
        "prompt",
        "method",
        "prompt + method",
    }
    with pytest.raises(HeadsteerValueError, match="method must be"):
        evaluate_baselines(tiny_llama, "counterfact", "none", limit=3)


def test_cli_prompt_and_baselines(tiny_llama_dir, tmp_path):
    base = ["eval", "--task", "counterfact", "--limit", "2", "--model", tiny_llama_dir, "--quiet", "--force"]
    out = tmp_path / "b.csv"
    r = runner.invoke(app, [*base, "--method", "spotlight", "--baselines", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout.strip().splitlines()[-1])
    assert [row["condition"] for row in data["table"]] == ["none", "prompt", "method", "prompt + method"]
    assert out.exists() and out.with_suffix(".examples.csv").exists()
    r = runner.invoke(app, [*base, "--method", "none", "--prompt", "--out", str(tmp_path / "p.csv")])
    assert r.exit_code == 0, r.output
    assert bool(pd.read_csv(tmp_path / "p.csv").prompt.iloc[0])
    one_line_error(runner.invoke(app, [*base, "--method", "none", "--baselines"]), "--baselines")
    one_line_error(runner.invoke(app, [*base, "--method", "pasta", "--baselines", "--prompt"]), "--baselines")
