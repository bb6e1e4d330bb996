"""Bad input to the circuit scorers: a one-line HeadsteerValueError / HeadsteerTypeError naming
the bad value, before any forward; tampered circuit files refused field by field."""

from __future__ import annotations

import json

import pytest
import torch

from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.scorers.circuits import (
    MAX_STEPS,
    Circuit,
    EdgeScores,
    edge_scores,
    evaluate,
    faithfulness_curve,
    find_circuit,
    graph_of,
    select,
)
from heads.scorers.patching import pairs_from_tokens
from tests.support.families import tiny_family_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def qwen2():
    return tiny_family_model("qwen2")


@pytest.fixture()
def no_forward(qwen2):
    calls: list[int] = []
    h = qwen2.model.register_forward_pre_hook(lambda *a: calls.append(1))
    yield
    h.remove()
    assert not calls, "a forward ran before the bad input was refused"


def _pairs():
    return pairs_from_tokens([[5, 6, 7], [8, 9, 10]], [[11, 12, 13], [14, 15, 16]], [5, 6], [40, 41])


def _fake(m):
    g = graph_of(m)
    return EdgeScores(g, torch.randn(g.n_upstream, g.n_downstream).masked_fill(~g.valid, float("nan")), "eap")


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"sizes": "12"}, "sizes"),
        ({"sizes": b"12"}, "sizes"),
        ({"sizes": [True]}, "sizes"),
        ({"sizes": [5, False]}, "sizes"),
        ({"sizes": ["5"]}, "sizes"),
        ({"sizes": [float("nan")]}, "sizes"),
        ({"sizes": []}, "sizes"),
        ({"sizes": 5}, "sizes"),
        ({"sizes": [0]}, "sizes"),
        ({"sizes": [100.5]}, "sizes"),
        ({"seed": "a"}, "seed"),
        ({"seed": -1}, "seed"),
        ({"batch_rows": 0}, "batch_rows"),
        ({"random": 1}, "random"),
        ({"n_random": 0}, "n_random"),
        ({"n_random": 1001}, "n_random"),
        ({"n_random": 2.0}, "n_random"),
    ],
)
def test_faithfulness_curve_refuses(qwen2, no_forward, kw, match):
    with pytest.raises((HeadsteerValueError, HeadsteerTypeError), match=match):
        faithfulness_curve(qwen2, _pairs(), _fake(qwen2), **kw)


def test_faithfulness_curve_refuses_non_scores(qwen2, no_forward):
    with pytest.raises(HeadsteerTypeError, match="EdgeScores"):
        faithfulness_curve(qwen2, _pairs(), None)  # type: ignore[arg-type]


def test_faithfulness_curve_sizes_are_the_numbers_given(qwen2):
    cur = faithfulness_curve(qwen2, _pairs(), _fake(qwen2), sizes=[12], random=False)
    assert cur["sizes"] == [12.0]


def test_evaluate_refuses_batch_rows_and_non_circuits(qwen2, no_forward):
    g = graph_of(qwen2)
    with pytest.raises(HeadsteerValueError, match="batch_rows"):
        evaluate(qwen2, _pairs(), g.valid[None], batch_rows=0)
    with pytest.raises(HeadsteerTypeError, match="circuits"):
        evaluate(qwen2, _pairs(), [5])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"steps": MAX_STEPS + 1}, "steps"),
        ({"steps": 10**9}, "steps"),
        ({"steps": True}, "steps"),
        ({"method": "eap", "steps": 7}, "steps=7"),
        ({"method": "exact", "steps": 3}, "steps=3"),
    ],
)
def test_edge_scores_bounds_and_refuses_unused_steps(qwen2, no_forward, kw, match):
    with pytest.raises(HeadsteerValueError, match=match):
        edge_scores(qwen2, _pairs(), progress=False, **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"n": 0}, "n must be"),
        ({"n": 10**9}, "n must be"),
        ({"threshold": "x"}, "threshold"),
        ({"threshold": float("nan")}, "threshold"),
        ({"method": "exact", "steps": 3}, "steps=3"),
        ({"steps": 10**9}, "steps"),
        ({"method": "acdc"}, "method"),
        ({"confirm": -1}, "confirm"),
        ({"batch_rows": 0}, "max_rows"),
        ({"curve": "yes"}, "curve"),
    ],
)
def test_find_circuit_checks_before_scoring(qwen2, no_forward, kw, match):
    with pytest.raises((HeadsteerValueError, HeadsteerTypeError), match=match):
        find_circuit(qwen2, _pairs(), progress=False, **kw)


