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
