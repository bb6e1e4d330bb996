"""`headsteer report qk` and the QK figures on a tiny model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from heads import QKAttribution, composition_scores, qk_attribution
from tests.support.cli import one_line_error
from viz.cli.main import app
from viz.qk import composition_heatmap, qk_key_map, qk_pair_bars, qk_pair_heatmap, qk_sources_heatmap
from viz.reports.qk import qk_task


def test_figures(tiny_llama):
    r = qk_attribution(tiny_llama, "The cat sat on the <b>mat</b> and the", (2, 1), by="source_token")
    bars = qk_pair_bars(r, k=5)
    assert len(bars.data[0].x) == 5
    top = r.top_pairs(1)[0]
    assert bars.data[0].x[-1] == pytest.approx(top[2])  # the largest term is drawn last (top)
    heat = qk_pair_heatmap(r, top=4)
    assert len(heat.data[0].y) == 4 and heat.data[0].zmid == 0
    km = qk_key_map(r, "key")
    assert len(km.data[0].x) == int(r.valid[0, 0].sum())
    src = qk_sources_heatmap(r, "key", top=3)
    assert len(src.data[0].y) == 3 and len(src.data[0].x) == len(r.tokens[0])
    assert all("<b>" not in str(t) for t in km.data[0].x)  # tokens are drawn as text, never markup
    cs = composition_heatmap(composition_scores(tiny_llama), "k")
    assert len(cs.data[0].x) == 12
    reader = composition_heatmap(composition_scores(tiny_llama), "q", reader=(2, 1))
    assert len(reader.data[0].z) == 3


def test_tasks_put_the_focus_key_where_the_mechanism_says(tiny_llama):
    t = qk_task(tiny_llama, "induction", 2)
    ids = t.prompts.input_ids[0]
    q, k = t.query[0], t.key[0]
    # the focus key is the token after the earlier occurrence of the query's token
    assert ids[k - 1] == ids[q] and k - 1 < q
    t = qk_task(tiny_llama, "ioi", 2)
    tok = tiny_llama.tokenizer
    for n in range(2):
        row = t.prompts.input_ids[n][t.prompts.attention_mask[n].bool()].tolist()
        assert t.query[n] == len(row) - 1
        assert tok.decode(row[t.key[n]]).strip() in tok.decode(row)


def test_cli_report_qk(tiny_llama_dir, tmp_path):
    out = tmp_path / "qk.html"
    args = ["report", "qk", "--out", str(out), "--model", tiny_llama_dir, "--head", "2.1", "--prompts", "2"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert out.is_file() and data["head"] == "L2H1" and data["max_error"] < 1e-4
    assert "Through source tokens" in out.read_text()
    back = QKAttribution.load(data["attribution"])
    assert back.layer == 2 and back.head == 1 and back.n_prompts == 2
    prompts = tmp_path / "p.txt"
    prompts.write_text("The cat sat on the mat\nOne two three four five\n")
    r = CliRunner().invoke(app, [*args[:3], str(tmp_path / "f.html"), *args[4:], "--task", str(prompts)])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--head", "2:1"], "head must look like 'L.H'"),
        (["--head", "2.1", "--task", "nope"], "nope"),
        (["--head", "2.1", "--prompts", "0"], "--prompts"),
        (["--head", "2.1", "--prompts", "65"], "--prompts"),
    ],
)
def test_cli_bad_input_before_the_model_loads(no_load, tmp_path, extra, message):
    r = CliRunner().invoke(app, ["report", "qk", "--out", str(tmp_path / "x.html"), *extra])
    one_line_error(r, message)
    assert not (tmp_path / "x.html").exists()


def test_cli_unknown_head_is_one_line(tiny_llama_dir, tmp_path):
    r = CliRunner().invoke(
        app, ["report", "qk", "--out", str(tmp_path / "x.html"), "--model", tiny_llama_dir, "--head", "7.0"]
    )
    one_line_error(r, "unknown layer 7")
