"""`short_repr` / `int_digits` (heads._util.validation) and the one-line, short messages they
give public entry points fed a huge value: a 5000-digit int, a 1 MB string, a 10^6-item list
(issue 29: the whole value used to be printed into the message)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from heads import HeadScores
from heads._util.validation import check_int, check_layer_list, check_number, int_digits, short_repr
from heads.errors import HeadsteerError
from steer import Pasta
from steer.serving import parse_steer

BIG_INT = 10**5000  # 5001 digits: str() refuses it (Python's 4300-digit limit)
BIG_STR = "x" * 1_000_000
BIG_LIST = list(range(1_000_000))


@pytest.mark.parametrize(
    "n",
    [0, 1, 9, 10, 99, 100, 999, 10**15 - 1, 10**15, 2**53, 10**100 - 1, 10**100, 10**4000, -(10**17)],
)
def test_int_digits_matches_str(n):
    assert int_digits(n) == len(str(abs(n)))


def test_int_digits_beyond_strs_limit():
    assert int_digits(BIG_INT) == 5001 and int_digits(BIG_INT - 1) == 5000 and int_digits(-BIG_INT) == 5001
    assert int_digits(2**100_000) == 30103  # log10(2) * 100000 = 30102.99...


@pytest.mark.parametrize(
    "value",
    [
        5,
        -3,
        1.5,
        True,
        None,
        "ab",
        "it's",
        b"\x00b",
        [1, [2, 3]],
        (1,),
        (),
        {"a": 1, 2: [3]},
        {1, 2},
        frozenset(),
    ],
)
def test_short_values_are_their_exact_repr(value):
    assert short_repr(value) == repr(value)


def test_a_value_at_the_limit_is_whole_and_one_more_is_cut():
    s = "y" * 78  # repr: 80 characters
    assert short_repr(s) == repr(s)
    assert short_repr(s + "y") == repr(s)[:77] + "... (a str of 79 characters)"
    assert short_repr(10**79) == str(10**79)  # 80 digits
    assert short_repr(10**80) == "an int of 81 digits"


def test_huge_values_are_cut_and_their_size_named():
    assert short_repr(BIG_INT) == "an int of 5001 digits"
    assert short_repr(-BIG_INT) == "a negative int of 5001 digits"
    assert short_repr(BIG_STR) == "'" + "x" * 76 + "... (a str of 1000000 characters)"
    text = short_repr(BIG_LIST)
    assert text.startswith("[0, 1, 2, 3,") and text.endswith("... (a list of 1000000 items)")
    assert len(text) == 77 + len("... (a list of 1000000 items)")
    assert short_repr({str(i): i for i in range(1000)}).endswith("... (a dict of 1000 keys)")
    assert short_repr(b"z" * 500).endswith("... (a bytes value of 500 bytes)")
    assert short_repr([BIG_INT]) == "[<an int of 5001 digits>] (a list of 1 item)"
    arr = short_repr(np.zeros((300, 300)))
    assert "\n" not in arr and arr.endswith("(an ndarray of shape (300, 300))")
    assert short_repr(torch.zeros(100, 100)).endswith("(a Tensor of shape (100, 100))")
    assert short_repr(BIG_STR, limit=20) == "'" + "x" * 16 + "... (a str of 1000000 characters)"


def test_self_containing_and_bad_reprs():
    a: list = [1]
    a.append(a)
    assert short_repr(a) == repr(a) == "[1, [...]]"

    class Bad:
        def __repr__(self):
            raise RuntimeError("no repr")

    assert short_repr(Bad()) == "<a Bad>"


def _short_error(make) -> str:
    with pytest.raises((HeadsteerError, FileNotFoundError)) as info:
        make()
    msg = str(info.value)
    assert len(msg) < 300 and "\n" not in msg, msg[:500]
    return msg


def test_validators_stay_short():
    assert (
        _short_error(lambda: check_int("k", BIG_INT, hi=10))
        == "k must be an int <= 10, got an int of 5001 digits"
    )
    assert "a str of 1000000 characters" in _short_error(lambda: check_int("k", BIG_STR))
    assert "a str of 1000000 characters" in _short_error(lambda: check_number("x", BIG_STR))
    assert "(a list of 1000001 items)" in _short_error(lambda: check_layer_list("layers", [*BIG_LIST, "a"]))


def test_public_entry_points_stay_short(tmp_path):
    assert "got int" in _short_error(lambda: Pasta(heads=BIG_INT))
    assert "..." in _short_error(lambda: Pasta(heads=BIG_STR))
    assert "an int of 5001 digits" in _short_error(
        lambda: parse_steer([{"method": "pasta", "alpha": BIG_INT}])
    )
    assert "a str of 1000000 characters" in _short_error(lambda: parse_steer([{"method": BIG_STR}]))
    assert "a str of 1000000 characters" in _short_error(
        lambda: parse_steer([{"method": "spotlight", "tau": BIG_STR}])
    )
    assert "a list of 1000000 items" in _short_error(
        lambda: parse_steer([{"method": "pasta", "heads": BIG_LIST}])
    )
    assert "a str of 1000000 characters" in _short_error(
        lambda: parse_steer([{"method": "pasta", BIG_STR: 1}])
    )


def test_score_file_with_huge_fields_stays_short(tmp_path):
    p = HeadScores(torch.rand(2, 3), method="m", model="x").save(tmp_path / "s.json")
    data = json.loads(p.read_text())
    for field, value, size in (
        ("model", BIG_LIST, "a list of 1000000 items"),
        ("n_layers", BIG_STR, "1000000"),
    ):
        q = tmp_path / f"{field}.json"
        q.write_text(json.dumps({**data, field: value}))
        assert size in _short_error(lambda q=q: HeadScores.load(q))
    data["scores"][0][0] = "s" * 100_000
    p.write_text(json.dumps(data))
    assert "a str of 100000 characters" in _short_error(lambda: HeadScores.load(p))


def test_huge_head_and_layer_indices_stay_short(tiny_llama):
    """A head spec's ints are formatted into "unknown head ..." messages: a 5000-digit one used
    to hit Python's int-to-str limit (a ValueError advising sys.set_int_max_str_digits)."""
    from heads import HeadSet
    from steer import SteeredModel

    msg = _short_error(lambda: HeadSet.parse([[0, BIG_INT]], 3, 4))
    assert msg == "unknown head an int of 5001 digits in layer 0: the model has heads 0..3"
    assert "unknown layer an int of 5001 digits" in _short_error(
        lambda: HeadSet.parse({0: [1], BIG_INT: [0]}, 3, 4)
    )
    msg = _short_error(
        lambda: SteeredModel(tiny_llama).generate("Hi **there**", Pasta(heads=[BIG_INT]), max_new_tokens=1)
    )
    assert "5001 digits" in msg and "set_int_max_str_digits" not in msg


