"""Short text and Jupyter views of result objects (`__repr__` / `_repr_html_` helpers).

A result object prints as one line naming what it holds and its strongest heads, never as
a raw tensor; its Jupyter view is that line in bold over a small table.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from heads.results.scores import HeadScores

__all__ = ["html_view", "scores_title", "top_heads_text"]


def top_heads_text(scores: HeadScores, k: int = 3, fmt: str = ".3g", by: str = "score") -> str:
    """`"L3.H1 0.512, L2.H0 0.3"`: the `k` highest-ranked heads with their scores (`by` as in
    `HeadScores.ranked`: `"abs"` for signed scores; NaN dropped; `"none scored"` when every
    score is NaN).

    Raises:
        ValueError: `k` < 1, an unknown `by`.
    """
    heads = scores.ranked(k, by=by)
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


_TITLES = {
    "maps_relation": "MAPS relation score: {relation} (top-{k})",
    "maps_suppression": "MAPS suppression score: {relation} (top-{k})",
    "pasta_profile": "PASTA profile: task {task}, log-prob gain of the answer (alpha {alpha})",
    "ships": "Ships: KL of the next-token distribution with the head ablated ({ablation})",
    "dataset_ships": "Dataset-level Ships: principal angle of the final states, head ablated ({ablation})",
    "sahara_step": "Sahara step {step}: angle with the group plus the head ablated",
    "span_attention": "Attention mass on the emphasized span ({query} query position)",
    "sink_mass": "Attention mass on sink tokens ({rule} rule)",
    "first_token_mass": "Attention mass on the first token",
    "n_sinks": "Sink tokens per prompt ({rule} rule)",
    "act_accuracy_gain": "ACT: accuracy gain with the head calibrated (beta {beta})",
    "act_margin_gain": "ACT: margin gain with the head calibrated, nats (beta {beta})",
}


def scores_title(scores: HeadScores) -> str:
    """A figure title saying what `scores` hold: the method in words with its relation, task,
    span or ablation from `scores.params`, then the model, e.g.
    `"MAPS relation score: country_capital (top-10) — SmolLM2-135M-Instruct"`. A method
    without a known wording (or a template field missing from `params`) falls back to the
    method name plus any `relation` / `task` parameter.
    """
    template = _TITLES.get(scores.method)
    try:
        what = template.format(**scores.params) if template else None
    except (KeyError, IndexError, ValueError):
        what = None
    if what is None:
        extra = [f"{k} {scores.params[k]}" for k in ("relation", "task") if k in scores.params]
        what = scores.method + (f" ({', '.join(extra)})" if extra else "")
    return f"{what} — {scores.model}" if scores.model else what
