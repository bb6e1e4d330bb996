"""Release habits: one version in one place, typed packages, the test tiers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_one_version_everywhere():
    import heads
    from heads._version import __version__

    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    assert heads.__version__ == __version__
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'dynamic = ["version"]' in pyproject and 'attr = "heads._version.__version__"' in pyproject
    assert not re.search(r'^version\s*=\s*"', pyproject, re.M)  # no second copy in the metadata
    from typer.testing import CliRunner

    from viz.cli.main import app

    out = CliRunner().invoke(app, ["--version"])
    assert out.exit_code == 0 and out.output.strip() == f"headsteer {__version__}"


def test_setuptools_reads_the_same_version():
    code = "from setuptools.config.expand import read_attr; print(read_attr('heads._version.__version__'))"
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    from heads._version import __version__

    assert got.stdout.strip() == __version__


def test_every_package_is_typed():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for pkg in ("heads", "steer", "probes", "viz"):
        assert (ROOT / pkg / "py.typed").is_file(), pkg
        assert re.search(rf'^{pkg} = \[[^\]]*"py\.typed"', pyproject, re.M), pkg


def test_fast_tier_and_lint_cover_the_four_packages():
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "not real and not slow" in make
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'files = \["heads", "steer", "probes", "viz"\]', pyproject)
    assert 'python_version = "3.10"' in pyproject
