"""`headsteer report atlas` and `viz.reports.atlas` on tiny models."""

import json

from typer.testing import CliRunner

from heads.scorers.roles import detect_roles, head_atlas
from tests.support.role_models import make_role_model
from viz.cli.main import app
from viz.reports.atlas import render_atlas_report


def test_render_hand_built_atlas(tmp_path):
    model = make_role_model()
    atlas = head_atlas(model, detectors=detect_roles(model, apply_first_mlp=False, successor=False))
    path = render_atlas_report(atlas).save(tmp_path / "atlas.html")
    page = path.read_text()
    assert "Role map" in page and "atlas-filter" in page
    assert page.count("class='card'") == 8
    assert "L1.H0</b> (KV 0) — induction" in page
    assert page.count("src='data:image/png;base64,") == 8


def test_cli_report_atlas(tiny_llama_dir, tmp_path):
    out = tmp_path / "atlas.html"
    r = CliRunner().invoke(
        app, ["report", "atlas", "--out", str(out), "--model", tiny_llama_dir, "--no-maps", "--json"]
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert sum(data["roles"].values()) == 12  # every head of the 3 x 4 tiny model
    assert out.is_file() and out.with_suffix(".csv").is_file()
    r = CliRunner().invoke(app, ["report", "atlas", "--out", str(out), "--model", tiny_llama_dir])
    assert r.exit_code != 0  # exists, no --force
    r = CliRunner().invoke(app, ["report", "atlas", "--out", str(tmp_path / "b.html"), "--lens", "/no/lens"])
    assert r.exit_code != 0 and "lens file not found" in r.output
