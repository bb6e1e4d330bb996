"""Shared jobs behind the CLI: head choice, steered-vs-baseline comparison, attention report."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from heads import HeadModel, HeadScores, HeadSet, head_pattern, span_attention
from heads._util.files import check_output
from heads._util.progress import Progress, offset_progress
from steer import Pasta, SteeredModel
from viz.figures import attention_pattern, head_heatmap, score_distribution, span_share_by_layer
from viz.reports.base import Report
from viz.tables import write_csv

__all__ = ["Comparison", "attention_report", "choose_heads", "compare"]

DEFAULT_TOP_K = 20


def choose_heads(
    model: HeadModel, prompt: str, spec: str, top_k: int = DEFAULT_TOP_K, *, emphasize=None
) -> HeadSet:
    """The PASTA heads for `spec`:

    * `"auto"`: the shipped multi-task PASTA profile for the embedded model
      (`steer.profiles`); for any other model, the `"span"` heuristic;
    * `"span"`: the `top_k` heads by attention mass on the prompt's span (a heuristic);
    * a path to a `{"layer": [heads]}` JSON file.

    Warns (`UserWarning`): `"auto"` falling back to `"span"` (no shipped profile for the
    model); `top_k` at least the model's head count (every head selected).

    Raises:
        ValueError: bad `top_k`, bad file contents, unknown heads, or no span in `prompt`.
        FileNotFoundError: missing file.
    """
    if spec == "auto":
        from steer.profiles import shipped_profile

        try:
            spec = shipped_profile("pasta", model.name)
        except ValueError:
            warnings.warn(
                f"no shipped PASTA profile for {model.name}: --pasta-heads auto falls back to "
                f"the span heuristic (top {top_k} heads by attention on the span)",
                UserWarning,
                stacklevel=2,
            )
            spec = "span"
    if spec == "span":
        return span_attention(model, prompt, emphasize=emphasize).top(top_k)
    return HeadSet.parse(spec, model.n_layers, model.n_heads)


@dataclass
class Comparison:
    """Baseline vs PASTA-steered answers to one prompt."""

    prompt: str
    heads: HeadSet
    alpha: float
    baseline: str
    steered: str

    def _repr_html_(self) -> str:
        import html

        pre = "<pre style='white-space:pre-wrap'>{}</pre>"
        return (
            f"<div><b>PASTA alpha={self.alpha} on {len(self.heads)} heads</b><table><tr><th>baseline</th>"
            f"<th>steered</th></tr><tr><td>{pre.format(html.escape(self.baseline))}</td>"
            f"<td>{pre.format(html.escape(self.steered))}</td></tr></table></div>"
        )


def compare(
    model: HeadModel,
    prompt: str,
    heads: HeadSet,
    *,
    alpha: float = 0.01,
    max_new_tokens: int = 64,
    emphasize=None,
    progress: Progress | None = None,
) -> Comparison:
    """Greedy answers without and with PASTA on `heads`, for one prompt with `**span**` markup.

    `progress(done, total)` (optional, `heads._util.progress`): decoding steps of both answers,
    `total = 2 * max_new_tokens` (the PASTA answer first)."""
    pasta = Pasta(heads, alpha=alpha)
    sm = SteeredModel(model)
    n = max_new_tokens
    steered = sm.generate(
        prompt,
        steer=[pasta],
        max_new_tokens=n,
        emphasize=emphasize,
        progress=offset_progress(progress, 0, 2 * n) or False,
    )
    base = sm.generate(
        prompt, max_new_tokens=n, emphasize=emphasize, progress=offset_progress(progress, n, 2 * n) or False
    )
    return Comparison(base.prompts[0], heads, alpha, base.text, steered.text)


def attention_report(
    model: HeadModel,
    prompt: str,
    out: str | Path,
    *,
    top_k: int = DEFAULT_TOP_K,
    comparison: Comparison | None = None,
    emphasize=None,
    overwrite: bool = False,
    chat: bool | None = None,
) -> tuple[Path, Path, HeadScores]:
    """Write `out` (HTML) and `out` with suffix .csv: span attention mass per (layer, head).

    `chat`: apply the chat template (default: when the tokenizer has one), as in
    `heads.span_attention`. Both paths are checked before any compute; both are written atomically
    (`heads._util.files`), the CSV through `viz.tables.write_csv` (formula cells neutralised).

    Returns:
        (html path, csv path, scores).

    Raises:
        ValueError: `out` or the CSV exists and `overwrite` is False, or is a symlink
            or a folder; no span in `prompt`.
    """
    t0 = time.perf_counter()
    out = check_output(out, overwrite)
    csv = check_output(out.with_suffix(".csv"), overwrite)
    scores = span_attention(model, prompt, emphasize=emphasize, chat=chat)
    frame = scores.to_frame()
    write_csv(csv, frame, overwrite=overwrite)
    top = scores.top(top_k)
    rep = Report(
        "Attention mass on the emphasized span",
        model.name,
        {"query": "last prompt position", "top_k": top_k, "heads": top.to_dict()},
        seconds=None,
    )
    rep.figure(
        "Span attention mass per head (red: top-k, used by --pasta-heads span)",
        head_heatmap(scores, top_k=top, title="share of last-position attention on the span"),
    )
    rep.table("Top heads", frame.sort_values(["score", "layer", "head"], ascending=[False, True, True]))
    rep.figure("Score distribution per layer", score_distribution(scores))
    best = scores.ranked(1)[0]
    probs, tokens, spans = head_pattern(model, prompt, *best, emphasize=emphasize, chat=chat)
    rep.figure(
        f"Attention pattern of the top head L{best[0]}.H{best[1]} (span outlined)",
        attention_pattern(probs, tokens, span=spans, title=f"layer {best[0]}, head {best[1]}"),
    )
    if comparison is not None:
        pasta = Pasta(comparison.heads, alpha=comparison.alpha)
        after = span_attention(model, prompt, emphasize=emphasize, steer=[pasta], chat=chat)
        rep.figure(
            "Span attention share per layer, before and after PASTA",
            span_share_by_layer(scores.scores, after.scores),
        )
        rep.samples(
            f"Answers (PASTA alpha={comparison.alpha} on {len(comparison.heads)} heads)",
            comparison.prompt,
            {"baseline": comparison.baseline, "PASTA-steered": comparison.steered},
        )
    rep.seconds = time.perf_counter() - t0
    rep.save(out, overwrite=overwrite)
    return out, csv, scores
