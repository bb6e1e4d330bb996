"""The moved modules' old paths (one release): one table (`heads._util.aliases.ALIASES`), no stub
files; each old path warns once and gives the new module itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from heads._util.aliases import ALIASES

ROOT = Path(__file__).resolve().parents[1]

CODE = r"""
import importlib, json, sys, warnings
# an editable install of another tree may sit on sys.meta_path: the table must still decide
table = json.loads(sys.argv[1])
light = {}
import viz
light["torch_after_import_viz"] = "torch" in sys.modules
out = {}
for old, new in table.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    again = importlib.import_module(old)
    out[old] = {
        "same": mod is importlib.import_module(new) and again is mod,
        "warnings": [str(w.message) for w in caught if w.category is DeprecationWarning],
    }
print(json.dumps({"light": light, "out": out}))
"""


def test_every_old_path_gives_the_new_module_with_one_warning():
    res = subprocess.run(
        [sys.executable, "-c", CODE, json.dumps(ALIASES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["light"]["torch_after_import_viz"] is False  # viz's finder imports heads only on demand
    for old, new in ALIASES.items():
        r = got["out"][old]
        assert r["same"], old
        assert r["warnings"] == [
            f"{old} moved to {new}; import it from there (this alias goes in headsteer 0.3.0)"
        ], (old, r["warnings"])


def test_no_old_path_is_also_a_file_and_every_target_exists():
    for old, new in ALIASES.items():
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), f"{old}: a stub file and an alias"
        assert (ROOT / (new.replace(".", "/") + ".py")).exists() or (ROOT / new.replace(".", "/")).is_dir(), (
            new
        )


def test_an_unknown_path_is_still_an_import_error():
    res = subprocess.run(
        [sys.executable, "-c", "import viz.no_such_module"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1 and "ModuleNotFoundError: No module named 'viz.no_such_module'" in res.stderr
    res = subprocess.run(
        [sys.executable, "-c", "import heads.no_such_module"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1 and "ModuleNotFoundError: No module named 'heads.no_such_module'" in res.stderr
