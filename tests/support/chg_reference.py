"""The reference CHG forward (`jonhanke/nam_causal-head-gating`, `src/causal_head_gating/core/chg.py`)
run as an oracle: its three source files are read from a local mirror of the repository (git) into
a temporary package; without the mirror the oracle tests are skipped. Nothing is copied into
headsteer."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

MIRROR = os.environ.get("CHG_REFERENCE_GIT", "/work/.mirror/jonhanke+nam_causal-head-gating/repo")
FILES = ("core/chg.py", "models/adapters.py", "utils/helpers.py")


def load_reference(tmp: Path):
    """The reference's `CHG` class, or None when the mirror is not on this machine."""
    if not Path(MIRROR).is_dir():
        return None
    root = tmp / "chg_ref"
    pkg = root / "causal_head_gating"
    for sub in ("", "core", "models", "utils"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    for f in FILES:
        src = subprocess.run(
            ["git", f"--git-dir={MIRROR}", "show", f"HEAD:src/causal_head_gating/{f}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        (pkg / f).write_text(src)
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("causal_head_gating.core.chg").CHG
    finally:
        sys.path.remove(str(root))
