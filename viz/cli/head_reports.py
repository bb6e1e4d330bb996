"""`headsteer report attention|maps|atlas`: the head-score reports (attention to a span, MAPS with
its ablation check, the head atlas). Registered on `headsteer report` by `viz.cli.main`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from viz.cli.common import (
    EmphasizeOpt,
    Run,
    _at_most,
    _positive,
    check_prompt,
)

__all__ = ["report_atlas", "report_attention", "report_maps"]

MAX_DRAWS = 100
"""Cap on `--draws` (random-head draws in the MAPS ablation check; each is a full pass)."""
MAX_FEW_SHOT = 1000
"""Cap on `--prompts` of the MAPS check (few-shot prompts per relation)."""
HTML = (".html", ".htm")


def report_attention(
    run: Run,
    prompt: Annotated[str, typer.Option(help="prompt with the span in **double stars**")],
    out: Annotated[Path, typer.Option(help="HTML file to write (a CSV is written beside it)")],
    top_k: Annotated[int, typer.Option(help="heads outlined as top-k")] = 20,
    emphasize: EmphasizeOpt = None,
) -> dict:
    """Attention mass on the emphasized span per (layer, head): heatmap + CSV."""
    from viz.cli.jobs import attention_report

    _positive(top_k=top_k)
    check_prompt(prompt, emphasize, option="--prompt")
    out = run.output(out, suffixes=HTML)
    csv = run.output(out.with_suffix(".csv"))
    from viz.cli.run_request import check_inputs

    # a prompt over the model's positions is refused from the tokenizer and config, before the weights
    check_inputs(run.model, [prompt], pairs=False, option="--prompt", chat=None, markup=True)
    hm = run.load()
    with run.status("scoring heads…"):
        attention_report(hm, prompt, out, top_k=top_k, emphasize=emphasize, overwrite=run.force)
    return {"html": str(out), "csv": str(csv)}


def report_maps(
    run: Run,
    out: Annotated[Path, typer.Option(help="HTML file to write")],
    relations: Annotated[str, typer.Option(help='"all" or comma-separated relation names')] = "all",
    top: Annotated[int, typer.Option(help="top heads listed per relation")] = 20,
    draws: Annotated[
        int, typer.Option(help=f"random-head draws in the ablation check (at most {MAX_DRAWS})")
    ] = 5,
    prompts: Annotated[
        int,
        typer.Option(help=f"few-shot prompts per relation in the ablation check (at most {MAX_FEW_SHOT})"),
    ] = 30,
) -> dict:
    """MAPS: relation and suppression scores of every head from its weights, validated by inference."""
    from probes.datasets.relations import parse_relation_names
    from viz.reports.maps import maps_report

    names = parse_relation_names(relations)  # checked before the model loads
    _positive(top=top, draws=draws, prompts=prompts)
    _at_most("--draws", draws, MAX_DRAWS)
    _at_most("--prompts", prompts, MAX_FEW_SHOT)
    out = run.output(out, suffixes=HTML)
    hm = run.load()
    with run.progress(len(names) + 2, "MAPS") as step:
        _, summary = maps_report(
            hm,
            out,
            relations=names,
            top=top,
            draws=draws,
            n_prompts=prompts,
            overwrite=run.force,
            progress=step,
        )
    table = Table(title="MAPS validation")
    for col in ("relation", "r static~dynamic", "heads", "base acc", "top ablated", "random ablated"):
        table.add_column(col)
    for n in summary["relations"]:
        a = summary["ablation"][n]
        table.add_row(
            escape(n),
            f"{summary['pearson_r'][n]:.2f}",
            str(a["n_heads"]),
            f"{a['base']:.2f}",
            "skipped" if a["skipped"] else f"{a['ablated']:.2f}",
            "" if a["skipped"] else f"{a['random_mean']:.2f}",
        )
    run.show(table, *(f"dropped: {n} (too few single-token pairs)" for n in summary["dropped"]))
    return {"html": str(out), **summary}


def report_atlas(
    run: Run,
    out: Annotated[
        Path,
        typer.Option(
            help="HTML file to write; beside it a CSV of the table and the atlas JSON "
            "that `headsteer explore --atlas` reads (same name, .csv and .json)"
        ),
    ],
    lens: Annotated[
        Path | None, typer.Option(help="an Attention Lens file of this model (lens KL and tokens)")
    ] = None,
    maps: Annotated[bool, typer.Option(help="MAPS relation scores (the best relation column)")] = True,
    stability: Annotated[
        int, typer.Option(help="bootstrap resamples of the detector sequences: stable top-k heads (0: none)")
    ] = 0,
) -> dict:
    """Head atlas: every head's role (detectors, sinks, MAPS, PASTA profile) on one page."""
    from heads.scorers.roles import AttentionLens
    from heads.scorers.roles.request import DetectRolesRequest
    from viz.cli.requests import build_request, check_request
    from viz.reports.atlas import atlas_report, atlas_steps

    if lens is not None and not lens.is_file():
        raise typer.BadParameter(f"lens file not found: {str(lens)!r}", param_hint="--lens")
    # the detectors' request (`heads.detect_roles`), checked there and against the config
    options = {"stability": "--stability"}
    request = build_request(DetectRolesRequest, options, stability=stability)
    out = run.output(out, suffixes=HTML)
    csv = run.output(out.with_suffix(".csv"))
    atlas_json = run.output(out.with_suffix(".json"))
    # a bad or untrained lens file fails here, before the model loads
    trained = AttentionLens.load(lens) if lens is not None else None
    if trained is not None:
        trained.kl_scores("ratio")
    check_request(run, options, request)
    hm = run.load()
    with run.progress(atlas_steps(), "head atlas") as step:
        _, summary = atlas_report(
            hm,
            out,
            lens=trained,
            maps=maps,
            overwrite=run.force,
            progress=step,
            csv=csv,
            request=request,
            atlas_json=atlas_json,
        )
    table = Table(title="Head roles")
    table.add_column("role")
    table.add_column("heads")
    for role, n in summary["roles"].items():
        table.add_row(escape(role), str(n))
    run.show(table)
    return {"html": str(out), "csv": str(csv), "json": str(atlas_json), **summary}
