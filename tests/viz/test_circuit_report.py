"""`headsteer report circuit` and the circuit figures on a tiny model (real IOI pairs)."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from heads.scorers.circuits import Circuit, select
from heads.scorers.circuits.scores import edge_scores
from viz.circuits import circuit_figure, curve_figure
from viz.cli.main import app
from viz.reports.circuit import task_pairs


def test_circuit_figure_and_curve(tiny_llama):
    pairs = task_pairs(tiny_llama, "ioi", 2)
    c = select(edge_scores(tiny_llama, pairs, method="eap", progress=False), 15)
    fig = circuit_figure(c)
    widths = {t.line.width for t in fig.data if t.mode == "lines"}
    assert len(widths) >= 1 and all(w > 0 for w in widths)
    colors = {t.line.color for t in fig.data if t.mode == "lines"}
    signs = set(torch.sign(c.scores[c.mask]).tolist())
    assert len(colors) == len(signs - {0.0})
    curve = {"sizes": [1, 100], "faithfulness": [0.2, 1.0], "cpr": 0.6, "cmd": 0.4}
    assert len(curve_figure(curve).data) == 1


def test_cli_report_circuit(tiny_llama_dir, tmp_path):
    out = tmp_path / "c.html"
    args = ["report", "circuit", "--out", str(out), "--model", tiny_llama_dir, "--pairs", "2"]
    args += ["--sizes", "10,100"]
    r = CliRunner().invoke(app, [*args, "--method", "eap", "--size", "10", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert out.is_file() and data["edges"] >= 0 and 0 <= data["cpr"] <= 1.5
    back = Circuit.load(data["circuit"])
    assert back.n_edges == data["edges"]
    assert "Faithfulness curve" in out.read_text()
    r = CliRunner().invoke(app, [*args, "--method", "acdc"])
    assert r.exit_code != 0 and "--method" in r.output
    r = CliRunner().invoke(app, [*args, "--size", "0", "--force"])
    assert r.exit_code != 0 and "--size" in r.output


def test_cli_report_circuit_one_size_writes_both_files(tiny_llama_dir, tmp_path):
    """One curve size: no area under the curve (cpr / cmd NaN). The report still writes its page
    and its circuit JSON (NaN as null, read back as NaN), and exits 0."""
    import math

    out = tmp_path / "a.html"
    args = ["report", "circuit", "--out", str(out), "--model", tiny_llama_dir, "--pairs", "2"]
    r = CliRunner().invoke(app, [*args, "--sizes", "5", "--method", "eap", "--quiet"])
    assert r.exit_code == 0, r.output
    js = out.with_suffix(".json")
    assert out.is_file() and js.is_file()
    assert json.loads(js.read_text())["curve"]["cpr"] is None
    assert math.isnan(Circuit.load(js).curve["cpr"])
