"""`headsteer report all`: every available report into one folder, with an index page."""

from __future__ import annotations

import html
from pathlib import Path

from heads import HeadModel
from heads.files import check_output, write_text
from heads.progress import Progress

from .demo import DEMO_PROMPT
from .maps_report import maps_report
from .steering import DEFAULT_TOP_K, attention_report, choose_heads, compare

__all__ = ["FILES", "all_reports"]


FILES = ("attention.html", "attention.csv", "maps.html", "index.html")
"""The files `all_reports` writes into its folder, in order: the index comes last."""


def all_reports(
    model: HeadModel,
    out: str | Path,
    *,
    draws: int = 5,
    n_prompts: int = 30,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict[str, Path]:
    """Write `attention.html` (+ CSV; PASTA on the demo prompt), `maps.html`, then `index.html`.

    Every file is checked before any work and written atomically (`heads.files`);
    the index is written last, so an index page always links to complete reports.

    `progress(done, total)` (`heads.progress`) counts steps: one for the attention report,
    then the MAPS analysis' steps (`heads.maps_analysis.maps_analysis`); `total` is known once
    the relations are loaded.

    Returns name -> path of every file written.

    Raises:
        ValueError: `out` is a file; one of `FILES` exists there and `overwrite` is
            False, or is a symlink or a folder.
    """
    say = progress or (lambda done, total: None)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{str(out)!r} exists and is not a folder")
    for name in FILES:
        check_output(out / name, overwrite)
    heads = choose_heads(model, DEMO_PROMPT, "span", DEFAULT_TOP_K)
    comp = compare(model, DEMO_PROMPT, heads, max_new_tokens=48)
    att, csv, _ = attention_report(
        model, DEMO_PROMPT, out / "attention.html", comparison=comp, overwrite=overwrite
    )
    say(1, 2)
    maps, _ = maps_report(
        model,
        out / "maps.html",
        draws=draws,
        n_prompts=n_prompts,
        overwrite=overwrite,
        progress=lambda d, t: say(1 + d, 1 + t),
    )
    items = [
        ("attention.html", "Attention mass on an emphasized span, and PASTA steering on the demo prompt"),
        ("attention.csv", "The span attention scores as a table"),
        ("maps.html", "MAPS: what each head does from its weights, validated against inference"),
    ]
    links = "".join(f"<li><a href='{f}'>{f}</a> — {html.escape(d)}</li>" for f, d in items)
    index = write_text(
        out / "index.html",
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>headsteer reports</title></head>"
        f"<body style='font-family:system-ui,sans-serif'><h1>headsteer reports</h1>"
        f"<p>model {html.escape(model.name)}</p><ul>{links}</ul></body></html>",
        overwrite=overwrite,
    )
    return {"index": index, "attention": att, "attention_csv": csv, "maps": maps}
