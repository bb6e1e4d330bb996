"""`headsteer build organism` and `headsteer report training` (mechanisms across training)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from heads._util.validation import parse_json
from heads.errors import HeadsteerValueError
from viz.cli.common import Run, _positive, _quiet_transformers, command

__all__ = ["register_training"]

HTML = (".html", ".htm")


def _no_model(run: Run, what: str) -> None:
    _quiet_transformers()  # no per-weight bars while checkpoints load / save
    if run.model is not None:
        raise HeadsteerValueError(f"--model is not used by {what}: {run.model!r}")


def build_organism_command(
    run: Run,
    out: Annotated[Path, typer.Option(help="folder for the organism runs (checkpoints per run)")],
    only: Annotated[
        str | None,
        typer.Option(
            help="train one recipe only: attn-only or llama (default both); over a previous build "
            "(--force) the other run stays, in OUT and in organism.json"
        ),
    ] = None,
    steps: Annotated[int | None, typer.Option(help="override the optimiser steps of each recipe")] = None,
    seed: Annotated[int | None, typer.Option(help="override the seed of each recipe")] = None,
) -> dict:
    """Train the model organism from scratch on this CPU: a 2-layer attention-only model and a
    small Llama-shaped model (seeded, bitwise reproducible), saving Hugging Face checkpoint folders
    that every analysis loads (`--model OUT/attn-only/step-001200`). With --force over a previous
    build, only the build's own outputs are replaced (each by a rename); other files in OUT stay,
    and so does the other run with --only (organism.json keeps listing it)."""
    from dataclasses import replace

    from heads._util.validation import check_seed
    from probes.organism.build import build_organism, check_organism_out, organism_outputs
    from probes.organism.recipe import ORGANISMS

    _no_model(run, "build organism")
    specs = list(ORGANISMS)
    if only is not None:
        specs = [s for s in specs if s.name == only]
        if not specs:
            names = ", ".join(s.name for s in ORGANISMS)
            raise HeadsteerValueError(f"--only must be one of {names}, got {only!r}")
    if steps is not None:
        _positive(steps=steps)
        specs = [replace(s, steps=steps) for s in specs]
    if seed is not None:
        check_seed("--seed", seed)
        specs = [replace(s, seed=seed) for s in specs]
    check_organism_out(out, run.force)
    total = sum(s.steps for s in specs)
    with run.progress(total, "training the organism (steps)") as step:
        manifest = build_organism(out, specs=specs, overwrite=run.force, progress=step)
    for name in manifest["trained"]:
        r = manifest["runs"][name]
        n, loss, secs = len(r["checkpoints"]), r["final_loss"], r["seconds"]
        run.show(f"{name}: {n} checkpoints, final loss {loss:.3f}, {secs:.0f} s")
    written = organism_outputs(out, manifest)
    for p in written:
        run.show(f"wrote {p}")
    return {**manifest, "written": [str(p) for p in written]}


def report_training(
    run: Run,
    checkpoints: Annotated[
        list[Path],
        typer.Option(
            "--checkpoints",
            help="a checkpoint folder, or a folder of them (e.g. OUT/attn-only); repeat for more "
            "(two models without steps: base and tuned, in that order)",
        ),
    ],
    out: Annotated[Path, typer.Option(help="HTML report")] = Path("training.html"),
    analysis: Annotated[
        list[str] | None,
        typer.Option(
            "--analysis",
            help="induction_phase (default), detectors, atlas, dla, patching, circuit, ships, maps, "
            'icl, composition, qk_attribution (needs --params \'{"qk_attribution": {"head": [L, H]}}\'); '
            "repeat for several",
        ),
    ] = None,
    task: Annotated[
        str, typer.Option(help="pair set for dla / patching / circuit: ioi or colored_objects")
    ] = "ioi",
    pairs: Annotated[int, typer.Option(help="pairs for dla / patching / circuit")] = 16,
    params: Annotated[
        str | None,
        typer.Option(help='JSON parameters per analysis, e.g. \'{"icl": {"n": 32}}\' (replace the defaults)'),
    ] = None,
) -> dict:
    """Run analyses on every checkpoint of a training run (one model in memory at a time) and
    write one page: score heatmaps over steps, role timelines and emergence, persistence, circuit
    overlap, what changed between two models, the induction phase change. Per-checkpoint results
    go beside the page (OUT_STEM_checkpoints/); a killed run continues where it stopped."""
    from heads.dynamics import ANALYSES, find_checkpoints
    from viz.reports.training import PAIR_ANALYSES, default_params, results_folder, training_report

    _no_model(run, "report training (the checkpoints are the models)")
    names = analysis or ["induction_phase"]
    bad = [a for a in names if a not in ANALYSES]
    if bad:
        raise HeadsteerValueError(f"--analysis {bad[0]!r} is not one of {', '.join(ANALYSES)}")
    if len(set(names)) != len(names):
        raise HeadsteerValueError(f"--analysis names repeat: {names}")
    from viz.reports.circuit import TASKS

    if task not in TASKS:
        raise HeadsteerValueError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    _positive(pairs=pairs)
    given: dict = {}
    if params is not None:
        given = parse_json(params, "--params")
        if not isinstance(given, dict) or not all(isinstance(v, dict) for v in given.values()):
            raise HeadsteerValueError('--params must be a JSON object {"analysis": {...}}')
        extra = sorted(set(given) - set(names))
        if extra:
            raise HeadsteerValueError(f"--params names {extra[0]!r}, which is not an --analysis of this run")
    if run.gave("task", task, "ioi") and not set(names) & set(PAIR_ANALYSES):
        raise HeadsteerValueError(f"--task is used only by {', '.join(PAIR_ANALYSES)}")
    run.output(out, suffixes=HTML)
    series = find_checkpoints([str(c) for c in checkpoints])
    folder = results_folder(out)
    all_params = {a: given.get(a, default_params(a, task=task, n_pairs=pairs)) for a in names}
    reused = sum(1 for a in names for c in series if (folder / a / f"step-{c.step:09d}.json").is_file())
    run.say(
        f"{len(series)} checkpoints ({series[0].name} .. {series[-1].name}); results per checkpoint in "
        f"{folder}{f' ({reused} found, reused if from the same run)' if reused else ''}"
    )
    with run.progress(len(series) * len(names), "analysing checkpoints") as step:
        summary = training_report(
            [str(c) for c in checkpoints],
            out,
            analyses=names,
            params=all_params,
            overwrite=run.force,
            progress=step,
        )
    ph = summary.get("induction_phase", {}).get("phase_change")
    if ph:
        run.show(
            "phase change (jump step, window): "
            + "; ".join(
                f"{k} {v['step']} {tuple(v['window'])}"
                for k, v in ph.items()
                if isinstance(v, dict) and "step" in v
            )
        )
    run.show(f"per-checkpoint results: {folder}")
    plain: dict = json.loads(json.dumps(summary, default=str))
    return plain


def register_training(build_app: typer.Typer, report_app: typer.Typer) -> None:
    """Add `build organism` and `report training`."""
    command(build_app, "organism")(build_organism_command)
    command(report_app, "training")(report_training)
