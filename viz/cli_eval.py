"""`headsteer eval` and `headsteer profile pasta|act`: measure steering methods, profile heads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .cli_common import (
    _STATE,
    USER_ERRORS,
    JsonOpt,
    ModelOpt,
    QuietOpt,
    _fail,
    _json,
    _load,
    _positive,
    _progress,
    console,
)

profile_app = typer.Typer(
    help='Profile heads and write a {"layer": [heads]} profile.', no_args_is_help=True, rich_markup_mode=None
)

HeadsOpt = Annotated[
    str, typer.Option(help='"auto" (the shipped profile of the embedded model) or a JSON file')
]


def _heads_arg(value: str) -> str | None:
    return None if value == "auto" else value


def eval_command(
    method: Annotated[str, typer.Option(help="none | pasta | spotlight | act | var | vhr")],
    task: Annotated[
        str,
        typer.Option(help="json_format | pronoun_change | occupation | counterfact | sentiment | context_qa"),
    ],
    split: Annotated[str, typer.Option(help="train | validation | test")] = "test",
    limit: Annotated[int | None, typer.Option(help="first N examples of the split")] = None,
    pasta_heads: HeadsOpt = "auto",
    act_heads: HeadsOpt = "auto",
    alpha: Annotated[float, typer.Option(help="PASTA alpha")] = 0.01,
    tau: Annotated[float, typer.Option(help="SpotLight target share")] = 0.1,
    beta: Annotated[float, typer.Option(help="ACT sink scale")] = 0.4,
    var_p: Annotated[float, typer.Option(help="VAR fraction of sink mass moved")] = 0.6,
    var_rho: Annotated[float, typer.Option(help="VAR least non-sink span ratio")] = 0.5,
    vhr_alpha: Annotated[float, typer.Option(help="VHR factor on the selected heads")] = 2.0,
    batch_size: Annotated[int, typer.Option(help="prompts per forward")] = 16,
    max_new_tokens: Annotated[int, typer.Option(help="tokens generated on generate tasks")] = 48,
    out: Annotated[
        Path | None,
        typer.Option(
            help="CSV for the table, per-example rows beside it [default: results/TASK.METHOD.SPLIT.csv]"
        ),
    ] = None,
    model: ModelOpt = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Evaluate one steering method on one task: metric, n and 95% interval."""
    from probes.evaluate import METHODS, evaluate
    from probes.tasks import SPLITS, TASKS

    _STATE["quiet"] = _STATE["quiet"] or quiet
    try:
        if method not in METHODS:
            raise ValueError(f"unknown --method {method!r}: use one of {', '.join(METHODS)}")
        if task not in TASKS:
            raise ValueError(f"unknown --task {task!r}: use one of {', '.join(TASKS)}")
        if split not in SPLITS:
            raise ValueError(f"unknown --split {split!r}: use one of {', '.join(SPLITS)}")
        _positive(batch_size=batch_size, max_new_tokens=max_new_tokens)
        if limit is not None:
            _positive(limit=limit)
        if out is None:
            out = Path("results") / f"{task}.{method}.{split}.csv"
        if out.is_dir():
            raise ValueError(f"--out {str(out)!r} is a folder; give a .csv file path")
        if out.suffix.lower() != ".csv":
            raise ValueError(f"--out must name a .csv file, got {str(out)!r}")
        hm = _load(model)
        bar, step = _progress(f"{task} / {method}")
        with bar:
            res = evaluate(
                hm,
                task,
                method,
                split=split,
                limit=limit,
                batch_size=batch_size,
                max_new_tokens=max_new_tokens,
                progress=step,
                pasta_heads=_heads_arg(pasta_heads),
                act_heads=_heads_arg(act_heads),
                alpha=alpha,
                tau=tau,
                beta=beta,
                var_p=var_p,
                var_rho=var_rho,
                vhr_alpha=vhr_alpha,
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        res.table.to_csv(out, index=False)
        res.examples.to_csv(out.with_suffix(".examples.csv"), index=False)
    except USER_ERRORS as exc:
        _fail(exc)
    if as_json:
        print(_json({"table": res.table.to_dict(orient="records"), "csv": str(out)}))
        return
    table = Table(title=f"{task} ({split}) — {method}")
    for col in ("metric", "value", "n", "95% interval"):
        table.add_column(col)
    for r in res.table.itertuples():
        table.add_row(r.metric, f"{r.value:.3f}", str(r.n), f"[{r.low:.3f}, {r.high:.3f}]")
    console.print(table)
    console.print(f"wrote {out} (per-example rows: {out.with_suffix('.examples.csv')})", highlight=False)


def _task_inputs(task: str, split: str, n: int):
    from probes.tasks import load_task

    ex = load_task(task, split).examples[:n]
    return ex


@profile_app.command("pasta")
def profile_pasta(
    out: Annotated[Path, typer.Option(help='profile JSON to write ({"layer": [heads]})')],
    task: Annotated[
        list[str] | None,
        typer.Option(
            help="task to profile on, repeatable [default: json_format pronoun_change counterfact occupation]"
        ),
    ] = None,
    examples: Annotated[int, typer.Option(help="examples per task (from the start of the split)")] = 32,
    split: Annotated[str, typer.Option(help="split to profile on")] = "train",
    heads: Annotated[
        int, typer.Option(help="smallest top-k whose intersection has at least this many heads")
    ] = 24,
    mode: Annotated[str, typer.Option(help="intersection | union")] = "intersection",
    alpha: Annotated[float, typer.Option(help="PASTA alpha")] = 0.01,
    model: ModelOpt = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """PASTA multi-task profiling (Algorithm 1): every head steered alone, per task; the
    per-task scores are written beside the profile as `<out stem>.<task>.scores.json`."""
    from steer.profiling import profile_heads, select_heads, smallest_k

    _STATE["quiet"] = _STATE["quiet"] or quiet
    tasks = task or ["json_format", "pronoun_change", "counterfact", "occupation"]
    try:
        if out.suffix.lower() != ".json":
            raise ValueError(f"--out must name a .json file, got {str(out)!r}")
        if mode not in ("intersection", "union"):
            raise ValueError(f"--mode must be 'intersection' or 'union', got {mode!r}")
        _positive(examples=examples, heads=heads)
        inputs = {t: _task_inputs(t, split, examples) for t in tasks}
        for t, ex in inputs.items():
            if not all(e.emphasize for e in ex):
                raise ValueError(f"task {t!r} has no emphasized span to profile PASTA on")
        hm = _load(model)
        n_heads = hm.n_layers * hm.n_heads
        if heads > n_heads:
            raise ValueError(f"--heads {heads} is more than the model's {n_heads} heads")
        bar, step = _progress("profiling " + ", ".join(tasks))
        profiles = {}
        with bar:
            for i, (t, ex) in enumerate(inputs.items()):
                profiles[t] = profile_heads(
                    hm,
                    [e.prompt for e in ex],
                    [e.answer for e in ex],
                    emphasize=[e.emphasize for e in ex],
                    chat=ex[0].chat,
                    alpha=alpha,
                    task=t,
                    progress=lambda d, total, i=i: step(i * total + d, len(tasks) * total),
                )
        k = smallest_k(profiles, heads, mode=mode)
        chosen = select_heads(profiles, n_heads=heads, mode=mode)
        out.parent.mkdir(parents=True, exist_ok=True)
        chosen.save(out)
        for t, p in profiles.items():
            p.save(out.with_name(f"{out.stem}.{t}.scores.json"))
    except USER_ERRORS as exc:
        _fail(exc)
    summary = {"profile": str(out), "k": k, "heads": len(chosen), "tasks": tasks, "examples": examples}
    if as_json:
        print(_json(summary))
    else:
        console.print(
            f"top-{k} {mode} over {', '.join(tasks)}: {len(chosen)} heads\nwrote {out}", highlight=False
        )


@profile_app.command("act")
def profile_act(
    out: Annotated[Path, typer.Option(help='profile JSON to write ({"layer": [heads]})')],
    task: Annotated[str, typer.Option(help="choice task to calibrate on")] = "sentiment",
    examples: Annotated[int, typer.Option(help="calibration examples (from the start of the split)")] = 24,
    split: Annotated[str, typer.Option(help="split to calibrate on")] = "train",
    keep: Annotated[str, typer.Option(help="accuracy | margin: what a kept head must improve")] = "margin",
    delta: Annotated[float, typer.Option(help="required improvement over the base model")] = 0.0,
    beta: Annotated[float, typer.Option(help="ACT sink scale")] = 0.4,
    model: ModelOpt = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """ACT head filtering: calibrate every head of layers 2..L-2 alone, keep those that help.
    The per-head gains are written beside the profile as `<out stem>.scores.json`."""
    from steer.act_calibration import calibrate_act_heads

    _STATE["quiet"] = _STATE["quiet"] or quiet
    try:
        if out.suffix.lower() != ".json":
            raise ValueError(f"--out must name a .json file, got {str(out)!r}")
        _positive(examples=examples)
        ex = _task_inputs(task, split, examples)
        if ex[0].choices is None:
            raise ValueError(f"ACT calibration needs a choice task, {task!r} is scored by generation")
        hm = _load(model)
        bar, step = _progress("calibrating heads")
        with bar:
            cal = calibrate_act_heads(
                hm,
                [e.prompt for e in ex],
                [e.choices for e in ex],
                [e.label for e in ex],
                chat=ex[0].chat,
                beta=beta,
                keep=keep,
                delta=delta,
                progress=step,
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        cal.heads.save(out)
        (cal.accuracy if keep == "accuracy" else cal.margin).save(out.with_name(f"{out.stem}.scores.json"))
    except USER_ERRORS as exc:
        _fail(exc)
    summary = {
        "profile": str(out),
        "heads": len(cal.heads),
        "base_accuracy": cal.base_accuracy,
        "base_margin": cal.base_margin,
        "task": task,
        "examples": examples,
    }
    if as_json:
        print(_json(summary))
    else:
        console.print(
            f"{len(cal.heads)} heads kept "
            f"(base accuracy {cal.base_accuracy:.2f}, margin {cal.base_margin:.2f})"
            f"\nwrote {out}",
            highlight=False,
        )
