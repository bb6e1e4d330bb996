"""Short text and Jupyter views of result objects (`__repr__` / `_repr_html_` helpers).

A result object prints as one line naming what it holds and its strongest heads, never as
a raw tensor; its Jupyter view is that line in bold over a small table.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from .scores import HeadScores

__all__ = ["html_view", "top_heads_text"]


def top_heads_text(scores: HeadScores, k: int = 3, fmt: str = ".3g") -> str:
    """`"L3.H1 0.512, L2.H0 0.3"`: the `k` highest-scoring heads with their scores (NaN
    dropped; `"none scored"` when every score is NaN).

    Raises:
        ValueError: `k` < 1.
    """
    heads = scores.ranked(k)
    if not heads:
        return "none scored"
    return ", ".join(f"L{la}.H{h} {_num(scores.scores[la, h].item(), fmt)}" for la, h in heads)


def _num(v: float, fmt: str) -> str:
    return str(v) if math.isinf(v) else format(v, fmt)


def html_view(title: str, rows: Sequence[Sequence[object]] = (), header: Sequence[str] = ()) -> str:
    """`title` (escaped, bold) over a small table of `rows` (cells escaped; floats as %.3g)."""

    def cell(v: object, tag: str = "td") -> str:
        text = format(v, ".3g") if isinstance(v, float) else str(v)
        return f"<{tag}>{html.escape(text)}</{tag}>"

    head = "<tr>" + "".join(cell(h, "th") for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(cell(v) for v in r) + "</tr>" for r in rows)
    table = f"<table>{head}{body}</table>" if rows else ""
    return f"<div><b>{html.escape(title)}</b>{table}</div>"
