"""Streamed activations never half-write the user's file: temp file beside it, renamed on
success; free space checked first; folders that cannot be written refused before any work."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import probes.head_probes as hp
from heads._util.files import check_output, check_writable
from heads.errors import HeadsteerValueError

PROMPTS = ["one two three", "four five", "six", "seven eight nine ten"]
KW = {"batch_size": 2, "progress": False}


def test_interrupt_leaves_the_previous_file_untouched(tiny_llama, tmp_path, monkeypatch):
    target = tmp_path / "acts.f32"
    target.write_bytes(b"previous results")
    real = hp.forward
    calls = {"n": 0}

    def forward(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(hp, "forward", forward)
    with pytest.raises(KeyboardInterrupt):
        hp.collect_head_outputs(
            tiny_llama, PROMPTS, batch_size=2, path=target, overwrite=True, progress=False
        )
    assert target.read_bytes() == b"previous results"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acts.f32"]  # no temp file left
    monkeypatch.setattr(hp, "forward", real)
    out = hp.collect_head_outputs(
        tiny_llama, PROMPTS, batch_size=2, path=target, overwrite=True, progress=False
    )
    want = hp.collect_head_outputs(tiny_llama, PROMPTS, batch_size=2, progress=False)
    assert torch.equal(out, want)
    on_disk = np.fromfile(target, dtype=np.float32).reshape(want.shape)
    assert np.array_equal(on_disk, want.numpy())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acts.f32"]


def test_too_little_space_is_refused_before_work(tiny_llama, tmp_path, monkeypatch):
    import shutil

    class Usage:
        total, used, free = 10**9, 10**9, 100

    monkeypatch.setattr(shutil, "disk_usage", lambda _p: Usage)
    monkeypatch.setattr(hp, "forward", lambda *a, **k: pytest.fail("work started"))
    with pytest.raises(HeadsteerValueError, match="MiB free"):
        hp.collect_head_outputs(tiny_llama, PROMPTS, path=tmp_path / "a.f32", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_failed_reservation_is_a_clear_error(tiny_llama, tmp_path, monkeypatch):
    def full(fd, off, n):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(HeadsteerValueError, match="No space left on device"):
        hp.collect_head_outputs(tiny_llama, PROMPTS, path=tmp_path / "a.f32", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_folder_fails_the_output_check():
    # /proc refuses new files even for root: permission bits would not tell
    with pytest.raises(HeadsteerValueError, match="cannot write into"):
        check_output("/proc/headsteer-test/report.html")
    with pytest.raises(HeadsteerValueError, match="cannot write into"):
        check_writable(Path("/proc"))


def test_writable_folder_check_leaves_nothing(tmp_path):
    check_output(tmp_path / "new" / "deeper" / "out.json")
    assert list(tmp_path.iterdir()) == []
