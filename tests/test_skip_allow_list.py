"""A test run fails on a skip that is not on the allow-list (`tests/support/skips.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.skips import ALLOWED_SKIPS, unlisted_skip

ROOT = Path(__file__).resolve().parents[1]


def test_a_skip_off_the_list_fails_the_run(tmp_path):
    (tmp_path / "test_some.py").write_text(
        "import pytest\n\n"
        "def test_passes():\n    assert True\n\n"
        "def test_cuda_only():\n    pytest.skip('needs CUDA')\n\n"
        "def test_hidden_hole():\n    pytest.skip('no local mirror of the reference')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HEADSTEER_ALLOW_SKIPS"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "tests.conftest", "-p", "no:cacheprovider", "."]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout[-2000:]
    summary = res.stdout.split("skips not on the allow-list")[-1]
    assert "test_hidden_hole: no local mirror of the reference" in summary
    assert "test_cuda_only" not in summary  # allowed
    assert "1 passed, 2 skipped" in res.stdout  # reported with -rs, and nothing failed


class _Report:
    def __init__(self, reason: str, skipped: bool = True, **extra):
        self.nodeid, self.skipped = "t.py::x", skipped
        self.longrepr = ("t.py", 3, f"Skipped: {reason}")
        self.__dict__.update(extra)


def test_unlisted_skip_reads_the_reason():
    assert unlisted_skip(_Report("needs a CUDA device besides the CPU")) is None
    assert all(unlisted_skip(_Report(a)) is None for a in ALLOWED_SKIPS)
    assert unlisted_skip(_Report("needs Debian's chromium")) == "t.py::x: needs Debian's chromium"
    assert unlisted_skip(_Report("anything", skipped=False)) is None
    assert unlisted_skip(_Report("expected failure", wasxfail="flaky")) is None  # an xfail, not a skip
