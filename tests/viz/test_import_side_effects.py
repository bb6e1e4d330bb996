"""Importing headsteer's modules changes nothing in the process environment (the CLI sets
HF_HUB_OFFLINE in its entry point, not at import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = ["heads", "steer", "probes", "viz.cli.main", "viz.cli.common", "viz.server.app", "viz.explorer.app"]


def test_importing_the_packages_sets_no_environment_variable():
    code = (
        "import importlib, json, os, sys\n"
        "before = dict(os.environ)\n"
        f"for m in {MODULES!r}:\n"
        "    importlib.import_module(m)\n"
        "after = dict(os.environ)\n"
        "print(json.dumps(sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    changed = json.loads(out.stdout.strip().splitlines()[-1])
    assert "HF_HUB_OFFLINE" not in changed, changed


def test_the_cli_entry_point_runs_offline_by_default():
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    code = (
        "import os, sys\n"
        "sys.argv = ['headsteer', '--version']\n"
        "import viz.cli\n"
        "try:\n"
        "    viz.cli.run()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('OFFLINE=' + os.environ.get('HF_HUB_OFFLINE', ''))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert "OFFLINE=1" in out.stdout, (out.stdout, out.stderr[-2000:])
