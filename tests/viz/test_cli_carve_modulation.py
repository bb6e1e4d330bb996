"""CARVE and the head-specific visual modulation in `headsteer vision generate`: options refused before
the model loads, and runs on tiny models that equal the Python API."""

from __future__ import annotations

import json
from functools import partial

import pytest
from typer.testing import CliRunner

from steer import Carve, SteeredModel, VisualModulation
from tests.support.cli import one_line_error
from tests.support.vlm_models import image as tiny_image
from tests.support.vlm_models import make_tiny_vlm, save_tiny_vlm
from viz.cli.main import app

runner = CliRunner()
_one_line_error = partial(one_line_error, ignore=("loading ", "warning: "))
PASSAGE = "Context: **the key is blue and the door is red.** What colour is the key?"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steer", "carve", "--gamma", "2"], "--gamma is not used by --steer carve"),
        (["--steer", "modulation", "--keep", "0.3"], "--keep is not used by --steer modulation"),
        (["--steer", "vhr", "--general", "Look."], "--general is not used by --steer vhr"),
        (["--steer", "carve"], "--steer carve needs --image"),
        (["--steer", "modulation", "--gamma", "-1"], "gamma"),
        (["--steer", "modulation", "--regions", "0"], "regions"),
        (["--steer", "carve", "--keep", "0", "--image", "x.png"], "keep"),
    ],
)
def test_options_before_load(no_load, args, message):
    _one_line_error(runner.invoke(app, ["vision", "generate", PASSAGE, *args]), message)


def test_cli_equals_the_api(tmp_path, tiny_llama_dir, tiny_llama):
    vlm = make_tiny_vlm("idefics3")
    folder = save_tiny_vlm(vlm, tmp_path / "idefics3")
    img = tmp_path / "img.png"
    tiny_image(4).save(img)
    q = "What colour is the square?"
    common = ["--model", str(folder), "--image", str(img), "--max-new-tokens", "3", "--json"]
    r = runner.invoke(app, ["vision", "generate", q, "--steer", "carve", "--keep", "0.4", *common])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    carve = Carve(keep=0.4)
    sm = SteeredModel(vlm)
    from PIL import Image

    pil = Image.open(img).convert("RGB")
    want = sm.generate([q], carve, images=[pil], max_new_tokens=3, progress=False)
    assert data["steered"] == want.text and data["grid"] == [2, 2]
    assert data["kept"] == pytest.approx(float(carve.last["maps"][0][0].mask.float().mean()), abs=1e-4)
    args = ["--model", tiny_llama_dir, "--max-new-tokens", "3", "--json"]
    r = runner.invoke(app, ["vision", "generate", PASSAGE, "--steer", "modulation", "--gamma", "3", *args])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    vm = VisualModulation(gamma=3.0)
    want = SteeredModel(tiny_llama).generate([PASSAGE], vm, max_new_tokens=3, progress=False)
    assert data["steered"] == want.text and data["steer"] == "modulation"
    sel = vm.last["selection"][0][0]
    assert data["selected_tokens"] == [int(t) + sel.span[0] for t in sel.selected.nonzero().flatten()]
