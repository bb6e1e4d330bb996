"""The causal-analysis report (`headsteer report patching`): activation patching of one site kind
on a set of prompt pairs, with direct logit attribution and the logit lens of the clean run.

Sections: the patching scores (a layer x head heatmap for head kinds, a layer x position
heatmap with token labels for the residual / block-output kinds and for `head_out_by_pos`), the
DLA of the clean run by layer and position (token labels of pair 0: positions line up across
pairs only when they share a template), DLA bars of the top heads, the logit-lens lines (answer
and counterfactual logits per layer) and a table of the top sites with 95% intervals.

Every section that applies to the model is drawn; one that does not (DLA on a family whose
sub-layer outputs are normed before they join the residual stream, e.g. Gemma 2 / 3) is left
out, and the page says which and why ("sections left out"), checked before any forward.
"""

from __future__ import annotations

import os
from pathlib import Path

import plotly.graph_objects as go
import torch

from heads._util.files import check_output
from heads._util.progress import ProgressArg, progress_callback
from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.scorers.patching.activation import PatchResult
from heads.scorers.patching.logit import DLAResult, LensResult, check_dla_model
from heads.scorers.patching.pairs import PairBatch, PromptPair, check_pairs_differ, encode_pairs, load_pairs
from heads.scorers.patching.request import DLARequest, LensRequest, PatchRequest
from viz.figures import (
    DIVERGING,
    DLA_NOTE,
    add_note,
    direction_note,
    diverging_range,
    head_heatmap,
    stability_bars,
)
from viz.reports.base import Report

__all__ = [
    "PATCHING_STEPS",
    "TASKS",
    "dla_bars",
    "lens_figure",
    "position_heatmap",
    "patching_report",
    "render_patching_report",
    "resolve_pairs",
    "sections_left_out",
]

TASKS = ("ioi", "colored_objects", "comp_mech")
PATCHING_STEPS = 4


def sections_left_out(model: HeadModel) -> dict[str, str]:
    """`{section: reason}` of the report's sections that do not apply to `model` (no forward):
    direct logit attribution where `check_dla_model` refuses the family."""
    out: dict[str, str] = {}
    try:
        check_dla_model(model)
    except HeadsteerValueError as e:
        out["direct logit attribution"] = str(e)
    return out


def resolve_pairs(
    task: str | os.PathLike, *, split: str | None = None, n: int = 8, option: str = "--task"
) -> list[PromptPair]:
    """The pairs of a shipped set (`TASKS`) or of a JSONL file, the first `n` (checked, no model).

    `split`: of a shipped set, default `"test"`; of a file, keep only the records whose `split`
    field equals it (default None: every record). `option`: the CLI option that gave `task`,
    named in the messages (default `"--task"`; `headsteer run` passes `"--inputs"`).

    Raises:
        ValueError: an unknown set that is not an existing file, a bad split, `n` < 1, a pair with
            the same clean and corrupted text or an answer equal to its counterfactual
            (`check_pairs_differ`, naming the pair).
    """
    from heads._util.validation import check_int
    from probes.datasets.pairs import load_task_pairs

    check_int("n", n, lo=1)
    if str(task) in TASKS:
        return load_task_pairs(str(task), split or "test", n=n)
    if not Path(task).is_file():
        raise HeadsteerValueError(
            f"{option} {short_repr(str(task))} is neither one of {', '.join(TASKS)} nor a JSONL file"
        )
    pairs = load_pairs(task, split)[:n]
    check_pairs_differ(pairs)  # a pair that cannot show an effect, before the model loads
    return pairs


def position_heatmap(
    values: torch.Tensor,
    labels: list[str],
    title: str,
    *,
    ylabel: str = "layer",
    note: str | None = None,
    rows: list[int] | None = None,
) -> go.Figure:
    """Rows x positions heatmap (`values [R, T]`), token labels on the x axis, on the diverging
    scale centred on 0 (`viz.figures.DIVERGING`); `note` (e.g. the sign convention) under it;
    `rows`: the y label of each row (default `0 .. R-1`; a patching sweep of some layers passes
    `PatchResult.layer_ids`, the real layer numbers)."""
    t = values.shape[-1]
    x = [f"{i}:{labels[i]}" if i < len(labels) else str(i) for i in range(t)]
    fig = go.Figure(
        go.Heatmap(
            z=values.tolist(),
            x=x,
            y=list(range(values.shape[0])) if rows is None else [str(r) for r in rows],
            colorscale=DIVERGING,
            hoverongaps=False,
            **diverging_range(values),
        )
    )
    fig.update_layout(title=title, xaxis_title="position", yaxis_title=ylabel, height=560)
    if note:
        add_note(fig, note)
    return fig


