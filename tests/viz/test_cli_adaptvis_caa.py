"""AdaptVis / ScalingVis in `headsteer generate` and `headsteer vision generate`, and AdaptVis /
ScalingVis / CAA in `headsteer eval`: options refused before the model loads, the library's bounds,
and runs on a tiny model that equal the Python API."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from typer.testing import CliRunner

from probes.studies.evaluate import CAA_COEFFICIENT, caa_pairs, evaluate, fit_caa
from steer import AdaptVis, Caa, ScalingVis, SteeredModel, caa_vector
from tests.support.cli import one_line_error
from viz.cli.main import app

runner = CliRunner()
_one_line_error = partial(one_line_error, ignore=("loading ", "warning: "))
PASSAGE = "Context: **the key is blue.** What colour?"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steer", "adaptvis", "--weight", "2"], "--weight is not used by --steer adaptvis"),
        (
            ["--steer", "adaptvis", "--alpha", "3", "--p", "0.2"],
            "--alpha, --p are not used by --steer adaptvis",
        ),
        (["--steer", "scalingvis", "--threshold", "0.9"], "--threshold is not used by --steer scalingvis"),
        (["--steer", "vhr", "--weight1", "0.9"], "--weight1 is not used by --steer vhr"),
        (["--steer", "var", "--weight2", "3"], "--weight2 is not used by --steer var"),
        (["--steer", "adaptvis", "--threshold", "2"], "threshold must be in [0, 1]"),
        (["--steer", "adaptvis", "--weight1", "-1"], "weight1 must be in [0, 100]"),
        (["--steer", "scalingvis", "--weight", "1e9"], "weight must be in [0, 100]"),
        (["--steer", "nope"], "--steer must be one of var, vhr, adaptvis, scalingvis"),
    ],
)
def test_vision_generate_options_before_load(no_load, args, message):
    _one_line_error(runner.invoke(app, ["vision", "generate", PASSAGE, *args]), message)


@pytest.mark.parametrize("steer", ["adaptvis", "scalingvis"])
def test_generate_refuses_pasta_options_for_adaptvis(no_load, steer):
    r = runner.invoke(app, ["generate", PASSAGE, "--steer", steer, "--alpha", "0.1", "--multiplier", "3"])
    _one_line_error(r, f"--alpha, --multiplier are not used by --steer {steer}")
    _one_line_error(runner.invoke(app, ["generate", "no passage", "--steer", steer]), "no **marked** context")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "adaptvis", "--threshold", "2"], "threshold must be in [0, 1]"),
        (["--method", "adaptvis", "--weight", "2"], "--weight is not used by --method adaptvis"),
        (["--method", "scalingvis", "--weight", "-3"], "weight must be in [0, 100]"),
        (["--method", "scalingvis", "--weight1", "3"], "--weight1 is not used by --method scalingvis"),
        (["--method", "caa", "--caa-coefficient", "nan"], "CAA coefficient must be a finite number"),
        (["--method", "caa", "--caa-layer", "-1"], "--caa-layer must be >= 0"),
        (["--method", "pasta", "--caa-layer", "3"], "--caa-layer is not used by --method pasta"),
        (["--method", "caa", "--task", "json_format"], "--method caa needs a choice task"),
        (["--method", "adaptvis", "--task", "sentiment"], "needs an emphasized span"),
    ],
)
def test_eval_options_before_load(no_load, tmp_path, args, message):
    task = [] if "--task" in args else ["--task", "counterfact"]
    r = runner.invoke(app, ["eval", *task, "--out", str(tmp_path / "e.csv"), *args])
    _one_line_error(r, message)


def test_eval_caa_default_is_the_library_default():
    import inspect

    from viz.cli.eval import eval_command

    assert inspect.signature(eval_command).parameters["caa_coefficient"].default == CAA_COEFFICIENT


def test_vision_generate_adaptvis_and_generate_scalingvis_equal_the_api(tiny_llama_dir, tiny_llama):
    sm = SteeredModel(tiny_llama)
    args = ["--model", tiny_llama_dir, "--max-new-tokens", "4", "--json"]
    r = runner.invoke(
        app,
        ["vision", "generate", PASSAGE, "--steer", "adaptvis", "--weight1", "0.3", "--threshold", "1", *args],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout.strip().splitlines()[-1])
    method = AdaptVis(weight1=0.3, threshold=1.0)
    want = sm.generate([PASSAGE], method, max_new_tokens=4, progress=False)
    assert data["steered"] == want.text and data["steer"] == "adaptvis"
    assert data["weight"] == pytest.approx(0.3) and 0 < data["confidence"] <= 1  # threshold 1: weight1
    assert data["baseline"] == sm.generate([PASSAGE], [], max_new_tokens=4, progress=False).text
    r = runner.invoke(app, ["generate", PASSAGE, "--steer", "scalingvis", *args])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout.strip().splitlines()[-1])
    assert data["steered"] == sm.generate([PASSAGE], ScalingVis(), max_new_tokens=4, progress=False).text


def test_caa_pairs_are_balanced_right_against_wrong():
    pairs = caa_pairs("counterfact")
    from probes.datasets.tasks import load_task

    ex = load_task("counterfact", "train").examples
    assert len(pairs) == len(ex) == 90
    assert pairs[0] == (f"{ex[0].prompt} {ex[0].choices[0]}", f"{ex[0].prompt} {ex[0].choices[1]}")
    occ = load_task("occupation", "train").examples
    wrong = [p[1].removeprefix(e.prompt + " ") for p, e in zip(caa_pairs("occupation"), occ, strict=True)]
    assert all(w != e.choices[e.label] and w in e.choices for w, e in zip(wrong, occ, strict=True))
    assert len(set(wrong)) > 5  # the wrong answers cycle through the other occupations
    with pytest.raises(ValueError, match="CAA needs a choice task"):
        caa_pairs("json_format")


def test_eval_caa_and_adaptvis_cli_equal_the_api(tiny_llama_dir, tiny_llama, tmp_path):
    caa = fit_caa(tiny_llama, "counterfact", layer=1, coefficient=3.0, limit=None)
    torch.testing.assert_close(
        caa.vector, caa_vector(tiny_llama, caa_pairs("counterfact"), 1, progress=False)
    )
    assert caa.coefficient == 3.0 and caa.layer == 1
    from heads import editing, encode_prompts, forward

    enc = encode_prompts(tiny_llama.tokenizer, [pairs[0] for pairs in caa_pairs("counterfact", "test", 2)])
    with editing(tiny_llama, caa.edits(tiny_llama, enc)):
        steered = forward(tiny_llama, enc)[:, -1]
    assert (steered - forward(tiny_llama, enc)[:, -1]).abs().max() > 1e-3  # the vector acts
    want = evaluate(tiny_llama, "counterfact", "caa", limit=6, caa=Caa(caa.vector, 1, 3.0), progress=False)
    out = tmp_path / "caa.csv"
    base = ["eval", "--task", "counterfact", "--limit", "6", "--model", tiny_llama_dir, "--json", "--force"]
    r = runner.invoke(
        app, [*base, "--method", "caa", "--caa-layer", "1", "--caa-coefficient", "3", "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.strip().splitlines()[-1])["table"][0]
    assert got["value"] == pytest.approx(want.table.value[0]) and got["n"] == 6
    ex = __import__("pandas").read_csv(out.with_suffix(".examples.csv"))
    assert ex["predicted"].tolist() == want.examples["predicted"].tolist()
    av = evaluate(tiny_llama, "counterfact", "adaptvis", limit=6, threshold=1.0, weight1=3.0, progress=False)
    r = runner.invoke(
        app,
        [
            *base,
            "--method",
            "adaptvis",
            "--threshold",
            "1",
            "--weight1",
            "3",
            "--out",
            str(tmp_path / "a.csv"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["table"][0]["value"] == pytest.approx(
        av.table.value[0]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "caa", "--caa-layer", "2"], "--caa-layer 2 is outside 0..1: the model has 3 layers"),
        (["--method", "caa", "--caa-layer", "99"], "--caa-layer 99 is outside 0..1"),
        (["--method", "iti", "--iti-k", "13"], "--iti-k 13 is more than the model's 12 heads (3 layers x 4)"),
    ],
)
def test_eval_geometry_options_checked_from_the_config_before_load(
    no_load, tiny_llama, tiny_llama_dir, tmp_path, args, message
):
    """`--caa-layer` / `--iti-k` beyond the model's layers / heads: one line, exit 2, from the
    config alone (the weights are never loaded: `no_load`)."""
    assert (tiny_llama.n_layers, tiny_llama.n_heads) == (3, 4)
    r = runner.invoke(
        app,
        ["eval", "--model", tiny_llama_dir, "--task", "sentiment", "--out", str(tmp_path / "e.csv"), *args],
    )
    _one_line_error(r, message)


_HEAD_FILE_COMMANDS = {
    "eval pasta": ["eval", "--method", "pasta", "--task", "counterfact", "--pasta-heads"],
    "eval act": ["eval", "--method", "act", "--task", "counterfact", "--act-heads"],
    "generate": ["generate", "the **key** is", "--pasta-heads"],
}


@pytest.mark.parametrize("command", sorted(_HEAD_FILE_COMMANDS))
@pytest.mark.parametrize(
    ("heads", "message"),
    [
        ({"3": [0]}, "names layer 3, head 0, outside the model: it has layers 0..2 and heads 0..3 per layer"),
        ({"0": [1], "2": [4]}, "names layer 2, head 4, outside the model: it has layers 0..2 and heads 0..3"),
    ],
)
def test_head_files_checked_from_the_config_before_load(
    no_load, tiny_llama_dir, tmp_path, command, heads, message
):
    """A head file naming a layer or head the model (3 layers x 4 heads) lacks: one line, exit
    2, from the config alone (`no_load`); a file inside the model passes on to the loading."""
    f = tmp_path / "h.json"
    args = [*_HEAD_FILE_COMMANDS[command], str(f), "--model", tiny_llama_dir]
    if command != "generate":
        args += ["--out", str(tmp_path / "e.csv")]
    option = args[args.index(str(f)) - 1]
    f.write_text(json.dumps(heads))
    _one_line_error(runner.invoke(app, args), f"{option} {str(f)!r} {message}")
    f.write_text(json.dumps({"0": [0], "2": [3]}))
    r = runner.invoke(app, args)
    assert r.exit_code == 1 and "internal error: AssertionError: the model was loaded" in r.output, r.output


def test_read_geometry_equals_the_loaded_model(tiny_llama, tiny_llama_dir):
    from heads.model.loading import read_geometry

    assert read_geometry(tiny_llama_dir) == (tiny_llama.n_layers, tiny_llama.n_heads)


def test_profile_pasta_heads_checked_from_the_config_before_load(no_load, tiny_llama_dir, tmp_path):
    r = runner.invoke(
        app,
        ["profile", "pasta", "--model", tiny_llama_dir, "--heads", "13", "--out", str(tmp_path / "p.json")],
    )
    _one_line_error(r, "--heads 13 is more than the model's 12 heads")


def test_eval_writes_results_in_the_current_directory_as_the_caa_page_says(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """Without --out, `headsteer eval` writes `results/TASK.METHOD.SPLIT.csv` and its
    `.examples.csv` in the current directory, and nothing else; docs/methods/caa.md says so."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs/methods/caa.md").read_text()
    for text in (
        "**current directory**",
        "results/counterfact.caa.test.csv",
        ".examples.csv",
        "--out FILE.csv",
    ):
        assert text in page, text
    monkeypatch.chdir(tmp_path)
    args = ["eval", "--model", tiny_llama_dir, "--method", "caa", "--task", "sentiment", "--limit", "2"]
    r = runner.invoke(app, [*args, "--caa-layer", "1", "--quiet"])
    assert r.exit_code == 0, r.output
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["results/sentiment.caa.test.csv", "results/sentiment.caa.test.examples.csv"]