# ------------------------------------------------------------------------------ tampered files
@pytest.fixture(scope="module")
def saved(qwen2, tmp_path_factory):
    c = select(_fake(qwen2), 10)
    c.exact = torch.full_like(c.scores, float("nan"))
    e = c.edges[0]
    c.exact[e[0], e[1]] = 0.5
    c.faithfulness = 0.25
    path = c.save(tmp_path_factory.mktemp("c") / "c.json")
    return c, json.loads(open(path).read())


def _tamper(d: dict, dotted: str, value):
    d = json.loads(json.dumps(d))
    *head, last = dotted.split(".")
    t = d
    for k in head:
        t = t[k]
    if value is _DELETE:
        del t[last]
    else:
        t[last] = value
    return d


_DELETE = object()


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("geometry.n_layers", -1, "n_layers"),
        ("geometry.n_layers", 3.7, "n_layers"),
        ("geometry.n_layers", 2000, "n_layers"),
        ("geometry.n_layers", "2", "n_layers"),
        ("geometry.n_layers", _DELETE, "n_layers"),
        ("geometry.n_heads", 5000, "n_heads"),
        ("geometry.n_heads", 0, "n_heads"),
        ("geometry.n_kv_heads", 3, "n_kv_heads"),
        ("geometry.n_kv_heads", 8, "n_kv_heads"),
        ("geometry", [2, 4, 2], "geometry"),
        ("model", 5, "model"),
        ("scores", ["a"], "scores"),
        ("scores", "abc", "scores"),
        ("scores", [1.0], "scores"),
        ("edges", "abc", "edges"),
        ("edges", [1, 2], "edges"),
        ("edges", ["nope"], "edges"),
        ("edges", ["a1.h0->a0.h0<q>"], "edges"),
        ("edges", ["input->m0"], "dangling"),
        ("exact", [1, 2], "exact"),
        ("exact", {"input->logits": "abc"}, "exact"),
        ("exact", {"zz->logits": 1.0}, "exact"),
        ("params", [1], "params"),
        ("params", "ab", "params"),
        ("faithfulness", "high", "faithfulness"),
        ("curve", 3, "curve"),
        ("method", 3, "method"),
    ],
)
def test_load_refuses_tampered_fields(saved, tmp_path, field, value, match):
    _, d = saved
    p = tmp_path / "t.json"
    p.write_text(json.dumps(_tamper(d, field, value)))
    with pytest.raises(HeadsteerValueError, match=match) as err:
        Circuit.load(p)
    assert "\n" not in str(err.value)


def test_load_geometry_2000_layers_refused_before_allocating(saved, tmp_path):
    _, d = saved
    d = _tamper(_tamper(d, "geometry.n_layers", 1000), "geometry.n_heads", 1000)
    p = tmp_path / "big.json"
    p.write_text(json.dumps(d))
    with pytest.raises(HeadsteerValueError, match="scores for a graph"):
        Circuit.load(p)  # the scores length is checked arithmetically, not with a [U, Dn] mask


def test_load_binary_and_round_trip(saved, tmp_path, qwen2):
    c, d = saved
    p = tmp_path / "b.json"
    p.write_bytes(b"\xff\xfe\x00\x81binary")
    with pytest.raises(HeadsteerValueError, match="UTF-8|JSON"):
        Circuit.load(p)
    q = tmp_path / "ok.json"
    q.write_text(json.dumps(d))
    back = Circuit.load(q, qwen2)
    assert torch.equal(back.mask, c.mask) and back.faithfulness == 0.25
    assert torch.equal(back.exact.isnan(), c.exact.isnan())


