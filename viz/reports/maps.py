"""`headsteer report maps`: MAPS static maps, their validation against inference, as HTML.

The numbers come from `heads.scorers.maps.analysis.maps_analysis` (a `MapsAnalysis`); this module
only draws them (`render_maps_report`).
"""

from __future__ import annotations

from pathlib import Path

from heads import HeadModel, SweepOptions
from heads._util.files import check_output
from heads._util.progress import ProgressArg
from heads.scorers.maps.analysis import MapsAnalysis, maps_analysis
from probes.datasets.relations import load_relations
from viz.figures import head_heatmap
from viz.reports.base import Report

__all__ = ["maps_report", "render_maps_report"]


def render_maps_report(result: MapsAnalysis) -> Report:
    """The MAPS report of a computed `MapsAnalysis` (nothing is recomputed).

    Sections: pair-filter counts (and dropped relations), the static-vs-dynamic Pearson r and
    causal ablation per relation, a relation-score heatmap per relation, the top heads with
    `describe()`, and the salient operations of the strongest head.
    """
    ms, top = result.scores, result.top
    names = ms.names()
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    rep = Report(
        f"MAPS relation and suppression scores of every head ({len(names)} relations: {shown})",
        result.model,
        dict(result.params),
    )
    rep.text(
        "Method",
        "Each head's OV circuit projected to the vocabulary (Elhelo & Geva, ACL 2025). Relation score = "
        "share of a relation's pairs whose target is in the top-k of the source's row (k = 1 for copying, "
        "10 otherwise). Validation: Pearson r between static and dynamic scores over (template, layer, head) "
        "points, and accuracy on few-shot prompts with the relation's top heads (score > 0, at most 30) "
        "zeroed at the last position versus the same number of random other heads.",
    )
    rep.table(
        "Relations and the single-token pair filter",
        result.pair_filter,
        note="Each shipped relation with its pairs before and after keeping only pairs whose source "
        "and target are single tokens; a relation with too few left is dropped.",
    )
    for msg in result.dropped.values():
        rep.text("Dropped relation", msg)
    rep.table(
        "Validation: static-dynamic correlation and causal ablation",
        result.validation,
        note="Per relation: Pearson r between the static scores and the scores measured on neutral "
        "prompts (higher means the weights predict what the head does in context), and few-shot "
        "accuracy with no head, the relation's top heads, and as many random heads zeroed (a real "
        "relation head drops accuracy more than random heads do).",
    )
    for n in names:
        k = ms.relation[n].params.get("k", "")
        rep.figure(
            f"{n} — relation score per head",
            head_heatmap(
                ms.relation[n],
                top_k=min(top, 10),
                title=f"MAPS relation score: {n} (top-{k}) — {result.model}",
            ),
            note=f"Share of the {n} pairs whose target is among the top-{k} tokens each head's OV "
            f"circuit maps the source to (0 to 1); red boxes mark the {min(top, 10)} highest heads.",
        )
    rep.table(
        f"Top {top} heads per relation",
        result.top_heads,
        max_rows=top * len(names),
        note="The highest-scoring heads of each relation (score > 0), with a one-line description "
        "of every relation they implement or suppress.",
    )
    lh = result.salient_head
    rep.table(
        f"Salient operations of L{lh[0]}.H{lh[1]} (top head of {result.salient_relation})",
        result.salient,
        note="The source tokens this head amplifies most (sigma: output norm over input norm) and "
        "the tokens each is mapped to most strongly (tokens as text: ␣ is a space, ⏎ a newline).",
    )
    rep.seconds = result.seconds
    return rep


def maps_report(
    model: HeadModel,
    out: str | Path,
    *,
    relations: str | list[str] | None = "all",
    top: int = 20,
    draws: int = 5,
    n_prompts: int = 30,
    overwrite: bool = False,
    progress: ProgressArg = True,
) -> tuple[Path, dict]:
    """Compute the MAPS analysis (`heads.scorers.maps.analysis.maps_analysis` on the shipped relations,
    `probes.datasets.relations.load_relations`), write its report to `out` (HTML, checked before any
    work; an existing file only with `overwrite=True`) and return the path with a JSON-able
    summary (`MapsAnalysis.summary()`).

    `progress` (default True: a tqdm bar; False off; or `progress(done, total)`) counts the
    analysis' steps (see `maps_analysis`).

    Raises:
        ValueError: `out` exists and `overwrite` is False, or is a symlink; and as
            `maps_analysis`.
    """
    check_output(out, overwrite)
    rs = load_relations(model.tokenizer, relations, d_vocab=model.d_vocab)
    result = maps_analysis(
        model, rs, top=top, draws=draws, n_prompts=n_prompts, options=SweepOptions(progress=progress)
    )
    path = render_maps_report(result).save(out, overwrite=overwrite)
    return path, result.summary()
