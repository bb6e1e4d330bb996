"""A patching sweep of some layers (`layers=[...]`) reports the model's real layer numbers: its
head scores are the full `[L, H]` grid (NaN in the layers not patched, never selected) equal to
the all-layer sweep's at the patched layers; its table and figure rows name the real layers."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import heads
from heads import SweepOptions
from heads.scorers.patching.activation import patch
from heads.scorers.patching.pairs import encode_pairs
from tests.support import make_tiny
from tests.support.patching import PAIRS

OPTS = SweepOptions(max_rows=64, progress=False)


@pytest.fixture(scope="module")
def setup(tokenizer):
    model = make_tiny("llama", tokenizer)
    assert model.n_layers == 3
    return model, encode_pairs(tokenizer, PAIRS[:1])


def test_head_out_subset_keeps_layer_numbers(setup):
    model, pairs = setup
    full = patch(model, pairs, "head_out", options=OPTS)
    sub = patch(model, pairs, "head_out", layers=[1, 2], options=OPTS)
    hs = sub.head_scores()
    assert tuple(hs.scores.shape) == (3, model.n_heads)
    assert bool(hs.scores[0].isnan().all())
    torch.testing.assert_close(hs.scores[1:], full.mean[1:])
    # top / ranked never pick a NaN layer; they equal the full run's ranking restricted to 1, 2
    ref = full.head_scores().scores.clone()
    ref[0] = math.nan
    want = sorted(
        ((la, h) for la in (1, 2) for h in range(model.n_heads)), key=lambda lh: (-abs(float(ref[lh])), lh)
    )
    assert hs.ranked(by="abs") == want
    top = hs.top(3, by="abs")
    assert list(top) == sorted(want[:3])
    assert set(sub.to_frame()["layer"]) == {1, 2}
    from probes.studies.patching import top_heads

    assert [r["head"] for r in top_heads(sub, 3)] == [f"L{la}H{h}" for la, h in hs.ranked(3)]
    # the same through the request API
    again = heads.run(model, heads.PatchRequest(kind="head_out", layers=[1, 2]), pairs, options=OPTS)
    torch.testing.assert_close(again.head_scores().scores, hs.scores, equal_nan=True)


def test_by_position_subset_keeps_layer_numbers(setup):
    model, pairs = setup
    full = patch(model, pairs, "head_out_by_pos", positions=[-1], options=OPTS)
    sub = patch(model, pairs, "head_out_by_pos", layers=[2], positions=[-1], options=OPTS)
    hs = sub.head_scores()
    assert bool(hs.scores[:2].isnan().all())
    torch.testing.assert_close(hs.scores[2], full.head_scores().scores[2])
    assert set(sub.to_frame()["layer"]) == {2}
    res = patch(model, pairs, "resid_pre", layers=[2], positions=[-1], options=OPTS)
    assert res.layer_ids == [2] and res.to_frame()["layer"].tolist() == [2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from viz.reports.patching import position_heatmap

    fig = position_heatmap(res.mean, res.labels, "t", rows=res.layer_ids)
    assert list(fig.data[0].y) == ["2"]


def test_by_position_warns_on_mixed_lengths(tokenizer, setup):
    model, one = setup
    mixed = encode_pairs(tokenizer, PAIRS)  # two templates of different lengths
    assert len(set(mixed.lengths.tolist())) == 2
    with pytest.warns(UserWarning, match="2 pairs' clean prompts have 2 different lengths") as rec:
        res = patch(model, mixed, "resid_pre", layers=[2], positions=[-1], options=OPTS)
    assert sum("different lengths" in str(w.message) for w in rec) == 1  # once per call
    assert "different lengths" in res.params["labels_from"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one template: no warning
        same = patch(model, one, "resid_pre", layers=[2], positions=[-1], options=OPTS)
        patch(model, mixed, "head_out", layers=[2], options=OPTS)  # not by position: no warning
    assert same.params["labels_from"] == "pair 0's clean tokens"
