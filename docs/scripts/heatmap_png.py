"""Redraw docs/img/head_heatmap.png: the span-attention heatmap of the embedded model.

Run from the repository root: `.venv/bin/python docs/scripts/heatmap_png.py` (needs Debian's
`chromium` for the headless screenshot; about 30 s on a 2-core CPU).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from heads import load_model, span_attention
from viz.figures import head_heatmap

OUT = Path(__file__).resolve().parents[1] / "img" / "head_heatmap.png"
PROMPT = (
    "Biography: Maria Lopez grew up in Valencia, studied biology, and now works at a hospital "
    "in Madrid, where she leads the night shift of the emergency ward. She spends her weekends "
    'hiking. **Answer in JSON format with the keys "name" and "occupation".** '
    "Question: what is her job?"
)


def main() -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("needs chromium (apt-get install -y chromium)")
    fig = head_heatmap(span_attention(load_model(), PROMPT), top_k=20)
    fig.update_layout(width=1000, height=560, margin=dict(l=60, r=20, t=60, b=50))
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "heatmap.html"
        fig.write_html(page, include_plotlyjs=True, full_html=True, config={"displayModeBar": False})
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--window-size=1000,560",
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
