"""Shared jobs behind the CLI: head choice, steered-vs-baseline comparison, attention report."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from heads import HeadModel, HeadScores, HeadSet, span_attention
from steer import Pasta, SteeredModel

from .figures import head_heatmap
from .report import Report

__all__ = ["Comparison", "attention_report", "choose_heads", "compare"]

DEFAULT_TOP_K = 20


def choose_heads(
    model: HeadModel, prompt: str, spec: str, top_k: int = DEFAULT_TOP_K, *, emphasize=None
) -> HeadSet:
    """`spec` = "auto" (top-k heads by attention mass on the span: a heuristic) or a JSON file.

    Raises:
        ValueError: bad `top_k`, bad file contents, unknown heads, or no span in `prompt`.
        FileNotFoundError: missing file.
    """
    if spec == "auto":
        return span_attention(model, prompt, emphasize=emphasize).top(top_k)
    return HeadSet.parse(spec, model.n_layers, model.n_heads)


@dataclass
class Comparison:
    prompt: str
    heads: HeadSet
    alpha: float
    baseline: str
    steered: str


def compare(
    model: HeadModel,
    prompt: str,
    heads: HeadSet,
    *,
    alpha: float = 0.01,
    max_new_tokens: int = 64,
    emphasize=None,
) -> Comparison:
    """Greedy answers without and with PASTA on `heads`, for one prompt with `**span**` markup."""
    pasta = Pasta(heads, alpha=alpha)
    sm = SteeredModel(model)
    steered = sm.generate(prompt, steer=[pasta], max_new_tokens=max_new_tokens, emphasize=emphasize)
    base = sm.generate(prompt, max_new_tokens=max_new_tokens, emphasize=emphasize)
    return Comparison(base.prompts[0], heads, alpha, base.text, steered.text)


def attention_report(
    model: HeadModel,
    prompt: str,
    out: str | Path,
    *,
    top_k: int = DEFAULT_TOP_K,
    comparison: Comparison | None = None,
    emphasize=None,
) -> tuple[Path, Path, HeadScores]:
    """Write `out` (HTML) and `out` with suffix .csv: span attention mass per (layer, head).

    Returns:
        (html path, csv path, scores).
    """
    t0 = time.perf_counter()
    scores = span_attention(model, prompt, emphasize=emphasize)
    out = Path(out)
    csv = out.with_suffix(".csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    frame = scores.to_frame()
    frame.to_csv(csv, index=False)
    top = scores.top(top_k)
    rep = Report(
        "Attention mass on the emphasized span",
        model.name,
        {"query": "last prompt position", "top_k": top_k, "heads": top.to_dict()},
        seconds=None,
    )
    rep.figure(
        "Span attention mass per head (red: top-k, used by --pasta-heads auto)",
        head_heatmap(scores, top_k=top, title="share of last-position attention on the span"),
    )
    rep.table("Top heads", frame.sort_values(["score", "layer", "head"], ascending=[False, True, True]))
    if comparison is not None:
        rep.samples(
            f"Answers (PASTA alpha={comparison.alpha} on {len(comparison.heads)} heads)",
            comparison.prompt,
            {"baseline": comparison.baseline, "PASTA-steered": comparison.steered},
        )
    rep.seconds = time.perf_counter() - t0
    rep.save(out)
    return out, csv, scores
