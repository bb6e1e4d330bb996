"""Generated reports open in headless Chromium: no console errors, and the plot is drawn.

Chromium comes from Debian's `chromium` package (`make test` installs it when missing).
"""

import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from viz.cli.main import app

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(autouse=True)
def _needs_chromium():
    assert CHROMIUM, "the browser test needs Debian's chromium package: `make test` installs it"


def render(page: Path, shot: Path, tmp: Path) -> str:
    """Screenshot `page`; return Chromium's log (console messages appear as CONSOLE lines)."""
    cmd = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp / 'profile'}",
        "--window-size=1200,1400",
        "--virtual-time-budget=8000",
        "--enable-logging=stderr",
        "--v=0",
        f"--screenshot={shot}",
        page.resolve().as_uri(),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.is_file(), res.stderr[-2000:]
    return res.stderr


def console_errors(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if "CONSOLE" in ln and ("Error" in ln or "error" in ln)]


def plot_pixels(shot: Path) -> int:
    """Distinct colours in the screenshot (a blank or text-only page has very few)."""
    img = Image.open(shot).convert("RGB").resize((300, 350))
    return len(img.getcolors(maxcolors=300 * 350) or [])


def test_detector_sees_errors_and_blank_pages(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>undefinedFunctionCall();</script></body></html>")
    log = render(bad, tmp_path / "bad.png", tmp_path)
    assert console_errors(log)
    assert plot_pixels(tmp_path / "bad.png") < 10


def test_attention_report_renders(tiny_llama_dir, tmp_path):
    d = tiny_llama_dir
    out = tmp_path / "report.html"
    r = CliRunner().invoke(
        app, ["report", "attention", "--prompt", "Read **this** now.", "--out", str(out), "--model", str(d)]
    )
    assert r.exit_code == 0, r.output
    shot = tmp_path / "report.png"
    log = render(out, shot, tmp_path)
    assert not console_errors(log), console_errors(log)
    assert plot_pixels(shot) > 50  # the heatmap's colour scale is drawn
