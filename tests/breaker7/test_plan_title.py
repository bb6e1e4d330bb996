"""breaker7: `headsteer plan`'s title names the patched kind only when a --request gives one;
`--analysis patch` plans the default kind (head_out) but the title says just 'patch'."""

from __future__ import annotations

from typer.testing import CliRunner

from viz.cli import app


def test_analysis_patch_title_names_the_default_kind():
    r = CliRunner().invoke(app, ["plan", "--analysis", "patch", "--tokens", "64", "--batch", "2"])
    assert r.exit_code == 0, r.output
    assert "patch (head_out): 64 tokens x 2" in r.output, r.output
