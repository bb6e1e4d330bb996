"""Figures and Jupyter views."""

import pandas as pd
import pytest
import torch

from heads import HeadScores, head_pattern
from steer import Pasta, SteeredModel
from steer.steered_model import Generation
from viz.figures import attention_pattern, head_heatmap, mapped_pairs, score_distribution, span_share_by_layer


def test_heatmap_hover_and_outline():
    s = HeadScores(torch.arange(12.0).view(3, 4), "x", n_kv_heads=2)
    fig = head_heatmap(s, top_k=2)
    assert fig.data[0].customdata[2][3] == 1  # KV head of head 3
    assert "KV head" in fig.data[0].hovertemplate
    assert len(fig.layout.shapes) == 2


def test_attention_pattern_of_a_head(tiny_llama):
    probs, tokens, spans = head_pattern(tiny_llama, "Read **this** now please", 1, 2, chat=False)
    assert probs.shape == (len(tokens), len(tokens)) and spans
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(tokens)), atol=1e-6, rtol=0)
    steered, _, _ = head_pattern(
        tiny_llama,
        "Read **this** now please",
        1,
        2,
        chat=False,
        edits=Pasta({"1": [2]}).edits(
            tiny_llama, SteeredModel(tiny_llama).encode("Read **this** now please", chat=False)
        ),
    )
    t0, t1 = spans[0]
    assert steered[-1, t0:t1].sum() > probs[-1, t0:t1].sum()
    fig = attention_pattern(probs, tokens, span=spans)
    assert len(fig.layout.shapes) == 1 and len(fig.data[0].x) == len(tokens)
    with pytest.raises(ValueError, match="tokens"):
        attention_pattern(probs, tokens[:-1])


def test_attention_pattern_fits_the_page_and_opens_on_the_span_and_last_rows():
    """A long prompt (the demo's is ~150 tokens: 2182 x 2082 px before) opens at page width on
    the span and the last query rows; the whole pattern is still in the figure to zoom out to."""
    from viz.figures import PATTERN_HEIGHT, PATTERN_KEYS, PATTERN_ROWS

    n, (t0, t1) = 150, (90, 101)
    probs = torch.softmax(torch.randn(n, n), -1)
    fig = attention_pattern(probs, [f"t{i}" for i in range(n)], span=(t0, t1))
    lay = fig.layout
    assert lay.width is None and lay.autosize and lay.height == PATTERN_HEIGHT
    x0, x1 = lay.xaxis.range
    assert x0 <= t0 - 0.5 and t1 - 0.5 <= x1 and x1 - x0 <= PATTERN_KEYS  # the span, not the BOS column
    assert x0 > 0  # key 0 (the sink) is off the first view
    y_bottom, y_top = lay.yaxis.range
    assert y_bottom == n - 0.5 and y_bottom - y_top == PATTERN_ROWS  # the last rows, first row on top
    assert len(fig.data[0].z) == n  # every row is there to zoom out to
    small = attention_pattern(torch.eye(4), list("abcd"), span=(1, 2)).layout
    assert small.xaxis.range == (-0.5, 3.5) and small.yaxis.range == (3.5, -0.5)  # the whole of it


def test_other_figures():
    a, b = torch.rand(3, 4), torch.rand(3, 4)
    fig = span_share_by_layer(a, b)
    assert [t.name for t in fig.data] == ["unsteered", "steered"]
    torch.testing.assert_close(torch.tensor(fig.data[1].y, dtype=torch.float32), b.mean(1))
    assert len(score_distribution(HeadScores(a, "x")).data) == 3
    df = pd.DataFrame({"source": [" cat"], "sigma": [2.0], "targets": [[" cats", " kitten"]]})
    assert "cats" in mapped_pairs(df).data[0].text[0]


def test_jupyter_views_escape_and_show_every_head():
    s = HeadScores(torch.rand(3, 4), "<m>")
    view = s._repr_html_()
    assert view.count("<td") == 12 and "<m>" not in view
    g = Generation(["<b>hi</b>"], [[1]], ["prompt"], [[]])
    assert "&lt;b&gt;hi" in g._repr_html_()
