"""The `headsteer` CLI, on a tiny random model saved as a local HF folder."""

import json

import pytest
from typer.testing import CliRunner

from viz.cli.main import app

runner = CliRunner()


@pytest.fixture()
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


def test_generate_json(model_dir):
    r = runner.invoke(
        app,
        [
            "generate",
            "Context here. **Answer briefly.** Question?",
            "--model",
            model_dir,
            "--top-k",
            "3",
            "--max-new-tokens",
            "3",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(data) == {"baseline", "steered", "alpha", "heads"}
    assert sum(len(v) for v in data["heads"].values()) == 3


def test_generate_table_and_heads_file(model_dir, tmp_path):
    f = tmp_path / "heads.json"
    f.write_text('{"1": [0, 2]}')
    r = runner.invoke(
        app,
        [
            "generate",
            "Hi **there** friend",
            "--model",
            model_dir,
            "--pasta-heads",
            str(f),
            "--max-new-tokens",
            "2",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "baseline" in r.stdout and "PASTA (alpha=0.01, 2 heads)" in r.stdout


def test_report_attention_writes_html_and_csv(model_dir, tmp_path):
    out = tmp_path / "r" / "report.html"
    r = runner.invoke(
        app,
        ["report", "attention", "--prompt", "Read **this** now.", "--out", str(out), "--model", model_dir],
    )
    assert r.exit_code == 0, r.output
    html = out.read_text()
    assert "Plotly.newPlot" in html and "<script src=" not in html  # plotly.js embedded
    assert "KV head" in html
    lines = out.with_suffix(".csv").read_text().strip().splitlines()
    assert lines[0] == "layer,head,kv_head,score" and len(lines) == 1 + 3 * 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "no span in this prompt", "--max-new-tokens", "2"], "emphasized span"),
        (["generate", "a **b**", "--pasta-heads", "/nonexistent.json"], "head file not found"),
        (["generate", "a **b**", "--alpha", "0"], "alpha must be finite and > 0"),
        (["generate", "a **b** c", "--top-k", "0"], "k must be a positive int"),
        (["generate", "a **b", "--max-new-tokens", "2"], "unbalanced"),
    ],
)
def test_bad_input_is_one_line_error(model_dir, args, message):
    r = runner.invoke(app, [*args, "--model", model_dir])
    assert r.exit_code == 2
    assert message in r.output and "Traceback" not in r.output


def test_missing_model_folder():
    r = runner.invoke(app, ["generate", "a **b**", "--model", "/no/such/folder"])
    assert r.exit_code == 2 and "no model folder" in r.output


def test_cli_rejects_bad_paths_and_empty_heads(model_dir, tmp_path):
    r = runner.invoke(app, ["report", "attention", "--prompt", "a **b**", "--out", str(tmp_path / "x.csv")])
    assert r.exit_code == 2 and "must name an .html file" in r.output
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    r = runner.invoke(app, ["generate", "a **b**", "--pasta-heads", str(empty), "--model", model_dir])
    assert r.exit_code == 2 and "selects no heads" in r.output
    f = tmp_path / "file"
    f.write_text("x")
    r = runner.invoke(app, ["demo", "--out", str(f)])
    assert r.exit_code == 2 and "not a folder" in r.output


def test_error_text_is_not_read_as_markup(model_dir):
    r = runner.invoke(app, ["generate", "a ** b [/red] c", "--model", model_dir, "--max-new-tokens", "2"])
    assert r.exit_code == 2 and "[/red]" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_emphasize_option(model_dir):
    r = runner.invoke(
        app,
        [
            "generate",
            "Read the second line.",
            "--emphasize",
            "second line",
            "--model",
            model_dir,
            "--top-k",
            "2",
            "--max-new-tokens",
            "2",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    assert sum(len(v) for v in json.loads(r.stdout.strip().splitlines()[-1])["heads"].values()) == 2


def test_report_all_writes_linked_reports(model_dir, tmp_path):
    out = tmp_path / "reports"
    r = runner.invoke(
        app,
        [
            "--quiet",
            "report",
            "all",
            "--model",
            model_dir,
            "--draws",
            "1",
            "--prompts",
            "3",
            "--out",
            str(out),
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    written = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(written) == {"index", "attention", "attention_csv", "maps", "plotly_js"}
    index = (out / "index.html").read_text()
    for name in ("attention.html", "attention.csv", "maps.html"):
        assert (out / name).is_file() and f"href='{name}'" in index
    assert "Span attention share per layer, before and after PASTA" in (out / "attention.html").read_text()


def test_generate_vhr_runs_on_defaults_and_refuses_pasta_options(model_dir):
    """`generate --steer vhr` on a **marked** passage runs with the PASTA options at their
    defaults; given a PASTA option it would ignore, it exits 2 naming it, before loading."""
    args = ["generate", "Context: **the key is blue.** What colour?", "--steer", "vhr", "--model", model_dir]
    args += ["--max-new-tokens", "2", "--json"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["steer"] == "vhr"
    r = runner.invoke(app, [*args, "--emphasize", "key", "--alpha", "0.1"])
    assert r.exit_code == 2 and "--alpha, --emphasize are not used by --steer vhr" in r.output
    assert "loading" not in r.output
