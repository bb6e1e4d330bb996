"""`headsteer report all`: every available report into one folder, with an index page."""

from __future__ import annotations

import html
from pathlib import Path

from heads import HeadModel
from heads.progress import Progress

from .demo import DEMO_PROMPT
from .maps_report import maps_report
from .steering import DEFAULT_TOP_K, attention_report, choose_heads, compare

__all__ = ["all_reports"]


def all_reports(
    model: HeadModel,
    out: str | Path,
    *,
    draws: int = 5,
    n_prompts: int = 30,
    progress: Progress | None = None,
) -> dict[str, Path]:
    """Write `attention.html` (+ CSV; PASTA on the demo prompt), `maps.html` and `index.html`.

    `progress(done, total)` (`heads.progress`) counts steps: one for the attention report,
    then the MAPS analysis' steps (`heads.maps_analysis.maps_analysis`); `total` is known once
    the relations are loaded.

    Returns name -> path of every file written.
    """
    say = progress or (lambda done, total: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    heads = choose_heads(model, DEMO_PROMPT, "span", DEFAULT_TOP_K)
    comp = compare(model, DEMO_PROMPT, heads, max_new_tokens=48)
    att, csv, _ = attention_report(model, DEMO_PROMPT, out / "attention.html", comparison=comp)
    say(1, 2)
    maps, _ = maps_report(
        model, out / "maps.html", draws=draws, n_prompts=n_prompts, progress=lambda d, t: say(1 + d, 1 + t)
    )
    items = [
        ("attention.html", "Attention mass on an emphasized span, and PASTA steering on the demo prompt"),
        ("attention.csv", "The span attention scores as a table"),
        ("maps.html", "MAPS: what each head does from its weights, validated against inference"),
    ]
    links = "".join(f"<li><a href='{f}'>{f}</a> — {html.escape(d)}</li>" for f, d in items)
    index = out / "index.html"
    index.write_text(
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>headsteer reports</title></head>"
        f"<body style='font-family:system-ui,sans-serif'><h1>headsteer reports</h1>"
        f"<p>model {html.escape(model.name)}</p><ul>{links}</ul></body></html>",
        encoding="utf-8",
    )
    return {"index": index, "attention": att, "attention_csv": csv, "maps": maps}
