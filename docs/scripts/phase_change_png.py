"""Redraw docs/img/phase_change.png: the induction phase change of the attention-only organism.

Run from the repository root: `.venv/bin/python docs/scripts/phase_change_png.py [RUN [PARTS]]`,
RUN an organism run folder (`headsteer build organism --out organism` writes `organism/attn-only`;
without RUN the recipe is trained into a temporary folder first, a few minutes), PARTS a folder
for the per-checkpoint results (a second call with the same PARTS redraws without recomputing).
Needs Debian's `chromium` for the headless screenshot.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from heads.dynamics import over_checkpoints
from heads.dynamics.phase import phase_change
from probes.organism.recipe import ATTN_ONLY, train_organism
from viz.dynamics import phase_change_figure

OUT = Path(__file__).resolve().parents[1] / "img" / "phase_change.png"
WIDTH, HEIGHT = 1000, 900


def main() -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("needs chromium (apt-get install -y chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp) / "run"
        if len(sys.argv) == 1:
            train_organism(ATTN_ONLY, run)
        parts = Path(sys.argv[2]) if len(sys.argv) > 2 else None
        series = over_checkpoints(run, "induction_phase", {"n": 16}, results_dir=parts, progress=False)
        phase = phase_change(series)
        fig = phase_change_figure(phase)
        fig.update_layout(width=WIDTH, height=HEIGHT, margin=dict(l=60, r=20, t=60, b=50))
        page = Path(tmp) / "phase.html"
        fig.write_html(page, include_plotlyjs=True, full_html=True, config={"displayModeBar": False})
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--window-size={WIDTH},{HEIGHT}",
                "--virtual-time-budget=5000",
                f"--screenshot={OUT}",
                page.as_uri(),
            ],
            check=True,
            capture_output=True,
        )
    print(OUT)


if __name__ == "__main__":
    main()
