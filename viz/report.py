"""Self-contained HTML reports (plotly.js embedded, so they open with no network)."""

from __future__ import annotations

import datetime as _dt
import html
import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from heads.files import write_text

__all__ = ["Report"]

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{margin-bottom:.2em} .meta{color:#555;font-size:.9em}
table{border-collapse:collapse;font-size:.85em} td,th{border:1px solid #ccc;padding:3px 8px}
.side{display:flex;gap:1em} .side>div{flex:1;border:1px solid #ddd;padding:.6em;border-radius:6px}
pre{white-space:pre-wrap;word-break:break-word;margin:0}
"""


@dataclass
class Report:
    """An HTML report: title, model, parameters, then sections in order.

    Build with `figure`, `table`, `samples`, `text`; write with `save(path)`.
    """

    title: str
    model: str
    params: dict = field(default_factory=dict)
    seconds: float | None = None
    _parts: list[str] = field(default_factory=list)

    def text(self, heading: str, body: str) -> Report:
        self._parts.append(f"<h2>{html.escape(heading)}</h2><p>{html.escape(body)}</p>")
        return self

    def figure(self, heading: str, fig: go.Figure) -> Report:
        div = fig.to_html(full_html=False, include_plotlyjs=False)
        self._parts.append(f"<h2>{html.escape(heading)}</h2>{div}")
        return self

    def table(self, heading: str, frame: pd.DataFrame, max_rows: int = 50) -> Report:
        self._parts.append(
            f"<h2>{html.escape(heading)}</h2>"
            + frame.head(max_rows).to_html(index=False, float_format="%.4f")
        )
        return self

    def samples(self, heading: str, prompt: str, answers: dict[str, str]) -> Report:
        cols = "".join(
            f"<div><h3>{html.escape(k)}</h3><pre>{html.escape(v)}</pre></div>" for k, v in answers.items()
        )
        self._parts.append(
            f"<h2>{html.escape(heading)}</h2><details><summary>prompt</summary>"
            f"<pre>{html.escape(prompt)}</pre></details><div class='side'>{cols}</div>"
        )
        return self

    def to_html(self) -> str:
        when = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
        took = f" · run time {self.seconds:.1f} s" if self.seconds is not None else ""
        params = html.escape(json.dumps(self.params, default=str))
        return (
            "<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>{html.escape(self.title)}</title><style>{_CSS}</style>"
            f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
            f"<h1>{html.escape(self.title)}</h1>"
            f"<p class='meta'>model {html.escape(self.model)} · {when}{took}<br>parameters {params}</p>"
            + "".join(self._parts)
            + "</body></html>"
        )

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write the HTML atomically (`heads.files.write_text`, parents created); returns the path.

        Raises:
            ValueError: `path` exists and `overwrite` is False, or is a symlink or a folder.
        """
        return write_text(path, self.to_html(), overwrite=overwrite)
