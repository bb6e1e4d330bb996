"""Writing a file never changes the process umask (another thread's mkdir would get mode 0o777)."""

from __future__ import annotations

import os
import stat

import pytest

from heads._util import files


def _forbid_umask(*args: object) -> int:
    raise AssertionError("os.umask called while writing: it changes the mask for every thread")


def test_write_never_sets_the_umask_and_gives_the_umask_mode(tmp_path, monkeypatch):
    mask = os.umask(0o027)
    os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", _forbid_umask)
        out = files.write_text(tmp_path / "sub" / "a.json", "{}")
        assert files.current_umask() == 0o027
    finally:
        monkeypatch.undo()
        os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~0o027


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux /proc only")
def test_current_umask_reads_the_live_mask():
    mask = os.umask(0o077)
    try:
        assert files.current_umask() == 0o077
    finally:
        os.umask(mask)
