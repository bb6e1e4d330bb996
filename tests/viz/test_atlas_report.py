"""`headsteer report atlas` and `viz.reports.atlas` on tiny models."""

import json

import pytest
import torch
from typer.testing import CliRunner

from heads import HeadsteerTypeError, HeadsteerValueError
from heads.scorers.roles import detect_roles, head_atlas
from tests.support.role_models import make_role_model
from viz.cli.main import app
from viz.reports.atlas import atlas_report, render_atlas_report


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
    # the atlas JSON that `explore --atlas` reads, written beside: the same table as the CSV
    import pandas as pd

    from heads.scorers.roles.atlas import HeadAtlas

    assert data["json"] == str(out.with_suffix(".json"))
    saved = HeadAtlas.load(out.with_suffix(".json"))
    table = pd.read_csv(out.with_suffix(".csv"), keep_default_na=False, na_values=[""])
    assert list(saved.frame.columns) == list(table.columns) and len(saved.frame) == 12
    assert list(saved.frame["role"]) == list(table["role"])
    num = [c for c in table.columns if c != "role"]
    got, want = (torch.tensor(f[num].to_numpy(float)) for f in (saved.frame, table))
    assert torch.allclose(got, want, equal_nan=True)
    r = CliRunner().invoke(app, ["report", "atlas", "--out", str(out), "--model", tiny_llama_dir])
    assert r.exit_code != 0  # exists, no --force
    r = CliRunner().invoke(app, ["report", "atlas", "--out", str(tmp_path / "b.html"), "--lens", "/no/lens"])
    assert r.exit_code != 0 and "lens file not found" in r.output


@pytest.fixture(scope="module")
def role_model():
    return make_role_model()


def _cheap_atlas(model, **kw):
    from heads.results.scores import HeadScores

    s = torch.zeros(model.n_layers, model.n_heads)
    s[1, 0], s[0, 2] = 1.0, float("nan")
    extra = torch.zeros(model.n_layers, model.n_heads)
    extra[0, 3] = 0.9
    return head_atlas(
        model,
        detectors={"induction": HeadScores(s, "x", model=model.name)},
        scores={"patching": HeadScores(extra, "y", model=model.name)},
        thresholds={"induction": 0.5, "patching": 0.5},
        thumbnails=False,
        **kw,
    )


def test_render_custom_and_nan_roles(role_model, tmp_path):
    """Roles from user thresholds and the 'nan' label are drawn (colour, map, cards)."""
    atlas = _cheap_atlas(role_model)
    assert set(atlas.frame["role"]) == {"induction", "patching", "nan", "none"}
    page = render_atlas_report(atlas).save(tmp_path / "a.html").read_text()
    assert "L0.H3</b> (KV 3) — patching" in page and "L0.H2</b> (KV 2) — nan" in page
    with pytest.raises(HeadsteerTypeError, match="atlas must be a HeadAtlas"):
        render_atlas_report(atlas.frame)
    with pytest.raises(HeadsteerTypeError, match="params"):
        render_atlas_report(atlas, ["x"])


@pytest.mark.parametrize(
    "kwargs, error, word",
    [
        ({"out": None}, HeadsteerTypeError, "out must be a file path"),
        ({"maps": "yes"}, HeadsteerTypeError, "maps"),
        ({"overwrite": 1}, HeadsteerTypeError, "overwrite"),
        ({"lens_text": ""}, HeadsteerValueError, "lens_text"),
        ({"lens": 3}, HeadsteerTypeError, "lens must be a file path"),
        ({"csv": "SAME"}, HeadsteerValueError, "same file"),
        ({"atlas_json": "SAME"}, HeadsteerValueError, "same file"),
        ({"progress": "bar"}, HeadsteerTypeError, "progress"),
        ({"model": "hand-built-roles"}, HeadsteerTypeError, "model must be a HeadModel"),
    ],
)
def test_atlas_report_arguments_first(role_model, tmp_path, monkeypatch, kwargs, error, word):
    import heads

    def no_work(*a, **k):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(heads, "run", no_work)  # the report runs every analysis through heads.run
    out = tmp_path / "a.html"
    kw = {"model": role_model, "out": out, **kwargs}
    for key in ("csv", "atlas_json"):
        if kw.get(key) == "SAME":
            kw[key] = out
    with pytest.raises(error) as err:
        atlas_report(kw.pop("model"), kw.pop("out"), **kw)
    assert "\n" not in str(err.value) and word in str(err.value)
    assert not out.exists()


def test_cli_report_atlas_bad_lens_file(tiny_llama_dir, tmp_path):
    """A tampered or untrained lens file: one line, exit 2, before the model loads."""
    bad = tmp_path / "bad.safetensors"
    bad.write_text("not a lens")
    r = CliRunner().invoke(
        app,
        ["report", "atlas", "--out", str(tmp_path / "a.html"), "--model", tiny_llama_dir, "--lens", str(bad)],
    )
    assert r.exit_code == 2 and "not a headsteer lens file" in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "a.html").exists()
