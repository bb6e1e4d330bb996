"""`headsteer report patching|circuit`: the causal reports. Each builds the analysis request the
Python API builds (`PatchRequest`, `CircuitRequest`) from its flags, checks it against the
model's config before the weights load, and runs it through `heads.run`. Registered on
`headsteer report` by `viz.cli.main`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from viz.cli.common import Run, _at_most, _positive, warn_line
from viz.cli.head_reports import HTML
from viz.cli.vision import refuse_unused

__all__ = ["report_circuit", "report_patching"]


def report_patching(
    run: Run,
    out: Annotated[Path, typer.Option(help="HTML file to write")],
    task: Annotated[
        str, typer.Option(help="ioi, colored_objects, comp_mech (shipped pairs) or a pairs JSONL file")
    ] = "ioi",
    kind: Annotated[
        str,
        typer.Option(
            help="the patching site kind: head_out, head_out_by_pos, resid_pre, attn_out, mlp_out, q, k, v "
            "or pattern"
        ),
    ] = "head_out",
    site: Annotated[
        str | None, typer.Option(hidden=True, help="deprecated: the old name of --kind (one release)")
    ] = None,
    direction: Annotated[str, typer.Option(help="denoising (default) or noising")] = "denoising",
    method: Annotated[
        str, typer.Option(help="activation (default) or attribution (AtP: the first-order estimate)")
    ] = "activation",
    n: Annotated[int, typer.Option(help="pairs used (the first n of the test split or file)")] = 8,
    split: Annotated[
        str | None,
        typer.Option(
            help="split: of a shipped set, test (default) or train; of a file, the records whose "
            '"split" field equals it [default: every record]'
        ),
    ] = None,
    stability: Annotated[
        int, typer.Option(help="bootstrap resamples of the pairs for the rankings' stability (0: none)")
    ] = 0,
    layers: Annotated[
        str | None,
        typer.Option(help="layers to patch: '18', '3,7,18' or '16-20' [default: every layer]"),
    ] = None,
) -> dict:
    """Causal analysis: activation patching of one site kind, DLA and the logit lens on prompt pairs."""
    from heads.scorers.patching.request import PatchRequest
    from viz.cli.requests import build_request, check_request
    from viz.cli.run_request import check_inputs
    from viz.reports.patching import patching_report, resolve_pairs

    kind_option = "--kind"
    if site is not None:  # the old name, one release
        warn_line("--site is deprecated: use --kind (--site is removed in the next release)")
        if run.gave("kind") and site != kind:
            raise typer.BadParameter(
                f"--site {short_repr(site)} and --kind {short_repr(kind)} differ: give --kind only"
            )
        kind, kind_option = site, "--site"
    _positive(n=n)
    # the request `heads.patch` builds: its values checked there, once; its kind against the
    # model's config (`check_model`) before the weights load
    options = {
        "kind": kind_option,
        "direction": "--direction",
        "stability": "--stability",
        "method": "--method",
        "layers": "--layers",
    }
    request = build_request(
        PatchRequest, options, kind=kind, direction=direction, stability=stability, method=method,
        layers=None if layers is None else _layer_list(layers),
    )  # fmt: skip
    pairs = resolve_pairs(task, split=split, n=n)  # checked before the model loads
    out = run.output(out, suffixes=HTML)
    check_request(run, options, request)
    check_inputs(run.model, pairs, pairs=True)  # tokenizer + config only, before the weights
    hm = run.load()
    with run.progress(4, f"patching {kind}") as step:
        _, summary = patching_report(
            hm, out, pairs, request=request, overwrite=run.force, progress=step, task=task
        )
    estimate = " estimated by attribution patching" if method == "attribution" else ""  # said where read
    table = Table(title=f"top {kind} sites{estimate} ({summary['pairs']} pairs, {direction})")
    keys = [
        k
        for k in ("layer", "head", "kv_head", "position", "token", "score")
        if summary["top"] and k in summary["top"][0]
    ]
    for k in keys:
        table.add_column(k)
    for row in summary["top"]:
        table.add_row(*(f"{row[k]:.3f}" if k == "score" else escape(str(row[k])) for k in keys))
    run.show(table, f"clean logit difference > 0 on {summary['clean_ld_positive']:.0%} of the pairs")
    run.show(*(f"left out {name}: {why}" for name, why in summary["left_out"].items()))
    return {"html": str(out), **summary}


def _layer_list(text: str) -> list[int]:
    """`--layers`: comma-separated layers and inclusive ranges (`16-20`), in the order given."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        lo, sep, hi = part.partition("-")
        try:
            out += list(range(int(lo), int(hi) + 1)) if sep else [int(part)]
        except ValueError:
            raise typer.BadParameter(
                f"--layers {short_repr(text)}: expected layers and ranges such as 18, 3,7,18 or 16-20"
            ) from None
        if sep and int(hi) < int(lo):
            raise typer.BadParameter(f"--layers {short_repr(text)}: the range {part} is empty")
    return out


