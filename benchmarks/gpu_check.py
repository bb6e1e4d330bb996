"""One command for a GPU machine: the fused-kernel equality tests and the long-context benchmark
on CUDA (Triton kernels). Without CUDA it says so and exits 0.

    python benchmarks/gpu_check.py

Runs `tests/test_fused.py` with `HEADSTEER_TEST_DEVICE=cuda` (the tests move their tiny models
to that device), then `benchmarks/long_context.py --device cuda`, whose JSON line it prints
last. Exits with the tests' status if they fail.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (the CPU runs are in `make test`)")
        return 0
    env = {**os.environ, "HEADSTEER_TEST_DEVICE": "cuda"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fused.py"]
    rc = subprocess.run(tests, cwd=ROOT, env=env).returncode
    if rc:
        print(f"gpu_check: fused-kernel tests failed on CUDA (exit {rc})")
        return rc
    bench = [sys.executable, os.path.join(ROOT, "benchmarks", "long_context.py"), "--device", "cuda"]
    return subprocess.run(bench, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
