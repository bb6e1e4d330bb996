"""`benchmarks/gpu_check.py` cannot go stale: its dry run resolves and runs every step on the
CPU at a tiny size, and its list of device tests holds every test file that depends on the device."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_device_tests_are_every_device_dependent_test_file():
    mod = _gpu_check()
    device_dependent = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests").rglob("test_*.py")
        if p.name != "test_gpu_check.py"
        and re.search(r"HEADSTEER_TEST_DEVICE|cuda\.is_available\(\)", p.read_text(encoding="utf-8"))
    }
    assert device_dependent == set(mod.DEVICE_TESTS)
    assert all((ROOT / f).is_file() for f in mod.DEVICE_TESTS)


def test_dry_run_runs_every_step(capsys):
    mod = _gpu_check()
    rc = mod.main(["--dry-run"])
    out = capsys.readouterr().out.strip().splitlines()
    line = json.loads(out[-1])
    assert rc == 0 and line["failed"] == [] and line["dry_run"] is True and line["device"] == "cpu"
    for step in mod.STEPS:
        assert "error" not in line[step], (step, line[step])
    assert line["tests"]["files"] == list(mod.DEVICE_TESTS)
    assert line["kernel"]["forward_max_abs_diff_float32"] < 1e-5  # the kernel against the softmax oracle
    lc = line["long_context"]
    for name in ("forward", "pasta_fused", "dla", "patch_head_out_last_layer"):
        assert len(lc[f"seconds_{name}"]) == len(lc["lengths"]) == 2
        assert all(t > 0 for t in lc[f"seconds_{name}"])
    cells = line["patching"]["head_out_cells_per_s"] * line["patching"]["head_out_s"]
    assert abs(cells - 3 * 4) < 0.1  # the dry run's model: 3 layers x 4 heads
    assert line["eap_ig"]["edges"] > 0 and line["eap_ig"]["eap_ig_s"] > 0
    assert {"time_ratio_pasta", "time_ratio_instaboost"} <= line["generation"].keys()
