"""A number argument given an int no float can hold (`10**400`: `float()` overflows), and NaN /
inf where the documented range excludes them, is a one-line `HeadsteerValueError` naming the
parameter, raised before any model work (issue 29). On main these overflowed (`OverflowError:
int too large to convert to float`) or slipped through."""

from __future__ import annotations

import json
import math

import pytest
import torch

from heads import HeadScale, HeadScores, QueryScale, find_sink_dims
from heads._util.validation import check_number, is_number, is_real
from heads.errors import HeadsteerValueError
from heads.scorers.gating import GatingResult
from steer import Act, AdaptVis, Caa, HeadGates, InstaBoost, Knockout, Pasta, Spotlight

HUGE = 10**400
NAN, INF = float("nan"), float("inf")


def _raises(make, name: str) -> str:
    """`make()` raises a HeadsteerValueError whose one-line, short message names `name`."""
    with pytest.raises(HeadsteerValueError) as info:
        make()
    msg = str(info.value)
    assert name in msg and "\n" not in msg and len(msg) < 300, msg
    return msg


def test_is_number_refuses_ints_no_float_holds():
    assert is_number(10**300) and is_number(2**1023) and is_number(NAN) and is_number(INF)
    assert not is_number(HUGE) and not is_number(-HUGE) and not is_number(2**1024)
    assert not is_number(True) and not is_number("1")
    assert is_real(HUGE) and not is_real(True) and not is_real("1")
    msg = _raises(lambda: check_number("x", HUGE), "x")
    assert msg == "x must be a finite number, got an int of 401 digits"


# (constructor taking the value, the parameter name the message must carry, also refuse nan/inf)
STEERING = [
    (lambda v: Caa(torch.ones(8), 1, v), "coefficient", True),
    (lambda v: Knockout(keys="span", layers=[0], factor=v), "factor", True),
    (lambda v: AdaptVis(weight1=v), "weight1", True),
    (lambda v: AdaptVis(weight2=v), "weight2", True),
    (lambda v: AdaptVis(threshold=v), "threshold", True),
    (lambda v: HeadGates(torch.rand(3, 4), binary=True, threshold=v), "threshold", True),
    (lambda v: Pasta([1], alpha=v), "alpha", True),
    (lambda v: Spotlight(tau=v), "tau", True),
    (lambda v: InstaBoost(multiplier=v), "multiplier", True),
    (lambda v: Act(heads=[1], beta=v), "beta", True),
    (lambda v: HeadScale(layer=0, heads=[0], factor=v), "factor", True),
    (lambda v: QueryScale(layer=0, heads=[0], factor=v), "factor", True),
]


@pytest.mark.parametrize("make,name,nonfinite", STEERING, ids=[f"{i}-{s[1]}" for i, s in enumerate(STEERING)])
def test_steering_parameters_refuse_huge_ints(make, name, nonfinite):
    for v in (HUGE, -HUGE):
        msg = _raises(lambda v=v: make(v), name)
        assert "401 digits" in msg, msg
    if nonfinite:
        for v in (NAN, INF, -INF):
            _raises(lambda v=v: make(v), name)


def test_sink_dims_min_ratio_refused_before_the_forward(tiny_llama, monkeypatch):
    from heads.scorers import sink_dims

    def no_forward(*a, **k):
        raise AssertionError("the model ran")

    monkeypatch.setattr(sink_dims, "forward", no_forward)
    for v in (HUGE, NAN, INF):
        msg = _raises(lambda v=v: find_sink_dims(tiny_llama, ["a b c"], min_ratio=v), "min_ratio")
    assert "401 digits" not in msg  # inf named as such
    assert "401 digits" in _raises(lambda: find_sink_dims(tiny_llama, ["a"], min_ratio=HUGE), "min_ratio")


def test_refusal_model_lr_refused_before_any_work(tmp_path, monkeypatch):
    import heads
    from probes.studies import refusal_model

    monkeypatch.setattr(heads, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    for v in (HUGE, NAN, INF, -1.0):
        _raises(lambda v=v: refusal_model.build_refusal_model(tmp_path / "out", lr=v, progress=False), "lr")
    assert not (tmp_path / "out").exists()


def test_score_file_with_a_huge_number(tmp_path):
    s = HeadScores(torch.tensor([[0.5, 1.0], [2.0, float("nan")]]), method="m", model="x")
    p = s.save(tmp_path / "s.json")
    assert torch.equal(HeadScores.load(p).scores.isnan(), s.scores.isnan())  # the base file loads
    data = json.loads(p.read_text())
    data["scores"][0][1] = HUGE
    p.write_text(json.dumps(data))
    msg = _raises(lambda: HeadScores.load(p), "score")
    assert "401 digits" in msg and "not a number" in msg


def test_gating_file_with_a_huge_number(tmp_path):
    from heads.scorers.gating import chg

    g = [[0.5, 0.5], [0.5, 0.5]]
    labels = [["irrelevant", "irrelevant"], ["irrelevant", "irrelevant"]]
    good = {"schema": chg.SCHEMA, "schema_version": chg.SCHEMA_VERSION, "gates": g, "retain": g}
    good |= {"remove": g, "labels": labels, "history": {"loss": [1.0]}, "params": {}}
    (tmp_path / "good.json").write_text(json.dumps(good))
    assert GatingResult.load(tmp_path / "good.json").counts()["irrelevant"] == 4
    for key in ("gates", "retain", "remove"):
        p = tmp_path / f"{key}.json"
        p.write_text(json.dumps({**good, key: [[0.5, HUGE], [0.5, 0.5]]}))
        msg = _raises(lambda p=p: GatingResult.load(p), key)
        assert "not a number" in msg, msg
    assert math.isfinite(GatingResult.load(tmp_path / "good.json").gates.scores.sum().item())
