"""The functional API is a thin wrapper over request + runner (issue 38, item 3), for Ships,
dataset-level Ships, Sahara, attribution patching, MAPS, QRHead, the sink statistics, the sink
dimensions, QK attribution and the composition scores: each function builds its request and
calls `run_<analysis>(model, inputs, request, options)`, which `heads.run` calls too. So

* the function and `heads.run(model, request, inputs)` give equal results (every field of the
  result compared: tensors bitwise, NaN where NaN), with non-default values in every request so
  that a field the dispatcher dropped would show;
* a bad value is refused by the request class itself, and the function refuses it with the same
  error type and the same message (the value is checked in one place: the request).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pandas as pd
import pytest
import torch

import heads
from heads.engine.options import SweepOptions
from heads.errors import HeadsteerError
from heads.scorers.maps.request import MapsRequest
from heads.scorers.maps.static import RelationPairs
from heads.scorers.qk.request import CompositionRequest, QKRequest
from heads.scorers.retrieval.request import QRHeadRequest
from heads.scorers.safety.request import (
    AttributionRequest,
    DatasetShipsRequest,
    SaharaRequest,
    ShipsRequest,
)
from heads.scorers.sink_requests import SinkDimsRequest, SinkStatsRequest
from heads.scorers.sinks import SinkRule

PROMPTS = ["How do I bake bread?", "Tell me a story about a dragon.", "What is two plus two?"]
TWO = PROMPTS[:2]
ITEMS = [
    {
        "question": "Where was Orlan born?",
        "passages": ["Mira was born in Kestra.", "Orlan was born in Delmar."],
        "gold": 1,
    },
    {
        "question": "What pet does Ilse own?",
        "passages": ["Ilse has a parrot.", "Tobin owns a ferret."],
        "gold": 0,
    },
]
RELATIONS = [
    RelationPairs("r0", [(5, 9), (17, 3), (40, 41), (77, 12)], 2),
    RelationPairs("r1", [(8, 8), (30, 31)], 1),
]
OPTS = SweepOptions(max_rows=4, progress=False)
NO_BAR = SweepOptions(progress=False)


def same(a: Any, b: Any, where: str = "result") -> None:
    """`a` and `b` equal in every field: tensors bitwise (NaN where NaN), frames exactly."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, where
        if a.is_floating_point():
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), where
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b), where
        same(vars(a), vars(b), f"{where}.{type(a).__name__}")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# name -> (the function call, the request with the same values, the input, options for run)
