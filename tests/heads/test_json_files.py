"""Every JSON / JSONL file a user gives headsteer goes through `heads._util.validation.parse_json`:
a 5000-digit integer (past Python's 4300-digit `int(str)` limit) is one line naming the file
(and the line of a JSONL file), never Python's advice to call `sys.set_int_max_str_digits()`;
invalid JSON says where (line and column)."""

from __future__ import annotations

import json
import sys

import pytest

from heads._util.validation import MAX_JSON_INT_DIGITS, parse_json, read_json_file, read_jsonl_file
from heads.errors import HeadsteerValueError

BIG = "7" * 5000
REC = {"clean": "a b", "corrupted": "a c", "answer": " b"}


def _head_file(path):
    from heads import HeadSet

    HeadSet.parse(path)


def _scores(path):
    from heads.results.scores import HeadScores

    HeadScores.load(path)


def _gating(path):
    from heads.scorers.gating.chg import GatingResult

    GatingResult.load(path)


def _patching(path):
    from heads.scorers.patching.activation import PatchResult

    PatchResult.load(path)


def _circuit(path):
    from heads.scorers.circuits.circuit import Circuit

    Circuit.load(path)


def _atlas(path):
    from heads.scorers.roles.atlas import HeadAtlas

    HeadAtlas.load(path)


JSON_READERS = {
    "head file": _head_file,
    "HeadScores": _scores,
    "GatingResult": _gating,
    "PatchResult": _patching,
    "Circuit": _circuit,
    "HeadAtlas": _atlas,
}


def _assert_one_clear_line(err: BaseException, *parts: str) -> None:
    msg = str(err)
    assert "\n" not in msg
    assert "set_int_max_str_digits" not in msg and "Exceeds the limit" not in msg
    for part in parts:
        assert part in msg, msg


@pytest.mark.parametrize("kind", sorted(JSON_READERS))
def test_json_file_with_a_5000_digit_integer_is_one_clear_line(tmp_path, kind):
    f = tmp_path / "big.json"
    f.write_text('{"schema": "headsteer", "0": [' + BIG + "]}")
    with pytest.raises(HeadsteerValueError) as info:
        JSON_READERS[kind](f)
    _assert_one_clear_line(
        info.value,
        f"a number in {str(f)!r} is too large: an integer of 5000 digits, more than the limit of 4300",
    )


@pytest.mark.parametrize("kind", sorted(JSON_READERS))
def test_invalid_json_file_names_file_line_and_column(tmp_path, kind):
    f = tmp_path / "bad.json"
    f.write_text('{\n  "0": [1,\n  ]}')
    with pytest.raises(HeadsteerValueError) as info:
        JSON_READERS[kind](f)
    _assert_one_clear_line(info.value, f"{str(f)!r} is not valid JSON: Expecting value (line 3, column 3)")


def _pairs(path):
    from heads.scorers.patching.pairs import load_pairs

    load_pairs(path)


def _prompts(path):
    from viz.reports.safety import read_prompts

    read_prompts(path)


JSONL_READERS = {"pairs / task file": _pairs, "prompt file": _prompts}


@pytest.mark.parametrize("kind", sorted(JSONL_READERS))
def test_jsonl_line_with_a_5000_digit_integer_names_the_line(tmp_path, kind):
    f = tmp_path / "big.jsonl"
    good = json.dumps({**REC, "prompt": "hi"})
    f.write_text(good + "\n\n" + '{"prompt": "x", "n": -' + BIG + "}\n")
    with pytest.raises(HeadsteerValueError) as info:
        JSONL_READERS[kind](f)
    _assert_one_clear_line(
        info.value, f"a number in {str(f)!r} line 3 is too large: an integer of 5000 digits"
    )


@pytest.mark.parametrize("kind", sorted(JSONL_READERS))
def test_invalid_jsonl_line_names_line_and_column(tmp_path, kind):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({**REC, "prompt": "hi"}) + '\n{"prompt": oops}\n')
    with pytest.raises(HeadsteerValueError) as info:
        JSONL_READERS[kind](f)
    _assert_one_clear_line(info.value, f"{str(f)!r} line 2 is not valid JSON: Expecting value (column 12)")


def test_lens_header_with_a_5000_digit_integer(tmp_path):
    import torch
    from safetensors.torch import save_file

    from heads.scorers.roles.lens import AttentionLens

    f = tmp_path / "l.safetensors"
    save_file({"weight": torch.zeros(2)}, str(f), metadata={"headsteer": '{"schema_version": ' + BIG + "}"})
    with pytest.raises(HeadsteerValueError) as info:
        AttentionLens.load(f)
    _assert_one_clear_line(
        info.value, f"a number in the header of {str(f)!r} is too large: an integer of 5000"
    )


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_model_config_with_a_5000_digit_integer(tmp_path, name):
    from heads.model.loading import check_config, check_no_remote_code

    (tmp_path / name).write_text('{"num_hidden_layers": ' + BIG + "}")
    with pytest.raises(HeadsteerValueError) as info:
        check_no_remote_code(tmp_path)
    _assert_one_clear_line(
        info.value, f"cannot read the model in {str(tmp_path)!r}: a number in {name!r} is too large"
    )
    if name == "config.json":
        with pytest.raises(HeadsteerValueError) as info:
            check_config(tmp_path)
        _assert_one_clear_line(
            info.value, "a number in 'config.json' is too large: an integer of 5000 digits"
        )


def test_parse_json_digit_limit_is_exact():
    assert MAX_JSON_INT_DIGITS == 4300 == (sys.get_int_max_str_digits() or 4300)
    ok = "9" * MAX_JSON_INT_DIGITS
    assert parse_json("[-" + ok + "]", "x") == [-(10**MAX_JSON_INT_DIGITS - 1)]
    with pytest.raises(HeadsteerValueError, match="^a number in x is too large: an integer of 4301 digits"):
        parse_json("[-" + ok + "1]", "x")
    # a long float is no integer: Python parses it (no digit limit), so it is accepted
    assert parse_json("1." + "0" * 5000, "x") == 1.0


def test_parse_json_other_failures_are_one_line():
    with pytest.raises(HeadsteerValueError, match=r"^w is not valid JSON: nested too deeply to parse$"):
        parse_json("[" * 100_000, "w")
    with pytest.raises(HeadsteerValueError, match=r"^w is not valid JSON: not valid UTF-8 text$"):
        parse_json(b'{"a": "\xff"}', "w")
    with pytest.raises(HeadsteerValueError, match=r"^w line 4 is not valid JSON: Extra data \(column 4\)$"):
        parse_json("{} x", "w line 4", line=4)


def test_read_helpers_number_lines_and_skip_blanks(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text('{"a": 1}\n\n  \n[2, 3]\n')
    assert list(read_jsonl_file(f)) == [(1, {"a": 1}), (4, [2, 3])]
    g = tmp_path / "r.json"
    g.write_text('{"a": [1, 2.5, null]}')
    assert read_json_file(g) == {"a": [1, 2.5, None]}


def test_json_metrics_accepts_a_long_integer_in_generated_text():
    from probes.metrics.tasks import json_metrics

    # valid JSON by the spec; Python's int() would refuse it: kept as its text, compared as text
    out = json_metrics('answer: {"n": ' + BIG + ', "name": "Ada"}', {"name": "ada", "n": "777"})
    assert out == {"json_valid": True, "field_accuracy": 1.0}