def report_circuit(
    run: Run,
    out: Annotated[Path, typer.Option(help="HTML file to write (the circuit JSON is written beside it)")],
    task: Annotated[
        str, typer.Option(help="ioi, colored_objects, or a JSONL pairs file (clean, corrupted, answer, ...)")
    ] = "ioi",
    method: Annotated[str, typer.Option(help="eap or eap-ig")] = "eap-ig",
    pairs: Annotated[int, typer.Option(help="pairs to score (at most 256)")] = 16,
    size: Annotated[
        float | None,
        typer.Option(help="circuit size in % of the edges, in (0, 100] (default: from --faithfulness)"),
    ] = None,
    faithfulness: Annotated[
        float,
        typer.Option(
            help="the default size is the smallest of --sizes whose exact faithfulness reaches this"
        ),
    ] = 0.3,
    confirm: Annotated[
        int, typer.Option(help="rerun the top K edges with exact edge patching (0: none)")
    ] = 0,
    max_memory: Annotated[
        str,
        typer.Option(
            help="the planned peak the run may take, weights included: GiB (2) or a size as "
            "plan's --max-memory (24GB, 512MiB); at least 1 MiB"
        ),
    ] = "2",
    graph_threshold: Annotated[
        float | None, typer.Option(help="draw only the circuit's edges with |score| >= this (the graphs)")
    ] = None,
    steps: Annotated[int, typer.Option(help="EAP-IG interpolation steps")] = 5,
    sizes: Annotated[
        str, typer.Option(help="faithfulness-curve sizes, % of edges, comma-separated")
    ] = "0.1,0.2,0.5,1,2,5,10,20,50,100",
    stability: Annotated[
        int, typer.Option(help="bootstrap resamples of the pairs: each edge's inclusion frequency (0: none)")
    ] = 0,
) -> dict:
    """Circuit discovery: EAP / EAP-IG edge scores, the circuit graph, exact faithfulness curve."""
    from heads.engine.options import SweepOptions
    from heads.scorers.circuits.request import CircuitRequest
    from viz.cli.requests import build_request, check_request
    from viz.cli.run_request import check_budget, check_inputs
    from viz.reports.circuit import TASKS, circuit_report, circuit_steps

    if method not in ("eap", "eap-ig"):  # the report's choice: the request also has "exact"
        raise HeadsteerValueError(f"--method must be eap or eap-ig, got {short_repr(method)}")
    if task not in TASKS and not Path(task).is_file():
        raise typer.BadParameter(
            f"{short_repr(task)} is neither {' / '.join(TASKS)} nor a pairs file", param_hint="--task"
        )
    from heads.scorers.patching import load_pairs

    if method == "eap":
        refuse_unused(method, {"--steps": run.gave("steps", steps, 5)}, option="--method")
    _positive(pairs=pairs)
    _at_most("--pairs", pairs, 256)
    from heads.planning.units import parse_gib

    max_gib = parse_gib(max_memory, "--max-memory")
    if graph_threshold is not None:
        from heads._util.validation import check_number

        check_number("--graph-threshold", graph_threshold, lo=0)
    try:
        curve_sizes = [float(x) for x in sizes.split(",") if x.strip()]
    except ValueError:
        raise HeadsteerValueError(
            f"--sizes must be comma-separated numbers, got {short_repr(sizes)}"
        ) from None
    # the request `heads.find_circuit` builds: its values checked there, once (--faithfulness
    # left out: find_circuit's default target, the most faithful size when none reaches it)
    target = faithfulness if run.gave("faithfulness", faithfulness, 0.3) else None
    options = {
        "method": "--method", "size": "--size", "steps": "--steps", "sizes": "--sizes",
        "faithfulness": "--faithfulness", "confirm": "--confirm", "stability": "--stability",
    }  # fmt: skip
    request = build_request(
        CircuitRequest, options, method=method, size=size, steps=steps, sizes=curve_sizes,
        faithfulness=target, confirm=confirm, stability=stability,
    )  # fmt: skip
    given = None if task in TASKS else load_pairs(task)[:pairs]  # a bad file fails before the model
    out = run.output(out, suffixes=HTML)
    js = run.output(out.with_suffix(".json"))
    check_request(run, options, request)
    if given is None:  # a shipped task: its first --pairs pairs, as the report reads them
        from probes.datasets.pairs import load_task_pairs

        given = load_task_pairs(task, split="test", n=pairs)
    # the pairs encoded with the tokenizer + config only, and --max-memory against the plan of
    # one pair (the lean EAP path's), before the weights
    encoded = check_inputs(run.model, given, pairs=True)
    check_budget(run, request, encoded, SweepOptions(max_memory=int(max_gib * 2**30)))
    hm = run.load()
    with run.progress(circuit_steps(), "circuit") as step:
        _, summary = circuit_report(
            hm, out, task=task, n_pairs=pairs, request=request, overwrite=run.force, circuit_json=js,
            progress=step, max_memory=max_gib, graph_threshold=graph_threshold,
        )  # fmt: skip
    table = Table(title=f"Circuit ({method})")
    for col in ("edges", "heads", "faithfulness", "CPR", "CPR random", "CMD", "CMD random"):
        table.add_column(col)
    table.add_row(
        f"{summary['edges']}/{summary['graph_edges']}",
        str(summary["heads"]),
        f"{summary['faithfulness']:.3f}",
        f"{summary['cpr']:.3f}",
        f"{summary['cpr_random']:.3f}",
        f"{summary['cmd']:.3f}",
        f"{summary['cmd_random']:.3f}",
    )
    run.show(table)
    if summary["most_heads"]:
        run.show(
            f"warning: the circuit holds {summary['heads']} of the model's {summary['model_heads']} heads; "
            "ablating them is close to ablating the model (a smaller --size names fewer heads)"
        )
    return {"html": str(out), "circuit": str(js), **summary}
