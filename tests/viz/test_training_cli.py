"""`headsteer build organism` and `headsteer report training`: the files written, resume, bad input
before any work."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from tests.support.cli import one_line_error
from tests.support.organism import tiny_run
from viz.cli.main import app

runner = CliRunner()


def test_build_organism_writes_loadable_checkpoints_and_needs_force(tmp_path):
    out = tmp_path / "org"
    args = ["build", "organism", "--out", str(out), "--only", "attn-only", "--steps", "2", "--quiet"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "organism.json").read_text())
    assert [s["name"] for s in manifest["specs"]] == ["attn-only"] and manifest["specs"][0]["steps"] == 2
    from heads import load_model

    hm = load_model(out / "attn-only" / "step-000002")
    assert (hm.n_layers, hm.n_heads) == (2, 4)
    one_line_error(runner.invoke(app, args), "--force")
    one_line_error(runner.invoke(app, [*args[:-3], "--only", "gpt", "--quiet"]), "--only must be one of")


def test_build_organism_force_keeps_other_files_and_prints_every_path(tmp_path):
    out = tmp_path / "org"
    args = ["build", "organism", "--out", str(out), "--only", "attn-only", "--steps", "1", "--quiet"]
    assert runner.invoke(app, args).exit_code == 0
    (out / "NOTES.txt").write_text("mine")
    (out / "attn-only" / "NOTES.txt").write_text("mine")
    r = runner.invoke(app, [*args, "--force", "--seed", "3"])
    assert r.exit_code == 0, r.output
    assert (out / "NOTES.txt").read_text() == "mine"
    assert (out / "attn-only" / "NOTES.txt").read_text() == "mine"
    run = out / "attn-only"
    want = [run / "step-000000", run / "step-000001", run / "training_log.json", out / "organism.json"]
    assert [ln for ln in r.output.splitlines() if ln.startswith("wrote ")] == [f"wrote {p}" for p in want]


def test_report_training_writes_the_page_and_resumes(tmp_path):
    run = tiny_run(tmp_path / "run")
    out = tmp_path / "rep" / "training.html"
    args = [
        "report",
        "training",
        "--checkpoints",
        str(run),
        "--out",
        str(out),
        "--analysis",
        "icl",
        "--quiet",
    ]
    r = runner.invoke(app, [*args, "--params", '{"icl": {"n": 2, "length": 6}}', "--json"])
    assert r.exit_code == 0, r.output
    page = out.read_text()
    assert "icl_score" in page and "Checkpoints" in page
    parts = sorted((tmp_path / "rep" / "training_checkpoints" / "icl").glob("step-*.json"))
    assert [p.name for p in parts] == [f"step-{s:09d}.json" for s in (0, 1, 2, 4)]
    stamps = [p.stat().st_mtime_ns for p in parts]
    summary = json.loads(r.stdout)
    assert [c["step"] for c in summary["checkpoints"]] == [0, 1, 2, 4]
    # a rerun of the same run reuses every part (the page needs --force)
    r = runner.invoke(app, [*args, "--params", '{"icl": {"n": 2, "length": 6}}', "--force"])
    assert r.exit_code == 0, r.output
    assert [p.stat().st_mtime_ns for p in parts] == stamps
    # other parameters: the parts belong to another run (refused unless --force discards them)
    out.unlink()
    one_line_error(runner.invoke(app, [*args, "--params", '{"icl": {"n": 3, "length": 6}}']), "another run")
    assert [p.stat().st_mtime_ns for p in parts] == stamps


def test_report_training_bad_input_is_one_line_before_any_model(tmp_path, no_load):
    base = ["report", "training", "--out", str(tmp_path / "t.html")]
    cases = [
        (["--checkpoints", str(tmp_path / "missing")], "no such folder"),
        (["--checkpoints", str(tmp_path), "--analysis", "nope"], "--analysis 'nope'"),
        (["--checkpoints", str(tmp_path), "--model", "x"], "--model is not used"),
        (["--checkpoints", str(tmp_path), "--params", "{"], "--params"),
        (["--checkpoints", str(tmp_path), "--task", "colored_objects"], "--task is used only"),
    ]
    for extra, message in cases:
        one_line_error(runner.invoke(app, [*base, *extra]), message)