def test_unpruned_circuit_round_trips(qwen2, tmp_path):
    c = select(_fake(qwen2), 10, prune_dangling=False)
    g = c.graph
    c.mask[0, g.mlp_input(0)] = True  # a dangling edge, kept on purpose
    back = Circuit.load(c.save(tmp_path / "u.json"))
    assert torch.equal(back.mask, c.mask)


# ------------------------------------------------------------------------------ the list
def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert msg and "\n" not in msg
    return msg


def _forwards(m) -> list[int]:
    calls: list[int] = []
    m.model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


@pytest.mark.parametrize("kind", ["phi", "gpt_neox"])
def test_refused_family_named_before_any_forward(kind):
    """Parallel blocks (phi, GPT-NeoX): every entry point names the family in one line and runs
    nothing. (The post-norm families are covered: tests/heads/circuits/test_post_norm.py.)"""
    m = tiny_family_model(kind)
    calls = _forwards(m)
    from heads.scorers.circuits import exact_scores

    g = graph_of(tiny_family_model("qwen2"))
    fake = EdgeScores(g, torch.zeros(g.n_upstream, g.n_downstream), "eap")
    for call in (
        lambda: graph_of(m),
        lambda: edge_scores(m, _pairs(), progress=False),
        lambda: exact_scores(m, _pairs(), progress=False),
        lambda: find_circuit(m, _pairs(), progress=False),
        lambda: faithfulness_curve(m, _pairs(), fake),
        lambda: evaluate(m, _pairs(), torch.zeros(1, g.n_upstream, g.n_downstream, dtype=torch.bool)),
    ):
        with pytest.raises(HeadsteerValueError, match=f"model_type '{kind}'") as err:
            call()
        _one_line(err)
    assert not calls


def test_pairs_of_unequal_length_refused(qwen2, no_forward):
    with pytest.raises(HeadsteerValueError) as err:
        pairs_from_tokens([[5, 6, 7]], [[5, 6]], [5], [6])
    _one_line(err)
    # a PairBatch whose corrupted ids were widened afterwards: refused by the scorers themselves
    p = _pairs()
    p.corrupted_ids = torch.cat([p.corrupted_ids, p.corrupted_ids[:, :1]], dim=1)
    for call in (
        lambda: edge_scores(qwen2, p, progress=False),
        lambda: find_circuit(qwen2, p, progress=False),
        lambda: evaluate(qwen2, p, select(_fake(qwen2), 5)),
    ):
        with pytest.raises(HeadsteerValueError, match="one shape") as err:
            call()
        _one_line(err)


def test_circuit_file_for_another_geometry_refused(saved, tmp_path):
    c, _ = saved
    path = c.save(tmp_path / "c.json")
    other = tiny_family_model("gpt2")  # 4 KV heads, not 2
    calls = _forwards(other)
    with pytest.raises(HeadsteerValueError, match="n_kv_heads") as err:
        Circuit.load(path, model=other)
    _one_line(err)
    with pytest.raises(HeadsteerValueError, match="n_kv_heads") as err:
        evaluate(other, _pairs(), Circuit.load(path))
    _one_line(err)
    assert not calls


@pytest.mark.parametrize("steps", [0, -1, -5])
def test_m_not_positive_refused(qwen2, no_forward, steps):
    for call in (
        lambda: edge_scores(qwen2, _pairs(), method="eap-ig", steps=steps, progress=False),
        lambda: find_circuit(qwen2, _pairs(), method="eap-ig", steps=steps, progress=False),
    ):
        with pytest.raises(HeadsteerValueError, match="steps") as err:
            call()
        assert str(steps) in _one_line(err)


@pytest.mark.parametrize("bad", [0, -1, 100.001, 1e9, float("inf")])
def test_sizes_outside_0_100_refused(qwen2, no_forward, bad):
    for call in (
        lambda: faithfulness_curve(qwen2, _pairs(), _fake(qwen2), sizes=[5, bad]),
        lambda: find_circuit(qwen2, _pairs(), size=bad, progress=False),
        lambda: find_circuit(qwen2, _pairs(), sizes=[bad], progress=False),
    ):
        with pytest.raises(HeadsteerValueError, match="size") as err:
            call()
        _one_line(err)
