"""`load_pairs` on bad files: binary, a directory, invalid JSON lines, a split filter."""

from __future__ import annotations

import json

import pytest

from heads.errors import HeadsteerValueError
from heads.scorers.patching.pairs import load_pairs

REC = {"clean": "a b", "corrupted": "a c", "answer": " b"}


def test_binary_file_names_the_file_and_line(tmp_path):
    f = tmp_path / "bin.jsonl"
    f.write_bytes(json.dumps(REC).encode() + b"\n\xff\xfe\x00\x81\n")
    with pytest.raises(
        HeadsteerValueError, match=r"bin\.jsonl. line 2 is not valid JSON: not valid UTF-8 text"
    ):
        load_pairs(f)


def test_directory_is_named_a_directory(tmp_path):
    with pytest.raises(HeadsteerValueError, match="is a directory"):
        load_pairs(tmp_path)
    with pytest.raises(HeadsteerValueError, match="does not exist"):
        load_pairs(tmp_path / "missing.jsonl")


def test_invalid_json_line_is_named(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(REC) + "\n\n{not json\n")
    with pytest.raises(
        HeadsteerValueError, match=r"p\.jsonl. line 3 is not valid JSON: Expecting property name"
    ):
        load_pairs(f)


def test_split_keeps_only_matching_records(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [{**REC, "answer": f" {i}", "split": "train" if i % 2 else "test"} for i in range(5)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p.answer for p in load_pairs(f, "train")] == [" 1", " 3"]
    assert len(load_pairs(f)) == 5
