"""Evaluation harness and profiling CLI (`headsteer eval`, `headsteer profile`) on a tiny model."""

import json

import pytest
import torch
from typer.testing import CliRunner

from heads import HeadSet, encode_prompts, forward
from probes.datasets.tasks import load_task
from probes.studies.evaluate import evaluate
from steer.act.calibration import choice_ids
from viz.cli.main import app

runner = CliRunner()


def test_choice_task_accuracy_matches_a_plain_forward(tiny_llama):
    res = evaluate(tiny_llama, "sentiment", "none", limit=6, batch_size=4)
    ex = load_task("sentiment", "test").examples[:6]
    enc = encode_prompts(tiny_llama.tokenizer, [e.prompt for e in ex], chat=False, markup=False)
    lp = torch.log_softmax(forward(tiny_llama, enc)[:, -1], -1).gather(
        1, choice_ids(tiny_llama.tokenizer, [e.choices for e in ex])
    )
    want = [int(row.argmax()) == e.label for row, e in zip(lp, ex, strict=True)]
    assert res.examples["correct"].tolist() == want
    row = res.table.iloc[0]
    assert row.metric == "accuracy" and row.n == 6 and row.value == pytest.approx(sum(want) / 6)
    assert row.low <= row.value <= row.high


@pytest.mark.parametrize("method", ["pasta", "spotlight", "act"])
def test_methods_run_and_change_the_answer_scores(tiny_llama, method, tmp_path):
    heads = tmp_path / "heads.json"
    HeadSet([(1, 0), (2, 1), (2, 3)]).save(heads)
    opts = {"pasta_heads": str(heads), "act_heads": str(heads), "tau": 0.5}
    res = evaluate(tiny_llama, "counterfact", method, limit=4, **opts)
    assert res.table.iloc[0].metric == "efficacy" and res.table.iloc[0].n == 4
    gen = evaluate(tiny_llama, "json_format", method, limit=2, max_new_tokens=3, **opts)
    assert list(gen.table.metric) == ["json_valid", "field_accuracy"]
    assert gen.examples.output.map(len).min() >= 1


def test_eval_bad_input(tiny_llama):
    with pytest.raises(ValueError, match="emphasized span"):
        evaluate(tiny_llama, "sentiment", "pasta", limit=2)
    with pytest.raises(ValueError, match="unknown method"):
        evaluate(tiny_llama, "sentiment", "magic", limit=2)
    with pytest.raises(ValueError, match="no shipped pasta head profile"):
        evaluate(tiny_llama, "counterfact", "pasta", limit=2)
    with pytest.raises(ValueError, match="limit"):
        evaluate(tiny_llama, "counterfact", "none", limit=0)


def test_eval_and_profile_cli(tiny_llama_dir, tmp_path):
    out = tmp_path / "eval.csv"
    r = runner.invoke(
        app,
        [
            "eval",
            "--method",
            "none",
            "--task",
            "occupation",
            "--limit",
            "3",
            "--model",
            tiny_llama_dir,
            "--out",
            str(out),
            "--json",
            "--quiet",
        ],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout.strip().splitlines()[-1])
    rows = data["table"]
    assert rows[0]["metric"] == "top1" and rows[0]["n"] == 3 and data["csv"] == str(out)
    assert out.exists() and out.with_suffix(".examples.csv").exists()
    prof = tmp_path / "pasta.json"
    r = runner.invoke(
        app,
        [
            "profile",
            "pasta",
            "--out",
            str(prof),
            "--task",
            "counterfact",
            "--examples",
            "2",
            "--heads",
            "3",
            "--model",
            tiny_llama_dir,
            "--json",
            "--quiet",
        ],
    )
    assert r.exit_code == 0, r.output
    assert len(HeadSet.parse(str(prof))) >= 3
    assert (tmp_path / "pasta.counterfact.scores.json").exists()
    act = tmp_path / "act.json"
    r = runner.invoke(
        app,
        [
            "profile",
            "act",
            "--out",
            str(act),
            "--examples",
            "2",
            "--model",
            tiny_llama_dir,
            "--json",
            "--quiet",
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(act.read_text()) is not None
    r = runner.invoke(
        app,
        [
            "eval",
            "--method",
            "act",
            "--task",
            "sentiment",
            "--limit",
            "2",
            "--act-heads",
            str(prof),
            "--model",
            tiny_llama_dir,
            "--out",
            str(tmp_path / "act.csv"),
            "--quiet",
        ],
    )
    assert r.exit_code == 0, r.output
    for bad, msg in (
        (["eval", "--method", "x", "--task", "sentiment"], "unknown --method"),
        (["eval", "--method", "none", "--task", "poetry"], "unknown --task"),
        (["eval", "--method", "none", "--task", "sentiment", "--split", "dev"], "unknown --split"),
        (["profile", "act", "--out", str(tmp_path / "a.json"), "--task", "json_format"], "choice task"),
        (["profile", "pasta", "--out", str(tmp_path / "a.txt")], ".json"),
        (["profile", "pasta", "--out", str(tmp_path / "b.json"), "--heads", "1000"], "more than"),
        (["eval", "--method", "none", "--task", "sentiment", "--limit", "0"], "--limit"),
        (["eval", "--method", "none", "--task", "sentiment", "--out", str(tmp_path)], "folder"),
    ):
        r = runner.invoke(app, [*bad, "--model", tiny_llama_dir])
        assert r.exit_code == 2 and msg in r.output, (bad, r.output)


def test_profile_act_files_hold_each_heads_margin_gain(tokenizer, tmp_path):
    """`profile act`: the scores file holds, per candidate head (layers 2..L-2), the mean margin
    log p(right) - max log p(other) with ACT on that head alone minus the base model's (each
    recomputed here with one plain forward), and the profile keeps exactly the heads whose gain
    is above 0 (by more than float noise, 1e-4)."""
    from heads import HeadScores, editing
    from steer import Act
    from tests.support import make_tiny

    hm = make_tiny("llama", tokenizer, num_hidden_layers=5)
    folder = tmp_path / "tiny5"
    hm.model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    act = tmp_path / "act.json"
    args = ["profile", "act", "--out", str(act), "--examples", "3", "--model", str(folder), "--quiet"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    gains = HeadScores.load(tmp_path / "act.scores.json").scores
    ex = load_task("sentiment", "train").examples[:3]
    enc = encode_prompts(tokenizer, [e.prompt for e in ex], chat=ex[0].chat, markup=False)
    ids = choice_ids(tokenizer, [e.choices for e in ex])
    labels = torch.tensor([e.label for e in ex])

    def margin(edits) -> float:
        with torch.no_grad(), editing(hm, edits):
            lp = torch.log_softmax(forward(hm, enc)[:, -1].float(), -1).gather(1, ids)
        right = lp.gather(1, labels[:, None])[:, 0]
        other = lp.scatter(1, labels[:, None], -torch.inf).max(-1).values
        return float((right - other).mean())

    base = margin([])
    want = torch.full_like(gains, float("nan"))
    for la in (2, 3):
        for h in range(hm.n_heads):
            want[la, h] = margin(Act(heads={la: [h]}, beta=0.4).edits(hm, enc)) - base
    torch.testing.assert_close(gains, want, atol=1e-5, rtol=0, equal_nan=True)
    assert float(want[2:4].abs().max()) > 1e-4  # ACT moves the margin
    kept = {(la, h) for la in (2, 3) for h in range(hm.n_heads) if want[la, h] > 1e-4}
    assert set(HeadSet.parse(str(act)).heads) == kept
