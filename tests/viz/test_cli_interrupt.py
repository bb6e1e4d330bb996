"""Ctrl-C in the first seconds of a `headsteer` command (while torch and pandas import) prints
one "interrupted" line, no traceback, exit 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _maps_torch(pid: int) -> bool:
    """True once the process has torch's shared library mapped (Linux `/proc/PID/maps`)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc (the CI's platform)")
def test_ctrl_c_while_importing_prints_one_line():
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "viz.cli", "generate", "hello"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    # wait for an observable state, not a time: torch's library is mapped into the process, so
    # `viz.cli.run` has installed its handler and is importing viz.cli.main (torch, pandas, ...)
    deadline = time.monotonic() + 120  # a guard for a broken build only
    while not _maps_torch(proc.pid):
        assert proc.poll() is None, "the command finished before it could be interrupted"
        assert time.monotonic() < deadline, "torch was never imported"
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    text = (out + err).decode()
    assert proc.returncode == 130, text
    assert "Traceback" not in text and text.strip().splitlines()[-1].endswith("interrupted"), text
    assert len(text.strip().splitlines()) == 1, text


def test_viz_cli_app_is_lazy_but_available():
    code = "import sys, viz.cli; assert 'viz.cli.main' not in sys.modules; viz.cli.app; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "ok", res.stderr