def dla_bars(dla: DLAResult, k: int = 20) -> go.Figure:
    m = dla.heads[..., -1].mean(0)  # [L, H]
    h = m.shape[1]
    idx = m.abs().flatten().topk(min(k, m.numel())).indices.tolist()
    names = [f"L{i // h}H{i % h}" for i in idx]
    vals = [float(m.flatten()[i]) for i in idx]
    terms = dla.layer_terms()
    extra = {"embed": float(dla.embed[:, -1].mean()), "all MLPs": float(terms["mlp"].sum())}
    fig = go.Figure(go.Bar(x=names + list(extra), y=vals + list(extra.values())))
    fig.update_layout(
        title="direct logit attribution at the last position (mean over pairs)", yaxis_title="logit diff"
    )
    return fig


def lens_figure(lens: LensResult) -> go.Figure:
    n = lens.logit_diff.shape[1]
    x = list(range(n))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=lens.answer_logit.mean(0).tolist(), name="answer logit"))
    fig.add_trace(go.Scatter(x=x, y=lens.counterfactual_logit.mean(0).tolist(), name="counterfactual logit"))
    fig.add_trace(go.Scatter(x=x, y=lens.logit_diff.mean(0).tolist(), name="logit difference"))
    fig.add_trace(go.Scatter(x=x, y=lens.winner_share().tolist(), name="share answer wins", yaxis="y2"))
    fig.update_layout(
        title="logit lens (residual entering each layer; the last point is the output)",
        xaxis_title="layer",
        yaxis2={"overlaying": "y", "side": "right", "range": [0, 1], "title": "share"},
    )
    return fig


def render_patching_report(
    result: PatchResult,
    dla: DLAResult | None,
    lens: LensResult | None,
    pairs: PairBatch,
    params: dict | None = None,
    left_out: dict[str, str] | None = None,
) -> Report:
    """The report page from computed results (no model work). A section whose result is None is
    not drawn; `left_out` maps each such section to the reason, listed on the page."""
    what = (
        "Attribution patching (first-order estimate)"
        if result.params.get("method") == "attribution"
        else None
    )
    rep = Report(f"{what or 'Activation patching'}: {result.kind}", result.model, params or {})
    if left_out:
        rep.text(
            "sections left out",
            "; ".join(f"{name}: {why}" for name, why in left_out.items()),
        )
    m = result.mean
    if result.grid[:2] in (("layer", "head"), ("layer", "kv_head")):
        hs = result.head_scores()
        rep.figure(
            "patching scores per head",
            head_heatmap(
                hs, title=f"{result.kind} {result.direction} (mean of {pairs.n} pairs)", colorscale=DIVERGING
            ),
            note=direction_note(result.direction) + ".",
        )
    if "position" in result.grid:
        by_pos = m if m.ndim == 2 else m.nan_to_num(0).abs().amax(1) * m.nan_to_num(0).sum(1).sign()
        rep.figure(
            "patching scores by position",
            position_heatmap(
                by_pos,
                result.labels,
                f"{result.kind} by layer and position",
                note=direction_note(result.direction),
                rows=result.layer_ids,
            ),
            note="Token labels are pair 0's clean tokens (positions align across pairs of one template).",
        )
    if dla is not None:
        rep.figure(
            "direct logit attribution by layer and position",
            position_heatmap(
                dla.by_position().sum(1),
                dla.labels,
                "DLA of each layer's heads (sum), clean run",
                note=DLA_NOTE,
            ),
            note="Each position's heads projected on the answer - counterfactual unembedding, with the "
            "final norm's scale frozen at that position (before any output soft-cap).",
        )
        rep.figure("DLA of the top heads", dla_bars(dla), note=DLA_NOTE + ".")
    dla_st = dla.stability if dla is not None else None
    for name, st in (("patching", result.stability), ("direct logit attribution", dla_st)):
        if st is not None:
            rep.figure(
                f"Stability of the {name} ranking",
                stability_bars(st),
                note=f"Bootstrap over the {st.n_samples} pairs ({st.n_resamples} resamples, no new forward): "
                "95% intervals; * stable: in the top k of at least 95% of the resamples"
                + (
                    f"; across {st.templates['n_templates']} templates: Kendall tau "
                    f"{st.templates['kendall_tau']:.2f}, top-{st.k} Jaccard {st.templates['jaccard']:.2f}"
                    if st.templates
                    else ""
                )
                + ".",
            )
    if lens is not None:
        rep.figure("logit lens", lens_figure(lens))
    frame = result.to_frame().sort_values("score", ascending=False, key=lambda s: s.abs())
    rep.table(
        "top sites",
        frame,
        max_rows=25,
        note=f"Mean normalised score with a 95% interval over pairs; {direction_note(result.direction)}.",
    )
    return rep


