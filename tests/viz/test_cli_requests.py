"""The CLI builds the analysis request the Python API builds (`PatchRequest` for `report
patching`): its refusals are the request's own, as one line naming the option; `--site` is the
deprecated name of `--kind`; the kind is checked against the model's config before any weight is
read (a folder holding only `config.json`)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from viz.cli import app


def _invoke(tmp_path, model, *args):
    return CliRunner().invoke(
        app, ["report", "patching", "--out", str(tmp_path / "p.html"), "--model", str(model), *args]
    )


@pytest.fixture
def olmo2_config_only(tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        "olmo2", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, hidden_size=32,
        intermediate_size=64, vocab_size=128,
    )  # fmt: skip
    folder = tmp_path / "olmo2"
    cfg.save_pretrained(folder)  # config.json only: loading the weights would fail
    return folder


def test_the_family_refuses_the_kind_before_the_weights(tmp_path, olmo2_config_only):
    r = _invoke(tmp_path, olmo2_config_only, "--kind", "k", "--n", "2")
    assert r.exit_code == 2, r.output
    assert "kind='k' is not available on 'olmo2'" in r.output and "loading" not in r.output
    assert not (tmp_path / "p.html").exists()


def test_site_is_the_deprecated_name_of_kind(tmp_path, olmo2_config_only):
    r = _invoke(tmp_path, olmo2_config_only, "--site", "k", "--n", "2")
    assert r.exit_code == 2 and "--site is deprecated: use --kind" in r.output
    assert "kind='k' is not available" in r.output  # the same request, built from the old name
    r = _invoke(tmp_path, olmo2_config_only, "--site", "k", "--kind", "v")
    assert r.exit_code == 2 and "differ" in r.output
    assert "--site" not in CliRunner().invoke(app, ["report", "patching", "--help"]).output


def test_request_refusals_name_the_option(tmp_path):
    for args, option, message in (
        (["--direction", "up"], "--direction", "direction must be one of denoising, noising"),
        (["--kind", "resid_pre", "--stability", "5"], "--stability", "has no head axis"),
        (["--stability", "1"], "--stability", "stability must be 0 (off)"),
        (["--method", "gradient"], "--method", "method must be one of activation, attribution"),
        (["--kind", "q", "--method", "attribution"], "--method", "does not estimate kind='q'"),
    ):
        r = _invoke(tmp_path, "/no/model", *args)
        assert r.exit_code == 2 and option in r.output and message in r.output, (args, r.output)


def test_report_patching_attribution_says_estimate_in_the_terminal(tiny_llama_dir, tmp_path):
    """`headsteer report patching --method attribution`: the terminal's table says its sites are
    estimated by attribution patching (only the HTML title said so: newcomer); activation
    patching's title is unchanged."""
    from typer.testing import CliRunner

    from viz.cli import app

    base = ["report", "patching", "--model", tiny_llama_dir, "--n", "2", "--kind", "head_out"]
    r = CliRunner().invoke(app, [*base, "--method", "attribution", "--out", str(tmp_path / "a.html")])
    assert r.exit_code == 0, r.output
    assert "estimated by attribution patching" in " ".join(r.output.split())
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "b.html")])
    assert r.exit_code == 0, r.output
    assert "estimated" not in r.output and "top head_out sites" in " ".join(r.output.split())


def test_report_patching_layers(tiny_llama_dir, tmp_path, olmo2_config_only):
    """`--layers` patches only those layers (a long prompt's sweep of every layer took 15x one
    layer's time: newcomer); a bad spec or a layer the model lacks is refused with exit 2 naming
    `--layers`, the latter from the config before any weight loads."""
    from typer.testing import CliRunner

    from viz.cli import app

    base = ["report", "patching", "--model", tiny_llama_dir, "--n", "2", "--kind", "head_out"]
    r = CliRunner().invoke(app, [*base, "--layers", "2,0-1", "--out", str(tmp_path / "a.html")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, [*base, "--layers", "1", "--out", str(tmp_path / "b.html")])
    assert r.exit_code == 0, r.output
    rows = [ln for ln in r.output.splitlines() if ln.strip().startswith("│") and "score" not in ln]
    assert rows and all(ln.split("│")[1].strip() == "1" for ln in rows if ln.split("│")[1].strip())
    for bad, message in (("x", "expected layers"), ("5-2", "is empty"), ("99", "layer")):
        r = _invoke(tmp_path, olmo2_config_only, "--layers", bad)
        assert r.exit_code == 2 and "--layers" in r.output and message in r.output, (bad, r.output)
        assert "loading" not in r.output
