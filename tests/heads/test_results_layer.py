"""The result classes live in `heads.results` and their old homes give the same objects; the
per-head summaries of the results that gained `head_scores()` agree with an independent route to
the same number (`LensResult` with DLA's last-position head terms, `EdgeScores` with the full-graph
`Circuit`); the new files refuse what they cannot hold."""

from __future__ import annotations

import importlib
import json
import warnings

import pytest
import torch

import heads
from heads.errors import HeadsteerValueError
from tests.support import make_tiny


def _pairs():
    from heads.scorers.patching import pairs_from_tokens

    return pairs_from_tokens(
        [[40, 41, 42, 43], [50, 41, 44, 43]], [[40, 49, 42, 43], [50, 48, 44, 43]], [[20], [22]], [[21], [23]]
    )


MOVED = [  # (old module, name, new module)
    ("heads.scorers.patching.activation", "PatchResult", "heads.results.patching"),
    ("heads.scorers.patching.metrics", "normalise", "heads.results.patching"),
    ("heads.scorers.patching.metrics", "ZeroGapWarning", "heads.results.patching"),
    ("heads.scorers.patching.request", "KINDS", "heads.results.patching"),
    ("heads.scorers.stability", "grid_stability", "heads.results.resampling"),
    ("heads.scorers.stability", "patch_stability", "heads.results.patching"),
    ("heads.scorers.patching.logit", "LensResult", "heads.results.lens"),
    ("heads.scorers.circuits.circuit", "Circuit", "heads.results.circuits"),
    ("heads.scorers.circuits.circuit", "select", "heads.results.circuits"),
    ("heads.scorers.circuits.circuit", "prune", "heads.results.graph"),
    ("heads.scorers.circuits", "Circuit", "heads.results.circuits"),
    ("heads.scorers.circuits.scores", "EdgeScores", "heads.results.edges"),
    ("heads.scorers.circuits.layout", "Graph", "heads.results.graph"),
    ("heads.scorers.circuits.mib", "write_mib", "heads.results.mib"),
    ("heads.scorers.roles.atlas", "HeadAtlas", "heads.results.atlas"),
    ("heads.scorers.roles.atlas", "role_labels", "heads.results.atlas"),
    ("heads.scorers.roles.request", "ROLE_THRESHOLDS", "heads.results.atlas"),
    ("heads.scorers.sink_dims", "SinkDims", "heads.results.sinks"),
]


@pytest.mark.parametrize("old,name,new", MOVED, ids=[f"{m[0]}.{m[1]}" for m in MOVED])
def test_old_homes_give_the_moved_objects_without_a_warning(old, name, new):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        got = getattr(importlib.import_module(old), name)
    assert got is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize(
    "old,new",
    [
        ("heads.scorers.patching.result", "heads.results.patching"),
        ("heads.scorers.circuits.result", "heads.results.circuits"),
        ("heads.scorers.circuits.pruning", "heads.results.graph"),
    ],
)
def test_the_removed_modules_are_aliases_of_the_new_ones(old, new):
    from heads._util.aliases import ALIASES

    assert ALIASES[old] == new


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return make_tiny("llama", tokenizer, attn="eager")


def test_lens_head_scores_are_dla_head_terms_at_the_last_position(tiny):
    from heads.scorers.patching.logit import logit_inspection

    pairs = _pairs()
    lens = heads.logit_lens(tiny, pairs)
    with pytest.raises(HeadsteerValueError, match="logit_inspection"):
        lens.head_scores()  # the lens alone reads layers, not heads
    inspected = logit_inspection(tiny, pairs)
    dla = heads.direct_logit_attribution(tiny, pairs)
    torch.testing.assert_close(inspected.head_scores().scores, dla.head_scores().scores, rtol=1e-4, atol=1e-5)
    assert (inspected.n_heads, inspected.n_kv_heads) == (tiny.n_heads, tiny.n_kv_heads)


def test_edge_scores_head_scores_are_the_full_graph_circuit_head_scores(tiny, tmp_path):
    from heads.results.circuits import select
    from heads.scorers.circuits import edge_scores

    es = edge_scores(tiny, _pairs(), method="eap", options=heads.SweepOptions(progress=False))
    circuit = select(es, 5)
    torch.testing.assert_close(es.head_scores().scores, circuit.head_scores(in_circuit=False).scores)
    # by hand: a head's out-edges plus its q / k / v in-edges (KV edges shared by the group)
    g, s = es.graph, torch.nan_to_num(es.scores.abs(), nan=0.0)
    la, h, group = 1, 2, tiny.n_heads // tiny.n_kv_heads
    want = (
        s[g.head_node(la, h)].sum()
        + s[:, g.q_input(la, h)].sum()
        + (s[:, g.k_input(la, h // group)].sum() + s[:, g.v_input(la, h // group)].sum()) / group
    )
    torch.testing.assert_close(es.head_scores().scores[la, h], want)
    frame = es.to_frame()
    assert len(frame) == g.n_edges and frame["score"].abs().is_monotonic_decreasing
    # a file of another graph's edge count is refused, naming the field
    path = es.save(tmp_path / "edges.json")
    data = json.loads(path.read_text())
    data["scores"] = data["scores"][:-1]
    path.write_text(json.dumps(data))
    with pytest.raises(HeadsteerValueError, match="scores for a graph of"):
        heads.EdgeScores.load(path)


def test_sink_dims_file_checks_the_model_width(tiny, tokenizer, tmp_path):
    res = heads.find_sink_dims(tiny, ["The cat sat.", "A dog ran."], from_layer=1, min_ratio=1.001)
    assert res.geometry == (tiny.n_layers, tiny.n_heads, tiny.n_kv_heads, tiny.d_model)
    path = res.save(tmp_path / "dims.json")
    data = json.loads(path.read_text())
    data["dims"] = [tiny.d_model]  # a dim this model does not have
    data["geometry"] = None
    path.write_text(json.dumps(data))
    with pytest.raises(HeadsteerValueError, match="outside this model's d_model"):
        heads.SinkDims.load(path, tiny)
    assert heads.SinkDims.load(path).dims == (tiny.d_model,)  # without a model: read as written
