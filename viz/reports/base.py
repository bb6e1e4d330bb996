"""HTML reports: self-contained by default (plotly.js embedded, so a page opens with no network).

A set of reports written into one folder (`headsteer report all`) shares one `plotly.min.js`
beside the pages instead: `shared_plotlyjs(folder)` writes it and, inside the `with` block,
every `Report.save` links it (`<script src="plotly.min.js">`) instead of embedding 4.6 MB.
"""

from __future__ import annotations

import contextvars
import datetime as _dt
import html
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from heads._util.files import check_output, write_text

__all__ = ["PLOTLY_JS", "Report", "shared_plotlyjs"]

PLOTLY_JS = "plotly.min.js"
"""The file name of the shared plotly.js that `shared_plotlyjs` writes beside the pages."""

_PLOTLYJS: contextvars.ContextVar[str] = contextvars.ContextVar("plotlyjs", default="inline")

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{margin-bottom:.2em} .meta{color:#555;font-size:.9em} .note{color:#333;max-width:60em}
table{border-collapse:collapse;font-size:.85em} td,th{border:1px solid #ccc;padding:3px 8px}
.side{display:flex;gap:1em} .side>div{flex:1;border:1px solid #ddd;padding:.6em;border-radius:6px}
pre{white-space:pre-wrap;word-break:break-word;margin:0}
"""


@contextmanager
def shared_plotlyjs(folder: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Write `folder/plotly.min.js` once; inside the block, `Report.save` links it instead of
    embedding plotly.js (pages must then stay beside it). Yields the script's path.

    Raises:
        ValueError: the script exists and `overwrite` is False, or is a symlink
            (`heads._util.files.check_output`).
    """
    path = write_text(Path(folder) / PLOTLY_JS, get_plotlyjs(), overwrite=overwrite)
    token = _PLOTLYJS.set(PLOTLY_JS)
    try:
        yield path
    finally:
        _PLOTLYJS.reset(token)


def _note(note: str | None) -> str:
    return f"<p class='note'>{html.escape(note)}</p>" if note else ""


@dataclass
class Report:
    """An HTML report: title, model, parameters, then sections in order.

    Build with `figure`, `table`, `samples`, `text` (each section takes a one-sentence
    `note` saying what it shows); write with `save(path)`.
    """

    title: str
    model: str
    params: dict = field(default_factory=dict)
    seconds: float | None = None
    _parts: list[str] = field(default_factory=list)

    def text(self, heading: str, body: str) -> Report:
        self._parts.append(f"<h2>{html.escape(heading)}</h2><p>{html.escape(body)}</p>")
        return self

    def figure(self, heading: str, fig: go.Figure, note: str | None = None) -> Report:
        div = fig.to_html(full_html=False, include_plotlyjs=False)
        self._parts.append(f"<h2>{html.escape(heading)}</h2>{_note(note)}{div}")
        return self

    def table(self, heading: str, frame: pd.DataFrame, max_rows: int = 50, note: str | None = None) -> Report:
        self._parts.append(
            f"<h2>{html.escape(heading)}</h2>{_note(note)}"
            + frame.head(max_rows).to_html(index=False, float_format="%.4f")
        )
        return self

    def samples(self, heading: str, prompt: str, answers: dict[str, str], note: str | None = None) -> Report:
        cols = "".join(
            f"<div><h3>{html.escape(k)}</h3><pre>{html.escape(v)}</pre></div>" for k, v in answers.items()
        )
        self._parts.append(
            f"<h2>{html.escape(heading)}</h2>{_note(note)}<details><summary>prompt</summary>"
            f"<pre>{html.escape(prompt)}</pre></details><div class='side'>{cols}</div>"
        )
        return self

    def to_html(self, plotlyjs: str = "inline") -> str:
        """The page. `plotlyjs="inline"` embeds plotly.js; any other value is the relative
        URL of a shared copy (e.g. `"plotly.min.js"`, see `shared_plotlyjs`)."""
        when = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
        took = f" · run time {self.seconds:.1f} s" if self.seconds is not None else ""
        params = html.escape(json.dumps(self.params, default=str))
        if plotlyjs == "inline":
            script = f"<script type='text/javascript'>{get_plotlyjs()}</script>"
        else:
            script = f"<script type='text/javascript' src='{html.escape(plotlyjs)}'></script>"
        return (
            "<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>{html.escape(self.title)}</title><style>{_CSS}</style>"
            f"{script}</head><body>"
            f"<h1>{html.escape(self.title)}</h1>"
            f"<p class='meta'>model {html.escape(self.model)} · {when}{took}<br>parameters {params}</p>"
            + "".join(self._parts)
            + "</body></html>"
        )

    def save(self, path: str | Path, *, overwrite: bool = False, plotlyjs: str | None = None) -> Path:
        """Write the page atomically (`heads._util.files.write_text`, parents created); returns the path.

        `plotlyjs`: `"inline"` (self-contained), a relative URL of a shared plotly.js, or None
        (default: inline, or the shared copy inside a `shared_plotlyjs` block).

        Raises:
            ValueError: `path` exists and `overwrite` is False, or is a symlink or a folder.
        """
        check_output(path, overwrite)
        return write_text(path, self.to_html(plotlyjs or _PLOTLYJS.get()), overwrite=overwrite)
