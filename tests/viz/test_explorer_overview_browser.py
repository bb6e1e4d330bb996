"""The long-prompt pattern view in Chromium: a long prompt's head shows its overview, and a click
on the overview opens the exact window around that block, its tokens labelled."""

import pytest
import torch

from heads.engine.forward import forward
from heads.inputs.prompts import encode_prompts
from tests.viz.test_explorer_browser import CHROMIUM, browser, click_cell, open_page, serve  # noqa: F401
from viz.explorer import create_explorer

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium")


def test_a_long_prompt_shows_the_overview_and_a_click_opens_a_window(browser, model, tokenizer):  # noqa: F811
    ids = tokenizer("The quick brown fox jumps over the lazy dog by the bank. " * 40)["input_ids"]
    prompt = tokenizer.decode(ids[:300])
    enc = encode_prompts(tokenizer, prompt, chat=False)
    full = forward(model, enc, output_attentions=True).attentions  # the oracle: [1, H, T, T] per layer
    url, stop = serve(create_explorer(model, full_pattern_tokens=128))  # 300 tokens: the overview
    try:
        page, errors = open_page(browser, url)
        page.check("#raw")
        page.fill("#prompt", prompt)
        page.wait_for_function("(p) => window.__explorer.preparedPrompt === p", arg=prompt)
        click_cell(page, "grid", 1, 2, model.n_layers, model.n_heads)
        page.wait_for_selector("#pattern[data-head='1,2'][data-view='overview']")
        assert page.is_visible("#long-view") and page.is_visible("#pattern-stats .main-svg")
        grid = page.evaluate("document.getElementById('pattern').data[0].z.length")
        assert grid == 150  # 300 tokens in blocks of 2
        # a click on the overview, low in the causal triangle: the 64 x 64 window around that block
        box = page.locator("#pattern .nsewdrag").first.bounding_box()
        page.mouse.click(box["x"] + 0.3 * box["width"], box["y"] + 0.8 * box["height"])
        page.wait_for_selector("#pattern-window[data-window]")
        q0, q1, k0, k1 = map(int, page.get_attribute("#pattern-window", "data-window").split(","))
        assert (q1 - q0, k1 - k0) == (64, 64) and q0 <= 0.8 * 300 < q1 and k0 <= 0.3 * 300 < k1
        shown = page.evaluate("(() => { const d = document.getElementById('pattern-window').data[0]; "
                              "return [d.z, d.y[0], d.x[0]]; })()")  # fmt: skip
        assert shown[1].startswith(f"{q0}:") and shown[2].startswith(f"{k0}:")  # tokens labelled
        want = full[1][0, 2, q0:q1, k0:k1].float()
        torch.testing.assert_close(torch.tensor(shown[0]), want, atol=5e-5 + 1e-7, rtol=0)
        # another head, then a window of it: drawn again (the overview once left the old window's
        # Plotly state on an emptied div, and the next window was an empty, zero-height plot)
        click_cell(page, "grid", 0, 3, model.n_layers, model.n_heads)
        page.wait_for_selector("#pattern[data-head='0,3'][data-view='overview']")
        assert page.get_attribute("#pattern-window", "data-window") is None  # the old window is gone
        page.mouse.click(box["x"] + 0.2 * box["width"], box["y"] + 0.9 * box["height"])
        page.wait_for_selector("#pattern-window[data-window]", state="attached")
        q0, q1, k0, k1 = map(int, page.get_attribute("#pattern-window", "data-window").split(","))
        assert page.locator("#pattern-window .main-svg").count() > 0, "the window plot was not drawn"
        assert page.is_visible("#pattern-window")  # not an empty, zero-height div
        shown = page.evaluate("document.getElementById('pattern-window').data[0].z")
        want = full[0][0, 3, q0:q1, k0:k1].float()
        torch.testing.assert_close(torch.tensor(shown), want, atol=5e-5 + 1e-7, rtol=0)
        assert not errors, errors
    finally:
        stop()