def patching_report(
    model: HeadModel,
    out: str | Path,
    pairs: list[PromptPair],
    *,
    site: str = "head_out",
    direction: str = "denoising",
    overwrite: bool = False,
    progress: ProgressArg = True,
    task: str = "",
    stability: int = 0,
    request: PatchRequest | None = None,
) -> tuple[Report, dict]:
    """Patch `site` on `pairs`, run DLA and the logit lens, and write the page to `out`.

    The analyses run as requests through `heads.run`: `request` (default: the `PatchRequest`
    `heads.patch` builds from `site`, `direction` and `stability`), then `DLARequest` with its
    stability and `LensRequest()`.

    `stability`: bootstrap resamples of the pairs for the head rankings of patching and DLA
    (default 0: none; no extra forward): error bars and stable top-k markers on the page, the
    summaries in the returned summary.
    `progress`: True (a bar), False, or a `(done, total)` callable: the patch sweep's
    token-layers as `patch(options=SweepOptions(progress=...))` counts them, as they are done,
    then one step each for DLA, the lens and the page (total: the sweep's + 3).
    `request`: the patching request itself (the CLI's, checked against the config before the
    model loaded); `site`, `direction` and `stability` may then not be given too.

    Returns:
        `(report, summary)`; summary: pairs, site, the clean / corrupted mean metric, the top 5
        sites, the share of pairs with a positive clean logit difference and `left_out`
        (`sections_left_out`: the sections not drawn for this model, with the reason, also
        listed on the page).

    Raises:
        ValueError: an unknown site or direction, `out` exists without `overwrite`, a pair that
            cannot show an effect (`check_pairs_differ`), a site kind the family does not have
            (before any work).
    """
    if request is None:
        request = PatchRequest(kind=site, direction=direction, stability=stability)
    elif (site, direction, stability) != ("head_out", "denoising", 0):
        raise HeadsteerValueError("give the request, or site= / direction= / stability=, not both")
    check_output(out, overwrite)
    request.check_config(model)  # the kind on this family, layers and positions: before any forward
    site, direction, stability = request.kind, request.direction, request.stability
    check_pairs_differ(pairs)  # the pairs' text, before any model work
    left_out = sections_left_out(model)
    with progress_callback(progress, "patching report", "token-layers") as report:
        # the patch sweep's own units (token-layers, as `patch(progress=)` counts them), then
        # one step each for DLA, the lens and the page: `base` is the sweep's total once known
        base = [1]

        def swept(done: int, total: int) -> None:
            base[0] = max(int(total), 1)
            if report is not None:
                report(done, base[0] + PATCHING_STEPS - 1)

        stage = getattr(progress, "stage", None)  # a front end's stage label (the CLI's bar)

        def tick(i: int) -> None:
            if report is not None:
                report(base[0] + i - 1 if i else 0, base[0] + PATCHING_STEPS - 1)
            names = {1: "direct logit attribution", 2: "logit lens", 3: "writing the report"}
            if callable(stage) and i in names:
                stage(names[i])

        tick(0)
        batch = encode_pairs(model, pairs)
        from heads import run
        from heads.engine.options import SweepOptions

        opts = SweepOptions(progress=swept if report is not None else False)
        result = run(model, request, batch, options=opts)
        tick(1)
        no_dla = "direct logit attribution" in left_out
        dla = None if no_dla else run(model, DLARequest(stability=stability), batch)
        tick(2)
        lens = run(model, LensRequest(), batch)
        tick(3)
        params = {"task": task, "site": site, "direction": direction, "pairs": batch.n}
        rep = render_patching_report(result, dla, lens, batch, params, left_out)
        rep.save(out, overwrite=overwrite)
        tick(4)
    frame = result.to_frame().sort_values("score", ascending=False, key=lambda s: s.abs())
    cols = [c for c in frame.columns if c in ("layer", "head", "kv_head", "position", "token", "score")]
    summary = {
        "left_out": left_out,
        "pairs": batch.n,
        "site": site,
        "direction": direction,
        "clean_metric": float(result.clean.mean()),
        "corrupt_metric": float(result.corrupt.mean()),
        "clean_ld_positive": float((lens.logit_diff[:, -1] > 0).float().mean()),
        "top": frame[cols].head(5).to_dict("records"),
    }
    for name, st in (("stability", result.stability), ("dla_stability", dla.stability if dla else None)):
        if st is not None:
            s = st.summary()
            summary[name] = {k: v for k, v in s.items() if k != "stable"} | {"stable": s["stable"]}
    return rep, summary
