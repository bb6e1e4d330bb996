"""`headsteer report all`: every available report into one folder, with an index page.

The pages share one `plotly.min.js` written beside them (`viz.reports.base.shared_plotlyjs`), so
the folder holds one copy of plotly.js (4.6 MB) instead of one per page; a single report
(`headsteer report maps`, ...) stays self-contained.
"""

from __future__ import annotations

import html
from pathlib import Path

from heads import HeadModel
from heads._util.files import check_output, write_text
from heads._util.progress import ProgressArg, progress_callback
from heads.errors import HeadsteerValueError
from heads.scorers.maps.analysis import maps_analysis_steps
from probes.datasets.relations import load_relations
from viz.cli.demo import DEMO_PROMPT
from viz.cli.jobs import DEFAULT_TOP_K, attention_report, choose_heads, compare
from viz.reports.base import PLOTLY_JS, shared_plotlyjs
from viz.reports.maps import maps_report

__all__ = ["FILES", "all_reports"]

FILES = (PLOTLY_JS, "attention.html", "attention.csv", "maps.html", "index.html")
"""The files `all_reports` writes into its folder, in order: the index comes last."""
ATTENTION_NEW_TOKENS = 48
"""Tokens of the baseline and the PASTA answer on the attention page."""


def all_reports(
    model: HeadModel,
    out: str | Path,
    *,
    draws: int = 5,
    n_prompts: int = 30,
    relations: str | list[str] | None = "all",
    overwrite: bool = False,
    progress: ProgressArg = True,
) -> dict[str, Path]:
    """Write `plotly.min.js`, `attention.html` (+ CSV; PASTA on the demo prompt), `maps.html`
    and `index.html` into the folder `out`; the pages load the shared `plotly.min.js`.

    `relations` (default all; names or a comma-separated string) are the MAPS relations;
    `draws` and `n_prompts` are the MAPS check's (`heads.scorers.maps.analysis.maps_analysis`).
    Every output path is checked before any work (`heads._util.files.check_output`); the index is
    written last. `progress` (default True: a tqdm bar; False off; or `progress(done,
    total)`, `heads._util.progress`) counts steps: the decoding steps of the attention page's two
    answers (`2 * ATTENTION_NEW_TOKENS`), one for that page, then the MAPS analysis' steps
    (`heads.scorers.maps.analysis.maps_analysis`); `total` is the whole run's, known before any
    work (`heads.scorers.maps.analysis.maps_analysis_steps`).

    Returns:
        name -> path of every file written (`plotly_js`, `attention`, `attention_csv`,
        `maps`, `index`).

    Raises:
        ValueError: `out` is a file; one of `FILES` exists there and `overwrite` is False, or
            is a symlink or a folder.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise HeadsteerValueError(f"{str(out)!r} exists and is not a folder")
    for name in FILES:
        check_output(out / name, overwrite)
    with (
        progress_callback(progress, "reports", "steps") as report,
        shared_plotlyjs(out, overwrite=overwrite) as js,
    ):
        say = report or (lambda done, total: None)
        n = 2 * ATTENTION_NEW_TOKENS  # decoding steps of the two answers, then one for the page
        rs = load_relations(model.tokenizer, relations, d_vocab=model.d_vocab)
        grand = n + 1 + maps_analysis_steps(model, rs, draws)  # the whole run, known up front
        heads = choose_heads(model, DEMO_PROMPT, "span", DEFAULT_TOP_K)
        comp = compare(
            model,
            DEMO_PROMPT,
            heads,
            max_new_tokens=ATTENTION_NEW_TOKENS,
            progress=lambda d, t: say(d, grand),
        )
        att, csv, _ = attention_report(
            model, DEMO_PROMPT, out / "attention.html", comparison=comp, overwrite=overwrite
        )
        say(n + 1, grand)
        maps, _ = maps_report(
            model,
            out / "maps.html",
            relations=relations,
            draws=draws,
            n_prompts=n_prompts,
            overwrite=overwrite,
            progress=lambda d, t: say(n + 1 + d, max(grand, n + 1 + t)),
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
        f"<p>model {html.escape(model.name)}</p><ul>{links}</ul>"
        f"<p>The pages load plotly.js from {PLOTLY_JS} beside them: keep the folder together.</p>"
        "</body></html>",
        overwrite=overwrite,
    )
    return {"index": index, "attention": att, "attention_csv": csv, "maps": maps, "plotly_js": js}
