"""The explorer's Jupyter widgets (`viz.widgets`): live anywidget views and their static HTML."""

import html

import pytest
import torch

from heads.results.scores import HeadScores
from viz import widgets

PROMPT = "Ignore this. **Remember the <b>word</b> apple** and say"


def bundle_html(view) -> str:
    if isinstance(view, widgets.StaticView):
        return view._repr_html_()
    data = view._repr_mimebundle_()
    data = data[0] if isinstance(data, tuple) else data
    assert "application/vnd.jupyter.widget-view+json" in data  # a live widget ...
    return data["text/html"]  # ... with its static fallback


def test_scores_grid_widget_and_fallback(monkeypatch):
    s = HeadScores(torch.arange(6, dtype=torch.float).reshape(2, 3) / 5, "span", model="m")
    view = widgets.scores_widget(s)
    assert widgets.widgets_available() and not isinstance(view, widgets.StaticView)
    assert view.data["rows"] == [[0.0, 0.2, 0.4], [0.6, 0.8, 1.0]]
    view.selected = [1, 2]  # what a click sets
    markup = bundle_html(view)
    assert markup.count("<td") == 6 and "L1 / H2: 1.0000" in markup
    monkeypatch.setattr(widgets, "widgets_available", lambda: False)
    static = widgets.scores_widget(s)
    assert isinstance(static, widgets.StaticView) and static.html == markup
    with pytest.raises(TypeError, match="HeadScores"):
        widgets.scores_widget(torch.zeros(2, 3))


def test_pattern_and_steering_panel_escape_and_run(model):
    from heads.scorers.attention_mass import head_pattern
    from steer.pasta.method import Pasta
    from steer.steered_model import SteeredModel

    view = widgets.pattern_widget(model, PROMPT, 1, 0)
    probs, tokens, _ = head_pattern(model, PROMPT, 1, 0)
    assert len(view.data["rows"]) == len(tokens)
    torch.testing.assert_close(torch.tensor(view.data["rows"]), probs.float(), atol=1e-4, rtol=0)
    heads = {0: list(range(model.n_heads))}
    panel = widgets.steering_panel(model, PROMPT, heads, alpha=0.5, max_new_tokens=4, run=True)
    sm = SteeredModel(model)
    assert panel.plain == sm.generate(PROMPT, [], max_new_tokens=4, progress=False).text
    assert panel.steered == sm.generate(PROMPT, [Pasta(heads=heads, alpha=0.5)], max_new_tokens=4,
                                        progress=False).text  # fmt: skip
    markup = bundle_html(panel)
    assert html.escape(PROMPT) in markup and "<b>word</b>" not in markup
    panel._runner = lambda text: ("plain " + text, "steered")
    panel._on_msg(panel, {"type": "generate"}, [])  # the button's message runs it again
    assert (panel.plain, panel.steered, panel.status) == ("plain " + PROMPT, "steered", "")


def test_steering_panel_takes_any_interventions(model):
    from steer import InstaBoost
    from steer.steered_model import SteeredModel

    boost = InstaBoost(multiplier=20.0)
    panel = widgets.steering_panel(model, PROMPT, steer=[boost], max_new_tokens=4, run=True)
    want = SteeredModel(model).generate(PROMPT, [boost], max_new_tokens=4, progress=False).text
    assert panel.steered == want and panel.steered != panel.plain
    assert "InstaBoost" in bundle_html(panel)
    for kwargs in ({}, {"heads": {0: [0]}, "steer": [boost]}, {"steer": []}):
        with pytest.raises(ValueError, match="steer"):
            widgets.steering_panel(model, PROMPT, **kwargs)


def test_signed_grid_uses_the_centred_diverging_convention(monkeypatch):
    """Signed scores: the figures' DIVERGING scale on [-m, m] (white at exactly 0, blue < 0, red > 0)
    with the key and the sign convention in words, in the static view and the live widget alike."""
    import re

    from plotly.colors import sample_colorscale

    from viz.figures import DIVERGING, direction_note

    t = torch.tensor([[-2.0, 0.0, 1.0], [0.5, -0.25, 2.0]])
    s = HeadScores(t, "patching.head_out", model="m", params={"direction": "noising"})
    monkeypatch.setattr(widgets, "widgets_available", lambda: False)
    page = widgets.scores_widget(s).html
    drawn = re.findall(r"background:(#[0-9a-f]{6})", page)
    m = float(t.abs().max())
    for got, v in zip(drawn, t.flatten().tolist(), strict=True):
        # the oracle: plotly's own sampling of the same stops at (v / m + 1) / 2
        want = tuple(
            round(float(x)) for x in re.findall(r"[\d.]+", sample_colorscale(DIVERGING, [(v / m + 1) / 2])[0])
        )
        assert tuple(int(got[i : i + 2], 16) for i in (1, 3, 5)) == pytest.approx(want, abs=1)
    assert drawn[1] == "#f7f7f7"  # 0 is white, whatever the minimum and maximum
    assert "blue &lt; 0, white = 0, red &gt; 0" in page and html.escape(direction_note("noising")) in page
    live = widgets._GRID_ESM
    assert '"#053061"' in live and "blue < 0, white = 0, red > 0" in live
