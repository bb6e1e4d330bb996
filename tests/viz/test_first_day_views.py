"""Views that do not mislead (issue 40, items 4 and 5): one centred diverging convention with its
sign written on each figure, the circuit report's default size, heads-only graph, curve ticks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from heads import HeadScores
from viz.figures import DIVERGING, head_heatmap

ROOT = Path(__file__).resolve().parents[2]


def test_signed_heatmaps_put_white_at_zero_and_say_their_sign():
    t = torch.tensor([[-0.1, 0.05], [0.37, 0.0]])  # (min + max) / 2 = 0.135: not the centre
    for kw in ({}, {"colorscale": "RdBu"}, {"colorscale": "RdBu_r"}):
        fig = head_heatmap(HeadScores(t, "x"), **kw)
        hm = fig.data[0]
        assert hm.zmin == pytest.approx(-0.37) and hm.zmax == pytest.approx(0.37)  # symmetric about 0
        stops = [list(s) for s in hm.colorscale]
        assert stops == [list(s) for s in DIVERGING]
        mid = [c for p, c in stops if p == 0.5][0]
        assert mid == "#f7f7f7"  # white sits at (0 - zmin) / (zmax - zmin) = 0.5, i.e. at 0
        assert int(stops[0][1][1:3], 16) < int(stops[0][1][5:7], 16)  # low end blue, high end red
        assert int(stops[-1][1][1:3], 16) > int(stops[-1][1][5:7], 16)
    unsigned = head_heatmap(HeadScores(t.abs(), "x")).data[0]
    assert unsigned.colorscale[0][1] != DIVERGING[0][1]  # Viridis for unsigned scores
    noising = HeadScores(t, "patching.path", {"direction": "noising"})
    words = " ".join(a.text for a in head_heatmap(noising).layout.annotations)
    assert "noising" in words and "red" in words
    denoise = HeadScores(t, "patching.head_out", {"direction": "denoising"})
    assert "denoising" in " ".join(a.text for a in head_heatmap(denoise).layout.annotations)


def test_one_colour_convention_in_python_and_in_the_explorer_page():
    page = (ROOT / "viz" / "explorer" / "page.html").read_text()
    m = re.search(r"const DIVERGING = (\[.*?\]\]);", page)
    assert m and json.loads(m.group(1)) == DIVERGING
    named = re.compile(r"colorscale\s*[:=]\s*[\"'](?:RdBu|RdBu_r)[\"']")
    for path in [*ROOT.joinpath("viz").rglob("*.py"), ROOT / "viz" / "explorer" / "page.html"]:
        assert not named.search(path.read_text()), f"{path} names a plotly diverging scale"


def test_curve_axis_labels_each_measured_size_once():
    from viz.circuits import curve_figure

    curve = {"sizes": [0.1, 0.2, 0.5, 1, 2, 5, 10], "faithfulness": [0.1] * 7, "cpr": 0.1, "cmd": 0.9}
    ax = curve_figure(curve).layout.xaxis
    assert ax.type == "log" and list(ax.tickvals) == curve["sizes"]
    assert list(ax.ticktext) == ["0.1", "0.2", "0.5", "1", "2", "5", "10"]


def test_heads_only_view_and_threshold(tiny_llama):
    from heads.scorers.circuits import select
    from heads.scorers.circuits.scores import edge_scores
    from viz.circuits import circuit_figure
    from viz.reports.circuit import task_pairs

    c = select(edge_scores(tiny_llama, task_pairs(tiny_llama, "ioi", 2), method="eap", progress=False), 60)

    def drawn(fig):
        return sum(len([x for x in t.x if x is not None]) // 2 for t in fig.data if t.mode == "lines")

    # by the edges' names: a head ("a3.h1") into a head's q / k / v ("a5.h0<q>", "a5.g1<k>") or the logits
    names = [n.split("->") for n in c.edge_names()]
    want = sum(src.startswith("a") and (dst.startswith("a") or dst == "logits") for src, dst in names)
    assert 0 < want < c.n_edges
    assert drawn(circuit_figure(c, heads_only=True)) == want
    assert drawn(circuit_figure(c)) == c.n_edges
    e = c.edges
    s = c.scores[e[:, 0], e[:, 1]].abs()
    t = float(s.median())
    assert drawn(circuit_figure(c, threshold=t)) == int((s >= t).sum())
    with pytest.raises(ValueError, match="threshold"):
        circuit_figure(c, threshold=-1.0)


def test_report_circuit_default_size_from_the_curve(tiny_llama_dir, tmp_path, monkeypatch):
    import viz.reports.circuit as report
    from heads.scorers.circuits import DEFAULT_FAITHFULNESS, Circuit
    from viz.cli.main import app

    drawn = []
    figure = report.circuit_figure
    monkeypatch.setattr(report, "circuit_figure", lambda c, **k: drawn.append(k) or figure(c, **k))

    out = tmp_path / "c.html"
    args = [
        "report",
        "circuit",
        "--out",
        str(out),
        "--model",
        tiny_llama_dir,
        "--pairs",
        "2",
        "--method",
        "eap",
    ]
    r = CliRunner().invoke(app, [*args, "--sizes", "1,10,100", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    c = Circuit.load(data["circuit"])
    curve = c.curve
    want = min(
        n for n, f in zip(curve["n_edges"], curve["faithfulness"], strict=True) if f >= DEFAULT_FAITHFULNESS
    )
    assert data["edges"] == c.n_edges and c.params["n"] == want
    assert (
        data["faithfulness_target"] == DEFAULT_FAITHFULNESS and data["faithfulness"] >= DEFAULT_FAITHFULNESS
    )
    assert data["most_heads"] == (data["heads"] > data["model_heads"] / 2)
    page = out.read_text()
    assert "heads only" in page and "noising" in page
    assert "<th>exact</th>" not in page  # nothing confirmed: no all-NaN column
    r = CliRunner().invoke(
        app, [*args, "--sizes", "10,100", "--size", "10", "--confirm", "3", "--force", "--json"]
    )
    assert r.exit_code == 0, r.output
    back = Circuit.load(json.loads(r.stdout)["circuit"])
    assert int(torch.isfinite(back.exact).sum()) == 3 and "<th>exact</th>" in out.read_text()
    # --graph-threshold: both graphs draw only the edges with |score| >= t, and say so
    drawn.clear()
    r = CliRunner().invoke(
        app, [*args, "--sizes", "10,100", "--size", "10", "--graph-threshold", "0.25", "--force"]
    )
    assert r.exit_code == 0, r.output
    assert [k.get("threshold") for k in drawn] == [0.25, 0.25] and drawn[1]["heads_only"] is True
    assert out.read_text().count("Drawn: the edges with |score| &gt;= 0.25") == 2
    r = CliRunner().invoke(app, [*args, "--graph-threshold", "-1", "--force"])
    assert r.exit_code == 2 and "--graph-threshold" in r.output


def test_circuit_rows_bound_the_evaluation_memory(tiny_llama):
    from heads.planning.eap import circuit_eval_bytes
    from heads.planning.plan import geometry
    from heads.scorers.circuits import graph_of
    from heads.scorers.circuits.circuit import circuit_rows

    g = graph_of(tiny_llama)
    geo = geometry(tiny_llama.model.config)
    # a row as many pairs' recorded runs keep (pairs=None: one pair a row) plus its differences
    per_row = circuit_eval_bytes(geo, 20, 1)
    d = tiny_llama.d_model
    assert circuit_rows(g, d, 20, 10 * per_row / 2**30, d_head=tiny_llama.d_head) == 10
    assert circuit_rows(g, d, 20, 10 * per_row / 2**30, d_head=tiny_llama.d_head, pairs=1) > 10
    assert (
        circuit_rows(g, tiny_llama.d_model, 20, 1e-9) == 1
        and circuit_rows(g, tiny_llama.d_model, 20, 1e3) == 64
    )
    with pytest.raises(ValueError, match="max_memory"):
        circuit_rows(g, tiny_llama.d_model, 20, 0)
