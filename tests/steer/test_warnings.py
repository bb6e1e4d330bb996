"""No-op parameters and silent fallbacks: one `UserWarning` in the API, one line in the CLI."""

import json
import warnings

import pytest
from typer.testing import CliRunner

from heads import HeadScores, HeadSet
from steer import Ablate, Act, Pasta, SteeredModel
from steer.noop import NoOpWarning
from steer.pasta.method import check_alpha
from viz.cli.main import app

runner = CliRunner()
PROMPT = "Read **this part** and answer."


def _warning_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("warning: ")]


def _generate(model_dir: str, *args: str):
    r = runner.invoke(
        app, ["generate", PROMPT, "--model", model_dir, "--max-new-tokens", "4", "--json", "--quiet", *args]
    )
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.stderr and "warnings.warn" not in r.stderr and "UserWarning" not in r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), _warning_lines(r.stderr)


def test_cli_auto_fallback_and_top_k_warn_once_output_unchanged(tiny_llama_dir):
    auto, lines = _generate(tiny_llama_dir, "--pasta-heads", "auto", "--top-k", "20")
    assert lines == [
        f"warning: no shipped PASTA profile for {tiny_llama_dir}: --pasta-heads auto falls back to the "
        "span heuristic (top 20 heads by attention on the span)",
        "warning: top-k 20 ≥ the model's 12 heads: every head selected",
    ]
    span, lines = _generate(tiny_llama_dir, "--pasta-heads", "span", "--top-k", "20")
    assert lines == ["warning: top-k 20 ≥ the model's 12 heads: every head selected"]
    assert auto == span  # the warning changes nothing in the result
    assert sum(len(h) for h in auto["heads"].values()) == 12
    quiet, lines = _generate(tiny_llama_dir, "--pasta-heads", "span", "--top-k", "3")
    assert lines == [] and sum(len(h) for h in quiet["heads"].values()) == 3


def test_cli_alpha_one_is_a_noop_with_one_line(tiny_llama_dir):
    res, lines = _generate(tiny_llama_dir, "--pasta-heads", "span", "--top-k", "3", "--alpha", "1")
    assert lines == ["warning: PASTA alpha=1.0 is a no-op: output equals the unsteered model"]
    assert res["steered"] == res["baseline"] and res["alpha"] == 1.0


def test_cli_absurd_alpha_warns_and_bad_alpha_refused(tiny_llama_dir, tmp_path):
    _, lines = _generate(tiny_llama_dir, "--pasta-heads", "span", "--top-k", "3", "--alpha", "1e308")
    assert len(lines) == 1 and "alpha=1e+308 > 1 in exclude mode down-weights the span" in lines[0]
    r = runner.invoke(app, ["generate", PROMPT, "--model", tiny_llama_dir, "--alpha", "0"])
    assert r.exit_code == 2 and "alpha must be finite and > 0, got 0.0" in r.stderr
    f = tmp_path / "h.json"
    f.write_text('{"1": [0, 2]}')
    _, lines = _generate(tiny_llama_dir, "--pasta-heads", str(f), "--top-k", "5")
    assert lines == [f"warning: --top-k 5 is ignored: the heads come from {f}"]


def test_api_noop_parameters_warn(tiny_llama):
    for make, text in [
        (lambda: Pasta([1], alpha=1), "PASTA alpha=1 is a no-op"),
        (lambda: Pasta({}, alpha=0.01), "PASTA with no heads"),
        (lambda: Pasta([1], alpha=100.0), "down-weights the span"),
        (lambda: Pasta([1], alpha=0.5, scale_position="include"), "suppresses the span"),
        (lambda: Act(heads=[1], beta=1), "ACT beta=1 is a no-op"),
        (lambda: Act(heads={"1": []}), "ACT with no heads"),
        (lambda: Ablate([], eps=0.0), "Ablate with no heads"),
        (lambda: Ablate([(0, 1)], eps=1.0), "Ablate eps=1.0 is a no-op"),
    ]:
        with pytest.warns(NoOpWarning, match=text) as rec:
            make()
        assert len(rec) == 1 and rec[0].filename == __file__  # points at the user's line
    assert issubclass(NoOpWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the ordinary settings warn about nothing
        Pasta([1], alpha=0.01), Act(heads=[1]), Ablate([(0, 1)]), check_alpha(0.3)
        Pasta([1], alpha=100.0, scale_position="include")
    with pytest.raises(ValueError, match="alpha must be finite and > 0"):
        check_alpha(float("inf"))
    sm = SteeredModel(tiny_llama)
    base = sm.generate(PROMPT, max_new_tokens=4).token_ids
    with pytest.warns(NoOpWarning):
        noop = Pasta([0, 1, 2], alpha=1)
    assert sm.generate(PROMPT, steer=[noop], max_new_tokens=4).token_ids == base


def test_api_top_k_of_every_head_warns():
    import torch

    scores = HeadScores(torch.arange(12.0).reshape(3, 4), method="test", model="tiny")
    with pytest.warns(UserWarning, match="top-k 12 ≥ the model's 12 heads: every head selected"):
        assert scores.top(12) == HeadSet((la, h) for la in range(3) for h in range(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(scores.top(11)) == 11
