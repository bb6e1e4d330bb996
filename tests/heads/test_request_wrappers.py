"""The functional API over the requests (issue 38 item 3): `path_patch`, `find_circuit`,
`detect_roles`, `train_lens`, `head_atlas`, `direct_logit_attribution` and `logit_lens` build
their request and run it through `run_<analysis>`, so the function and
`heads.run(model, request, inputs)` give the same result, a bad value is refused by the request
class itself with the message the function gives, and the deprecated loose keywords warn at the
caller's line."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from heads import run
from heads.engine.options import SweepOptions
from heads.errors import HeadsteerError
from heads.scorers.patching import pairs_from_tokens

QUIET = SweepOptions(progress=False)


def _pairs():
    return pairs_from_tokens([[5, 6, 7], [8, 9, 10]], [[11, 12, 13], [14, 15, 16]], [5, 6], [40, 41])


def test_path_patch_equals_its_request_run(tiny_llama):
    from heads.scorers.patching.path import path_patch
    from heads.scorers.patching.request import PathPatchRequest

    pairs = _pairs()
    kw = {"receivers": {1: [0, 1]}, "inputs": "v", "direction": "denoising"}
    got = path_patch(tiny_llama, pairs, [0], **kw, options=QUIET)  # layer 0's heads
    request = PathPatchRequest(senders={0: list(range(tiny_llama.n_heads))}, **kw)
    want = run(tiny_llama, request, pairs, options=QUIET)
    torch.testing.assert_close(got.raw, want.raw, rtol=0, atol=0, equal_nan=True)
    assert got.params == want.params and not torch.isnan(got.raw[0]).any()  # every layer-0 head sent


def test_find_circuit_equals_its_request_run(tiny_llama):
    from heads.scorers.circuits import find_circuit
    from heads.scorers.circuits.request import CircuitRequest

    pairs, kw = _pairs(), {"method": "eap", "n": 40, "curve": False, "confirm": 2}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = find_circuit(tiny_llama, pairs, **kw, options=QUIET)
    want = run(tiny_llama, CircuitRequest(**kw), pairs, options=QUIET)
    most = [w for w in caught if "of the model's" in str(w.message)]  # a circuit of most heads
    assert len(most) == 1 and Path(most[0].filename).name == Path(__file__).name  # the caller's line
    assert torch.equal(got.mask, want.mask) and 0 < int(got.mask.sum()) <= 40
    assert got.faithfulness == want.faithfulness
    torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=0, equal_nan=True)
    assert got.exact is not None and int((~got.exact.isnan()).sum()) == 2  # the confirmed edges
    torch.testing.assert_close(got.exact, want.exact, rtol=0, atol=0, equal_nan=True)


def test_loose_keyword_warnings_name_the_callers_file(tiny_llama):
    """The DeprecationWarnings of edge_scores / find_circuit's loose keywords point at the line
    that called them (they pointed one frame too deep, into the scorer's own module)."""
    from heads.scorers.circuits import edge_scores, find_circuit

    pairs = _pairs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        edge_scores(tiny_llama, pairs, method="eap", progress=False)
        edge_scores(tiny_llama, pairs, method="eap", batch_size=1, options=QUIET)
        find_circuit(tiny_llama, pairs, method="eap", n=3, curve=False, batch_rows=8, progress=False)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 3
    assert {Path(w.filename).name for w in deprecations} == {Path(__file__).name}


def test_detect_roles_equals_its_request_run(tiny_llama):
    from heads.scorers.roles.detectors import detect_roles
    from heads.scorers.roles.request import DetectRolesRequest

    seqs = [[1, 5, 6, 7, 5, 6, 7], [1, 8, 9, 10, 8, 9, 10]]
    kw = {"seed": 3, "retrieval": False, "successor": False, "apply_first_mlp": False}
    got = detect_roles(tiny_llama, seqs, **kw)
    want = run(tiny_llama, DetectRolesRequest(**kw), seqs)
    assert got.roles == want.roles and "copying" in got.roles and "induction" in got.roles
    for name in got.roles:
        torch.testing.assert_close(
            got.head_scores(name).scores, want.head_scores(name).scores, rtol=0, atol=0, equal_nan=True
        )


def test_train_lens_equals_its_request_run(tiny_llama):
    from heads.scorers.roles.lens import train_lens
    from heads.scorers.roles.lens_data import collect_lens_data
    from heads.scorers.roles.request import LensTrainRequest

    texts = ["the cat sat on the mat", "a dog ran in the park", "one two three four five"]
    data = collect_lens_data(tiny_llama, texts, [(0, 0), (1, 1)], max_positions=30)
    kw = {"epochs": 2, "lr": 1e-2, "batch_positions": 8, "seed": 1}
    got = train_lens(tiny_llama, data, [(1, 1), (0, 0)], **kw, options=QUIET)
    want = run(tiny_llama, LensTrainRequest(heads={0: [0], 1: [1]}, **kw), data, options=QUIET)
    assert got.heads == want.heads == [(0, 0), (1, 1)]
    torch.testing.assert_close(got.weight, want.weight, rtol=0, atol=0)
    torch.testing.assert_close(got.held_out_kl, want.held_out_kl, rtol=0, atol=0)
    assert not torch.equal(got.weight[0], torch.eye(tiny_llama.d_model))  # it trained


def test_head_atlas_equals_its_request_run(tiny_llama):
    from heads.results.scores import HeadScores
    from heads.scorers.roles.atlas import head_atlas
    from heads.scorers.roles.request import AtlasRequest

    ind = HeadScores(torch.zeros(tiny_llama.n_layers, tiny_llama.n_heads), "x", model=tiny_llama.name)
    ind.scores[1, 0] = 0.9
    extra = HeadScores(torch.rand(tiny_llama.n_layers, tiny_llama.n_heads), "y", model=tiny_llama.name)
    kw = {"thresholds": {"induction": 0.5, "extra": 0.5}, "thumbnails": False}
    got = head_atlas(tiny_llama, detectors={"induction": ind}, scores={"extra": extra}, **kw)
    inputs = {"detectors": {"induction": ind}, "scores": {"extra": extra}}
    want = run(tiny_llama, AtlasRequest(**kw), inputs)
    assert got.frame.equals(want.frame) and got.thresholds == want.thresholds
    assert got.frame.set_index(["layer", "head"]).loc[(1, 0), "role"] == "induction"


def _refusals():
    """(request class, request fields, the function's call of the same bad value)."""
    from heads.scorers.circuits import find_circuit
    from heads.scorers.circuits.request import CircuitRequest
    from heads.scorers.patching.path import path_patch
    from heads.scorers.patching.request import PathPatchRequest
    from heads.scorers.roles.atlas import head_atlas
    from heads.scorers.roles.detectors import detect_roles
    from heads.scorers.roles.lens import train_lens
    from heads.scorers.roles.request import AtlasRequest, DetectRolesRequest, LensTrainRequest

    pairs, texts = _pairs(), ["a b", "c d"]
    return {
        "path_patch mlp": (PathPatchRequest, {"mlp": "thawed"}, lambda m: path_patch(m, pairs, mlp="thawed")),
        "path_patch inputs": (
            PathPatchRequest,
            {"inputs": "k"},
            lambda m: path_patch(m, pairs, inputs="k"),
        ),
        "path_patch direction": (
            PathPatchRequest,
            {"direction": "sideways"},
            lambda m: path_patch(m, pairs, direction="sideways"),
        ),
        "find_circuit method": (
            CircuitRequest,
            {"method": "acdc"},
            lambda m: find_circuit(m, pairs, method="acdc"),
        ),
        "find_circuit steps": (
            CircuitRequest,
            {"method": "eap", "steps": 7},
            lambda m: find_circuit(m, pairs, method="eap", steps=7),
        ),
        "find_circuit two sizes": (
            CircuitRequest,
            {"n": 3, "size": 2.0},
            lambda m: find_circuit(m, pairs, n=3, size=2.0),
        ),
        "find_circuit sizes": (
            CircuitRequest,
            {"sizes": [0, 5]},
            lambda m: find_circuit(m, pairs, sizes=[0, 5]),
        ),
        "detect_roles seed": (
            DetectRolesRequest,
            {"seed": -1},
            lambda m: detect_roles(m, seed=-1),
        ),
        "detect_roles flag": (
            DetectRolesRequest,
            {"retrieval": "yes"},
            lambda m: detect_roles(m, retrieval="yes"),
        ),
        "train_lens held_out": (
            LensTrainRequest,
            {"held_out": 1.0},
            lambda m: train_lens(m, texts, [(0, 0)], held_out=1.0, options=QUIET),
        ),
        "train_lens lr": (
            LensTrainRequest,
            {"lr": 2.0},
            lambda m: train_lens(m, texts, [(0, 0)], lr=2.0, options=QUIET),
        ),
        "train_lens form": (
            LensTrainRequest,
            {"form": "wide"},
            lambda m: train_lens(m, texts, [(0, 0)], form="wide", options=QUIET),
        ),
        "head_atlas threshold": (
            AtlasRequest,
            {"thresholds": {"induction": -1}},
            lambda m: head_atlas(m, thresholds={"induction": -1}),
        ),
        "head_atlas lens_text": (
            AtlasRequest,
            {"lens_text": " "},
            lambda m: head_atlas(m, lens_text=" "),
        ),
    }


@pytest.mark.parametrize("case", sorted(_refusals()))
def test_a_bad_value_is_refused_by_the_request_with_the_functions_message(case, tiny_llama):
    cls, fields, call = _refusals()[case]
    with pytest.raises(HeadsteerError) as by_request:
        cls(**fields)
    with pytest.raises(HeadsteerError) as by_function:
        call(tiny_llama)
    assert type(by_function.value) is type(by_request.value)
    assert str(by_function.value) == str(by_request.value)


def _loose_cases(m):
    """name -> (the call with loose keywords, the same with options=, the keyword, results equal)."""
    from heads.results.scores import HeadScores
    from heads.scorers.circuits import EdgeScores, evaluate, exact_scores, faithfulness_curve, graph_of
    from heads.scorers.maps.inference import ablation_check, dynamic_scores
    from heads.scorers.maps.static import RelationPairs, maps_scores
    from heads.scorers.patching.evaluate import evaluate_pairs
    from heads.scorers.roles.detectors import pattern_scores
    from heads.scorers.roles.lens_data import collect_lens_data
    from heads.scorers.roles.needle import retrieval_scores

    pairs, graph = _pairs(), graph_of(m)
    sc = EdgeScores(graph, torch.rand(graph.valid.shape, generator=torch.Generator().manual_seed(0)), "eap")
    edges = sc.ranking()[:3]
    masks = graph.valid.clone()[None]
    masks[0, edges[:, 0], edges[:, 1]] = False  # a circuit of all but three edges: three patched
    rel = RelationPairs(
        "copying",
        [(40, 40), (41, 41), (42, 42), (43, 43)],
        1,
        texts=[("a", "a"), ("b", "b"), ("c", "c"), ("d", "d")],
    )  # ablation_check needs 4 pairs (3 shots per prompt)
    scores = HeadScores(torch.zeros(m.n_layers, m.n_heads), "x")

    def same(a, b):
        return torch.equal(a, b)

    one, rows = SweepOptions(max_rows=1, progress=False), SweepOptions(max_rows=1)
    return {
        "evaluate": (
            lambda: evaluate(m, pairs, masks, batch_rows=1, progress=False),
            lambda: evaluate(m, pairs, masks, options=one),
            "batch_rows",
            same,
        ),
        "faithfulness_curve": (
            lambda: faithfulness_curve(m, pairs, sc, sizes=[99], random=False, batch_rows=1),
            lambda: faithfulness_curve(m, pairs, sc, sizes=[99], random=False, options=one),
            "batch_rows",
            lambda a, b: (a["faithfulness"], a["n_kept"]) == (b["faithfulness"], b["n_kept"]),  # cpr: NaN
        ),
        "exact_scores": (
            lambda: exact_scores(m, pairs, edges=edges, batch_rows=1, progress=False),
            lambda: exact_scores(m, pairs, edges=edges, options=one),
            "batch_rows",
            lambda a, b: torch.equal(a.scores.nan_to_num(), b.scores.nan_to_num()),
        ),
        "evaluate_pairs": (
            lambda: evaluate_pairs(m, pairs, batch_size=1),
            lambda: evaluate_pairs(m, pairs, options=rows),
            "batch_size",
            lambda a, b: torch.equal(a.logit_diff, b.logit_diff),
        ),
        "collect_lens_data": (
            lambda: collect_lens_data(m, ["a b c", "d e"], [(0, 0)], batch_size=1),
            lambda: collect_lens_data(m, ["a b c", "d e"], [(0, 0)], options=rows),
            "batch_size",
            lambda a, b: torch.equal(a.outputs, b.outputs),
        ),
        "retrieval_scores": (
            lambda: retrieval_scores(m, n_prompts=2, n_filler=1, batch_size=1),
            lambda: retrieval_scores(m, n_prompts=2, n_filler=1, options=rows),
            "batch_size",
            lambda a, b: torch.equal(a.scores, b.scores),
        ),
        "dynamic_scores": (
            lambda: dynamic_scores(m, [rel], templates=["{x}"], batch_size=1, progress=False),
            lambda: dynamic_scores(m, [rel], templates=["{x}"], options=one),
            "batch_size",
            lambda a, b: torch.equal(a["copying"], b["copying"]),
        ),
        # two @torch.no_grad() scorers migrated earlier: the warning skips torch's wrapper frame
        "pattern_scores": (
            lambda: pattern_scores(m, [[1, 5, 6, 5, 6]], detectors=("induction",), batch_size=1),
            lambda: pattern_scores(m, [[1, 5, 6, 5, 6]], detectors=("induction",), options=rows),
            "batch_size",
            lambda a, b: torch.equal(a["induction"].scores.nan_to_num(), b["induction"].scores.nan_to_num()),
        ),
        "maps_scores": (
            lambda: maps_scores(m, [rel], progress=False),
            lambda: maps_scores(m, [rel], options=QUIET),
            "progress",
            lambda a, b: torch.equal(a.relation["copying"].scores, b.relation["copying"].scores),
        ),
        "ablation_check": (
            lambda: ablation_check(m, rel, scores, draws=1, n_prompts=2, min_base=1.1, progress=False),
            lambda: ablation_check(m, rel, scores, draws=1, n_prompts=2, min_base=1.1, options=QUIET),
            "progress",
            lambda a, b: a.base == b.base and a.skipped == b.skipped,
        ),
    }


def test_loose_sweep_keywords_warn_at_the_callers_line_and_match_options(tiny_llama):
    """The loose rows / progress keywords still work one release: a DeprecationWarning naming
    `options=SweepOptions(...)` at the caller's line, the result of the options form, and both
    given together refused; a bad loose value is named as given."""
    from heads.errors import HeadsteerValueError
    from heads.scorers.patching.evaluate import evaluate_pairs

    for name, (old, new, keyword, equal) in _loose_cases(tiny_llama).items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = old()
        dep = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert len(dep) == 1, (name, [str(w.message) for w in caught])
        assert f"{name}({keyword}=" in str(dep[0].message) and "options=SweepOptions(" in str(dep[0].message)
        assert Path(dep[0].filename).name == Path(__file__).name, (name, dep[0].filename)
        assert equal(got, new()), name
    with pytest.raises(HeadsteerValueError, match=r"evaluate_pairs\(\) got both batch_size= and options"):
        evaluate_pairs(tiny_llama, _pairs(), batch_size=2, options=SweepOptions(max_rows=4))
    with pytest.raises(HeadsteerValueError, match="batch_size must be a positive int"):
        evaluate_pairs(tiny_llama, _pairs(), batch_size=0)


@pytest.mark.parametrize("family", ["opt", "minicpm3"])
def test_path_patch_frozen_mlps_refused_from_the_config(family):
    """`mlp="frozen"` where the MLP output is not one site (OPT: no MLP module; MiniCPM3: a residual
    multiplier) is refused by the request from the config alone, as `path_patch` refuses it."""
    from heads.errors import HeadsteerValueError
    from heads.scorers.patching.path import path_patch
    from heads.scorers.patching.request import PathPatchRequest
    from tests.support.families import _tiny_config, shared_family_model

    with pytest.raises(HeadsteerValueError, match="mlp='frozen' is not available") as by_config:
        PathPatchRequest(mlp="frozen").check_config(_tiny_config(family))
    ran = SweepOptions(progress=lambda d, t: pytest.fail("ran"))
    with pytest.raises(HeadsteerValueError) as by_function:
        path_patch(shared_family_model(family), _pairs(), mlp="frozen", options=ran)
    assert str(by_function.value) == str(by_config.value)
    PathPatchRequest(mlp="frozen").check_config(_tiny_config("llama"))  # one MLP site: accepted


def test_dla_and_lens_at_positions_equal_their_request_runs(tiny_llama):
    """`positions` (issue 41 item 2) goes through the request: the function and `heads.run` of the
    request's JSON give the same result at the same columns."""
    from heads.scorers.patching.logit import direct_logit_attribution, logit_lens
    from heads.scorers.patching.request import DLARequest, LensRequest

    pairs = _pairs()
    got = direct_logit_attribution(tiny_llama, pairs, positions=[-1, 0])
    want = run(tiny_llama, DLARequest(positions=[-1, 0]).to_json(), pairs)
    assert got.heads.shape[-1] == 2 and got.params == want.params
    for term in got.TERMS:
        torch.testing.assert_close(getattr(got, term), getattr(want, term), rtol=0, atol=0)
    lens = logit_lens(tiny_llama, pairs, positions=[1, -1], k=2)
    other = run(tiny_llama, LensRequest(positions=[1, -1], k=2).to_json(), pairs)
    assert lens.logit_diff.shape == (2, tiny_llama.n_layers + 1, 2) and lens.params == other.params
    torch.testing.assert_close(lens.logit_diff, other.logit_diff, rtol=0, atol=0)
    assert lens.top_tokens == other.top_tokens