def test_huge_layer_indices_of_steering_methods_stay_short(tiny_llama):
    from heads import HeadScale, editing
    from steer import AdaptVis, Caa, InstaBoost, Spotlight, SteeredModel

    sm = SteeredModel(tiny_llama)
    runs = {
        "unknown layer an int of 5001 digits": lambda: sm.generate("Hi **a**", Spotlight(layers=[BIG_INT])),
        "InstaBoost layer(s) [<an int of 5001 digits>]": lambda: sm.generate(
            "Hi **a**", InstaBoost(layers=[BIG_INT])
        ),
        "AdaptVis layer(s) [<an int of 5001 digits>]": lambda: sm.generate(
            "Hi **a**", AdaptVis(layers=[BIG_INT])
        ),
        "CAA layer an int of 5001 digits": lambda: sm.generate("Hi", Caa(torch.ones(64), BIG_INT)),
        "unknown head an int of 5001 digits": lambda: editing(
            tiny_llama, HeadScale(layer=0, heads=[BIG_INT])
        ).__enter__(),
        "max_new_tokens=an int of 5001 digits with the prompt": lambda: sm.generate(
            "Hi", max_new_tokens=BIG_INT
        ),
    }
    for expected, run in runs.items():
        assert expected in _short_error(run)
    with pytest.warns(UserWarning, match="top-k an int of 5001 digits"):
        HeadScores(torch.rand(3, 4), method="m").top(BIG_INT)
