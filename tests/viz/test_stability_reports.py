"""Stability in the reports: error bars and the stable top-k marker on the patching and circuit
pages (`--stability`), and `stability_bars` itself."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from heads.results.stability import stability_of
from probes.datasets.pairs import load_task_pairs
from tests.support.cli import one_line_error
from viz.cli.main import app
from viz.figures import stability_bars
from viz.reports.patching import patching_report


def test_stability_bars_marks_the_stable_heads():
    v = torch.randn(10, 2, 3, generator=torch.Generator().manual_seed(0)) * 0.1
    v[:, 0, 1] += 3.0
    fig = stability_bars(stability_of(v, n_resamples=20, k=2))
    bar = fig.data[0]
    assert bar.x[0] == "L0.H1 *" and not any(x.endswith("*") for x in bar.x[1:])
    lo = [s - m for s, m in zip(bar.y, bar.error_y.arrayminus, strict=True)]
    assert all(a <= b for a, b in zip(lo, bar.y, strict=True))


def test_patching_page_shows_stability(tmp_path, tiny_llama):
    out = tmp_path / "p.html"
    pairs = load_task_pairs("ioi", n=4)
    _, summary = patching_report(tiny_llama, out, pairs, progress=False, stability=10)
    page = out.read_text(encoding="utf-8")
    assert "Stability of the patching ranking" in page and "Stability of the direct logit attribution" in page
    assert summary["stability"]["n_resamples"] == 10 and 0 <= summary["stability"]["jaccard_mean"] <= 1


def test_cli_report_circuit_stability(tiny_llama_dir, tmp_path):
    out = tmp_path / "c.html"
    args = [
        "report",
        "circuit",
        "--out",
        str(out),
        "--model",
        tiny_llama_dir,
        "--pairs",
        "3",
        "--sizes",
        "10,100",
    ]
    r = CliRunner().invoke(app, [*args, "--method", "eap", "--size", "10", "--stability", "8", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["stability"]["n_resamples"] == 8
    page = out.read_text()
    assert "Edge inclusion frequency" in page and "Edge stability" in page
    one_line_error(CliRunner().invoke(app, [*args, "--stability", "1", "--force"]), "--stability")


def test_atlas_columns_and_page_show_stability(tmp_path, tiny_llama):
    from heads.scorers.roles import HeadAtlas, head_atlas
    from heads.scorers.roles.detectors import pattern_scores
    from viz.reports.atlas import render_atlas_report

    det = pattern_scores(tiny_llama, stability=10)
    atlas = head_atlas(tiny_llama, detectors=det, thumbnails=False)
    p = det["induction"].stability.p_top_k.numpy()
    assert (atlas.frame["induction_p_top_k"].to_numpy() == p).all()
    assert atlas.sources["induction"]["stability"]["n_resamples"] == 10
    back = HeadAtlas.load(atlas.save(tmp_path / "a.json"))
    assert back.sources["induction"]["stability"] == atlas.sources["induction"]["stability"]
    page = render_atlas_report(atlas).to_html()
    assert "Stability of the role rankings" in page and "induction_p_top_k" in page
