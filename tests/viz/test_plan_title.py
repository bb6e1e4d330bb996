"""`headsteer plan --analysis patch`'s title names the kind it plans (head_out, the default; it
named a kind only when a --request gave one)."""

from __future__ import annotations

from typer.testing import CliRunner

from viz.cli import app


def test_analysis_patch_title_names_the_default_kind():
    r = CliRunner().invoke(app, ["plan", "--analysis", "patch", "--tokens", "64", "--batch", "2"])
    assert r.exit_code == 0, r.output
    assert "patch (head_out): 64 tokens x 2" in r.output, r.output
