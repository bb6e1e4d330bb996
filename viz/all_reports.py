"""`headsteer report all`: every available report into one folder, with an index page."""

from __future__ import annotations

import html
from pathlib import Path

from heads import HeadModel
from probes.relations import relation_names

from .demo import DEMO_PROMPT
from .maps_report import maps_report
from .steering import DEFAULT_TOP_K, attention_report, choose_heads, compare

__all__ = ["all_reports", "report_steps"]


def all_reports(
    model: HeadModel, out: str | Path, *, draws: int = 5, n_prompts: int = 30, progress=None
) -> dict[str, Path]:
    """Write `attention.html` (+ CSV; PASTA on the demo prompt), `maps.html` and `index.html`.

    Returns name -> path of every file written.
    """
    say = progress or (lambda msg: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    say("attention report: scoring heads and steering the demo prompt")
    heads = choose_heads(model, DEMO_PROMPT, "span", DEFAULT_TOP_K)
    comp = compare(model, DEMO_PROMPT, heads, max_new_tokens=48)
    att, csv, _ = attention_report(model, DEMO_PROMPT, out / "attention.html", comparison=comp)
    maps, _ = maps_report(model, out / "maps.html", draws=draws, n_prompts=n_prompts, progress=say)
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


def report_steps() -> int:
    """Progress steps `all_reports` reports: attention, then maps (static, dynamic, each relation)."""
    return 1 + 2 + len(relation_names())
