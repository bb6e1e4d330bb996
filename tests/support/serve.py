"""Start `headsteer serve` in a subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_subprocess(model_dir: str, args: list[str], logf: Path, start_s: float = 180) -> Iterator[str]:
    """`headsteer serve --model model_dir --port P *args`, stderr in `logf`; yields its base URL once
    `/v1/models` answers and kills it afterwards. Raises RuntimeError (with the log tail) if the
    server exits first; fails the test if it has not started within `start_s` seconds."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "viz.cli", "serve", "--model", model_dir, "--port", str(port), *args]
    with open(logf, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {logf.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(base + "/v1/models", timeout=5).read()
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.3)
        yield base
    finally:
        proc.kill()
        proc.wait(30)