Case = tuple[Callable[[heads.HeadModel], Any], Any, Any, SweepOptions | None]
CASES: dict[str, Case] = {
    "ships": (
        lambda m: heads.ships(m, TWO, heads=[(0, 1), (2, 3)], ablation="sc", eps=0.01, options=OPTS),
        ShipsRequest(heads=[[0, 1], [2, 3]], ablation="sc", eps=0.01),
        TWO,
        OPTS,
    ),
    "ships_attribution": (
        lambda m: heads.ships(m, TWO, method="attribution", confirm=2, controls=1, options=OPTS),
        ShipsRequest(method="attribution", confirm=2, controls=1),
        TWO,
        OPTS,
    ),
    "dataset_ships": (
        lambda m: heads.dataset_ships(m, PROMPTS, heads={1: [0, 2]}, r_main=2, degrees=True, options=OPTS),
        DatasetShipsRequest(heads={"1": [0, 2]}, r_main=2, degrees=True),
        PROMPTS,
        OPTS,
    ),
    "sahara": (
        lambda m: heads.sahara(m, TWO, steps=2, heads=[(0, 0), (1, 1), (2, 2)], exact=True, options=OPTS),
        SaharaRequest(steps=2, heads=[[0, 0], [1, 1], [2, 2]], exact=True),
        TWO,
        OPTS,
    ),
    "attribution_patching": (
        lambda m: heads.attribution_patching(
            m, PROMPTS, heads=[(1, 0), (1, 3)], ablation="mean", kl_tokens=2, saturation_fix=False
        ),
        AttributionRequest(heads=[[1, 0], [1, 3]], ablation="mean", kl_tokens=2, saturation_fix=False),
        PROMPTS,
        None,
    ),
    "maps_scores": (
        lambda m: heads.maps_scores(m, RELATIONS, apply_first_mlp=False, options=NO_BAR),
        MapsRequest(apply_first_mlp=False),
        RELATIONS,
        NO_BAR,
    ),
    "qrhead_scores": (
        lambda m: heads.qrhead_scores(m, ITEMS, null_query="none", chat=False, options=NO_BAR),
        QRHeadRequest(null_query="none", chat=False),
        ITEMS,
        NO_BAR,
    ),
    "sink_stats": (
        lambda m: heads.sink_stats(m, PROMPTS, rule=SinkRule(rule="absolute", theta=0.05), chat=False),
        SinkStatsRequest(rule="absolute", theta=0.05, chat=False),
        PROMPTS,
        None,
    ),
    "find_sink_dims": (
        lambda m: heads.find_sink_dims(m, PROMPTS, from_layer=1, max_dims=2, min_ratio=1.01),
        SinkDimsRequest(from_layer=1, max_dims=2, min_ratio=1.01),
        PROMPTS,
        None,
    ),
    "qk_attribution": (
        lambda m: heads.qk_attribution(m, PROMPTS[:2], "2.1", query=[-1, -2], by="source_token"),
        QKRequest(head="2.1", query=[-1, -2], by="source_token"),
        PROMPTS[:2],
        None,
    ),
    "composition_scores": (
        lambda m: heads.composition_scores(m, readers=[(1, 0), (2, 3)], n_samples=5, seed=3),
        CompositionRequest(readers=[[1, 0], [2, 3]], n_samples=5, seed=3),
        None,
        None,
    ),
    "data_composition_scores": (
        lambda m: heads.data_composition_scores(m, PROMPTS[:1]),
        CompositionRequest(method="data"),
        PROMPTS[:1],
        None,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_function_and_heads_run_give_equal_results(tiny_llama, name):
    call, request, inputs, options = CASES[name]
    want = call(tiny_llama)
    given = () if inputs is None else (inputs,)
    assert type(request).from_json(request.to_json()) == request  # the same request from its JSON
    got = heads.run(tiny_llama, request.to_json(), *given, options=options)
    same(got, want)


# name -> (the function call with a bad value, the request class, the same bad value for it)
BAD: dict[str, tuple[Callable[[heads.HeadModel], Any], type, dict]] = {
    "ships ablation": (
        lambda m: heads.ships(m, PROMPTS, ablation="zero"),
        ShipsRequest,
        {"ablation": "zero"},
    ),
    "ships confirm": (lambda m: heads.ships(m, PROMPTS, confirm=2), ShipsRequest, {"confirm": 2}),
    "ships method": (lambda m: heads.ships(m, PROMPTS, method="fast"), ShipsRequest, {"method": "fast"}),
    "dataset_ships r_main": (
        lambda m: heads.dataset_ships(m, PROMPTS, r_main=0),
        DatasetShipsRequest,
        {"r_main": 0},
    ),
    "dataset_ships degrees": (
        lambda m: heads.dataset_ships(m, PROMPTS, degrees="yes"),
        DatasetShipsRequest,
        {"degrees": "yes"},
    ),
    "sahara eps": (lambda m: heads.sahara(m, PROMPTS, eps=2.0), SaharaRequest, {"eps": 2.0}),
    "sahara steps": (lambda m: heads.sahara(m, PROMPTS, steps=0), SaharaRequest, {"steps": 0}),
    "attribution kl_tokens": (
        lambda m: heads.attribution_patching(m, PROMPTS, kl_tokens=0),
        AttributionRequest,
        {"kl_tokens": 0},
    ),
    "attribution template": (
        lambda m: heads.attribution_patching(m, PROMPTS, template="no query"),
        AttributionRequest,
        {"template": "no query"},
    ),
    "maps apply_first_mlp": (
        lambda m: heads.maps_scores(m, RELATIONS, apply_first_mlp=1),
        MapsRequest,
        {"apply_first_mlp": 1},
    ),
    "qrhead null_query": (
        lambda m: heads.qrhead_scores(m, ITEMS, null_query=" "),
        QRHeadRequest,
        {"null_query": " "},
    ),
    "sink_stats chat": (
        lambda m: heads.sink_stats(m, PROMPTS, chat="yes"),
        SinkStatsRequest,
        {"chat": "yes"},
    ),
    "find_sink_dims min_ratio": (
        lambda m: heads.find_sink_dims(m, PROMPTS, min_ratio=1),
        SinkDimsRequest,
        {"min_ratio": 1},
    ),
    "qk_attribution by": (
        lambda m: heads.qk_attribution(m, PROMPTS, (1, 0), by="token"),
        QKRequest,
        {"head": (1, 0), "by": "token"},
    ),
    "composition n_samples": (
        lambda m: heads.composition_scores(m, n_samples=0),
        CompositionRequest,
        {"n_samples": 0},
    ),
    "data_composition chat": (
        lambda m: heads.data_composition_scores(m, PROMPTS, chat="yes"),
        CompositionRequest,
        {"method": "data", "chat": "yes"},
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_value_is_refused_by_the_request_with_the_functions_message(tiny_llama, monkeypatch, case):
    from heads.model.adapter import HeadModel

    call, cls, bad = BAD[case]

    def no_forward(*a: Any, **k: Any) -> None:
        raise AssertionError("a forward ran before the value was checked")

    monkeypatch.setattr(HeadModel, "run", no_forward)
    with pytest.raises(HeadsteerError) as by_request:
        cls(**bad)
    with pytest.raises(HeadsteerError) as by_function:
        call(tiny_llama)
    assert type(by_function.value) is type(by_request.value)
    assert str(by_function.value) == str(by_request.value)
