"""CARVE's figures and observation report, and the visual-modulation / CARVE views of the vision
report, on the tiny VLMs."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.vlm_models import image as tiny_image
from tests.support.vlm_models import make_tiny_vlm
from viz.reports.carve import carve_observations, carve_report, complexity_image
from viz.reports.vision import render_vision_report, vision_analysis


@pytest.fixture(scope="module")
def llava():
    return make_tiny_vlm("llava")


def test_complexity_image():
    plain = np.asarray(complexity_image(0, 16))
    assert (plain == 128).all()
    busy = np.asarray(complexity_image(4, 16, seed=1))
    assert (busy != 128).any(axis=-1).sum() >= 16  # at least one 4 x 4 square
    assert np.array_equal(busy, np.asarray(complexity_image(4, 16, seed=1)))


def test_carve_report_and_observations(llava, tmp_path):
    out = tmp_path / "carve.html"
    path, maps, obs = carve_report(
        llava, out, "What colour is the square?", tiny_image(2), complexities=(0, 4), seeds=2
    )
    html = path.read_text()
    assert "Entropy and convergence by depth" in html and "Observation checks" in html
    assert obs is not None and len(obs.frame) == 2 * 2 * llava.n_layers
    assert -1 <= obs.complexity_rho <= 1 and set(obs.frame["complexity"]) == {0, 4}
    # the per-image mean entropy the correlation is computed from, recomputed
    per = obs.frame.groupby(["complexity", "seed"])["entropy"].mean()
    assert per.between(0, 1).all()
    with pytest.raises(ValueError, match="exists|overwrite"):
        carve_report(llava, out, "What colour?", tiny_image(2), observations=False)
    with pytest.raises(ValueError, match="two different"):
        carve_observations(llava, complexities=(2, 2))


def test_vision_report_selection_and_carve_views(llava):
    res = vision_analysis(llava, "What colour is the square?", tiny_image(3), trace_tokens=0)
    assert res.selection is not None and res.selection.grid == (4, 4)
    assert res.carve is not None and res.carve.contrast.numel() == 16
    assert res.sensitivity is not None and float(res.sensitivity.scores[1].max()) == pytest.approx(1.0)
    html = render_vision_report(res).to_html()
    assert "selected tokens over the grid" in html and "CARVE: input and refined image" in html
