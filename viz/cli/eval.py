"""`headsteer eval` and `headsteer profile pasta|act`: measure steering methods, profile heads."""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from heads._util.validation import short_repr
from heads.engine.options import SweepOptions
from heads.errors import HeadsteerValueError
from viz.cli.common import Run, _positive, command
from viz.cli.vision import refuse_unused

if TYPE_CHECKING:
    from heads import HeadSet

profile_app = typer.Typer(
    help='Profile heads and write a {"layer": [heads]} profile.', no_args_is_help=True, rich_markup_mode=None
)

HeadsOpt = Annotated[
    str, typer.Option(help='"auto" (the shipped profile of the embedded model) or a JSON file')
]


def _heads_arg(value: str, option: str) -> tuple[str | None, HeadSet | None]:
    """`(None, None)` for "auto"; a head file's path and heads, parsed here, before the model
    loads (ValueError if bad: not JSON, no heads, a negative layer or head; its range against
    the model is `_check_geometry`'s)."""
    if value == "auto":
        return None, None
    from heads import HeadSet
    from viz.cli.common import check_head_file

    heads = HeadSet.parse(value)
    check_head_file(value, heads, option=option)
    return value, heads


METHOD_OPTIONS: dict[str, tuple[str, ...]] = {
    "none": (),
    "pasta": ("pasta_heads", "alpha"),
    "spotlight": ("tau",),
    "instaboost": ("multiplier",),
    "act": ("act_heads", "beta"),
    "var": ("var_p", "var_rho"),
    "vhr": ("vhr_alpha",),
    "iti": ("iti_k", "iti_alpha", "iti_direction"),
    "adaptvis": ("weight1", "weight2", "threshold"),
    "scalingvis": ("weight",),
    "caa": ("caa_layer", "caa_coefficient"),
}
"""The method options of `headsteer eval` each method uses; any other one given is refused.
`--max-new-tokens` is used by generate-scored tasks only (json_format, pronoun_change)."""


def _check_method_options(run: Run, method: str, scoring: str, given: dict) -> None:
    """Refuse (ValueError) the options `method` or a `scoring` task does not use but the user
    gave, even at their default value (`Run.gave`; the rule of `headsteer generate`,
    `refuse_unused`)."""
    defaults = {
        name: p.default.default if hasattr(p.default, "default") else p.default
        for name, p in inspect.signature(eval_command).parameters.items()
        if name in given
    }
    used = set(METHOD_OPTIONS[method]) | ({"max_new_tokens"} if scoring == "generate" else set())
    flags = {
        "--" + name.replace("_", "-"): run.gave(name, given[name], defaults[name])
        for name in given
        if name not in used
    }
    refuse_unused(method, flags, option="--method")


def _check_method_values(method: str, given: dict) -> None:
    """Check the values of the options `method` uses, before the model loads (ValueError / TypeError,
    naming the flag)."""
    if method == "pasta":
        from steer.pasta.method import check_alpha

        check_alpha(given["alpha"], stacklevel=4)  # warns on a no-op alpha
    elif method == "spotlight":
        from steer.spotlight import Spotlight

        try:
            Spotlight(tau=given["tau"])
        except ValueError as exc:
            raise HeadsteerValueError(f"--tau: {exc}") from None
    elif method == "instaboost":
        from steer.instaboost import InstaBoost

        InstaBoost(multiplier=given["multiplier"])  # checked (and a no-op warned) before the model loads
    elif method == "act":
        from steer.act.method import Act

        try:
            Act(beta=given["beta"])  # warns on a no-op beta
        except ValueError as exc:
            raise HeadsteerValueError(f"--beta: {exc}") from None
    elif method == "var":
        for flag, value in (("--var-p", given["var_p"]), ("--var-rho", given["var_rho"])):
            if not 0 <= value <= 1:  # NaN fails too
                raise HeadsteerValueError(f"{flag} must be in [0, 1], got {value}")
    elif method == "vhr":
        from steer.vhr.method import Vhr

        try:
            Vhr(alpha=given["vhr_alpha"])  # the library's bounds (> 0, <= 1e4), before the model loads
        except ValueError as exc:
            raise HeadsteerValueError(f"--vhr-alpha {str(exc).removeprefix('alpha ')}") from None
    elif method == "adaptvis":
        from steer.adaptvis import AdaptVis

        AdaptVis(weight1=given["weight1"], weight2=given["weight2"], threshold=given["threshold"])
    elif method == "scalingvis":
        from steer.adaptvis import ScalingVis

        ScalingVis(weight=given["weight"])  # the library's bounds; warns on a no-op weight
    elif method == "caa":
        import torch

        from steer.caa import Caa

        layer = given["caa_layer"]
        if layer is not None and layer < 0:
            raise HeadsteerValueError(f"--caa-layer must be >= 0, got {layer}")
        try:
            Caa(torch.ones(1), 0, given["caa_coefficient"])  # the coefficient's bounds; warns on 0
        except ValueError as exc:
            raise HeadsteerValueError(f"--caa-coefficient: {exc}") from None
    elif method == "iti":
        from heads.engine.edits import MAX_FACTOR

        _positive(iti_k=given["iti_k"])  # its upper bound (the model's head count): `_check_geometry`
        a = given["iti_alpha"]
        if not (math.isfinite(a) and abs(a) <= MAX_FACTOR):
            raise HeadsteerValueError(f"--iti-alpha must be finite with |alpha| <= {MAX_FACTOR:g}, got {a}")
        if given["iti_direction"] not in ("mass_mean", "probe"):
            raise HeadsteerValueError(
                f"--iti-direction must be mass_mean or probe, got {short_repr(given['iti_direction'])}"
            )


def _check_geometry(
    run: Run,
    method: str,
    caa_layer: int | None,
    iti_k: int,
    head_files: dict[str, tuple[str, HeadSet]] | None = None,
) -> None:
    """Check the options whose range is the model's geometry (`--caa-layer` in 0..n_layers - 2,
    `--iti-k` in 1..n_layers * n_heads, the heads of a `--pasta-heads` / `--act-heads` file:
    `head_files`, option -> (path, heads), in 0..n_layers - 1 x 0..n_heads - 1) against
    `--model`'s config, read before the weights (`heads.model.loading.read_geometry`).
    Raises ValueError naming the flag (and the file)."""
    from heads.model.loading import read_geometry
    from viz.cli.common import check_head_file

    n_layers, n_heads = read_geometry(run.model)
    for option, (path, heads) in (head_files or {}).items():
        check_head_file(path, heads, option=option, geometry=(n_layers, n_heads))
    if method == "caa" and caa_layer is not None and caa_layer > n_layers - 2:
        raise HeadsteerValueError(
            f"--caa-layer {caa_layer} is outside 0..{n_layers - 2}: the model has {n_layers} layers "
            "(the output of layer L is steered as the input of layer L + 1; the last layer has none)"
        )
    if method == "iti" and iti_k > n_layers * n_heads:
        raise HeadsteerValueError(
            f"--iti-k {iti_k} is more than the model's {n_layers * n_heads} heads "
            f"({n_layers} layers x {n_heads})"
        )


def eval_command(
    run: Run,
    method: Annotated[
        str,
        typer.Option(
            help="none | pasta | spotlight | instaboost | act | var | vhr | iti | adaptvis | scalingvis | caa"
        ),
    ],
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
    multiplier: Annotated[float, typer.Option(help="InstABoost factor on the instruction's attention")] = 5.0,
    beta: Annotated[float, typer.Option(help="ACT sink scale")] = 0.4,
    iti_k: Annotated[int, typer.Option(help="ITI heads (probes fitted on the train split)")] = 16,
    iti_alpha: Annotated[float, typer.Option(help="ITI strength (shift alpha * sigma)")] = 15.0,
    iti_direction: Annotated[str, typer.Option(help="ITI direction: mass_mean | probe")] = "mass_mean",
    var_p: Annotated[float, typer.Option(help="VAR fraction of sink mass moved")] = 0.6,
    var_rho: Annotated[float, typer.Option(help="VAR least non-sink span ratio")] = 0.5,
    vhr_alpha: Annotated[float, typer.Option(help="VHR factor on the selected heads")] = 2.0,
    weight: Annotated[float, typer.Option(help="ScalingVis factor on the last token's span logits")] = 0.8,
    weight1: Annotated[float, typer.Option(help="AdaptVis factor below --threshold")] = 0.5,
    weight2: Annotated[float, typer.Option(help="AdaptVis factor otherwise")] = 1.5,
    threshold: Annotated[float, typer.Option(help="AdaptVis confidence threshold in [0, 1]")] = 0.4,
    caa_layer: Annotated[
        int | None,
        typer.Option(help="CAA layer (vector from train-split answer pairs) [default: n_layers // 2]"),
    ] = None,
    caa_coefficient: Annotated[float, typer.Option(help="CAA coefficient")] = 4.0,
    batch_size: Annotated[int, typer.Option(help="prompts per forward")] = 16,
    max_new_tokens: Annotated[int, typer.Option(help="tokens generated on generate tasks")] = 48,
    prompt: Annotated[
        bool,
        typer.Option(
            "--prompt",
            help="the prompting baseline: the task's instruction asking for the steered behaviour "
            "before every prompt (with a method: prompt + method)",
        ),
    ] = False,
    baselines: Annotated[
        bool,
        typer.Option(
            "--baselines",
            help="run none, prompt, METHOD and prompt + METHOD on the same examples: 95%% bootstrap "
            "intervals and the paired difference to the prompt",
        ),
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(
            help="CSV for the table, per-example rows beside it [default: results/TASK.METHOD.SPLIT.csv]"
        ),
    ] = None,
) -> dict:
    """Evaluate one steering method on one task: metric, n and 95% interval.

    Every option is checked before the model loads (`--caa-layer`, `--iti-k` and the heads of a
    `--pasta-heads` / `--act-heads` file against the layer and head counts of `--model`'s
    config, read before its weights); an option the chosen method (or task) does not use is
    refused, not ignored (`METHOD_OPTIONS`)."""
    from probes.datasets.tasks import SPLITS, TASKS, load_task
    from probes.studies.evaluate import METHODS, SPAN_METHODS, evaluate
    from viz.tables import write_csv

    if method not in METHODS:
        raise HeadsteerValueError(f"unknown --method {short_repr(method)}: use one of {', '.join(METHODS)}")
    if baselines and (prompt or method == "none"):
        raise HeadsteerValueError(
            "--baselines runs none, prompt, METHOD and prompt + METHOD itself: give a --method other "
            "than none, without --prompt"
        )
    if task not in TASKS:
        raise HeadsteerValueError(f"unknown --task {short_repr(task)}: use one of {', '.join(TASKS)}")
    if split not in SPLITS:
        raise HeadsteerValueError(f"unknown --split {short_repr(split)}: use one of {', '.join(SPLITS)}")
    given = dict(
        pasta_heads=pasta_heads,
        act_heads=act_heads,
        alpha=alpha,
        tau=tau,
        multiplier=multiplier,
        beta=beta,
        iti_k=iti_k,
        iti_alpha=iti_alpha,
        iti_direction=iti_direction,
        var_p=var_p,
        var_rho=var_rho,
        vhr_alpha=vhr_alpha,
        weight=weight,
        weight1=weight1,
        weight2=weight2,
        threshold=threshold,
        caa_layer=caa_layer,
        caa_coefficient=caa_coefficient,
        max_new_tokens=max_new_tokens,
    )
    first = load_task(task, split).examples[0]
    _check_method_options(run, method, first.scoring, given)
    _positive(batch_size=batch_size)
    if first.scoring == "generate":
        _positive(max_new_tokens=max_new_tokens)
        run.check_new_tokens(max_new_tokens)  # from the config, before the weights
    if method in SPAN_METHODS and not first.emphasize:
        raise HeadsteerValueError(
            f"--method {method} needs an emphasized span, and task {short_repr(task)} has none"
        )
    if method in ("iti", "caa") and first.choices is None:
        raise HeadsteerValueError(
            f"--method {method} needs a choice task, {short_repr(task)} is scored by generation"
        )
    _check_method_values(method, given)
    if limit is not None:
        _positive(limit=limit)
    pasta_file, pasta_set = _heads_arg(pasta_heads, "--pasta-heads")
    act_file, act_set = _heads_arg(act_heads, "--act-heads")
    files = (("--pasta-heads", pasta_file, pasta_set), ("--act-heads", act_file, act_set))
    head_files = {opt: (path, hs) for opt, path, hs in files if path is not None and hs is not None}
    if out is None:
        tag = ".baselines" if baselines else (".prompt" if prompt else "")
        out = Path("results") / f"{task}.{method}{tag}.{split}.csv"
    if out.is_dir():
        raise HeadsteerValueError(f"--out {str(out)!r} is a folder; give a .csv file path")
    out = run.output(out, suffixes=(".csv",))
    examples_csv = run.output(out.with_suffix(".examples.csv"))
    n = min(len(load_task(task, split).examples), limit or 10**9)
    if (method == "caa" and caa_layer is not None) or method == "iti" or head_files:
        _check_geometry(run, method, caa_layer, iti_k, head_files)  # the config, before any weight
    hm = run.load()
    if baselines:
        return _baselines(run, hm, task, method, split, limit, n, out, examples_csv, given, batch_size)
    label = ("prompt" if method == "none" else f"prompt + {method}") if prompt else method
    with run.progress(n, f"{task} / {label}") as step:
        res = evaluate(
            hm,
            task,
            method,
            split=split,
            limit=limit,
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            progress=step,
            prompt=prompt,
            pasta_heads=pasta_file,
            act_heads=act_file,
            alpha=alpha,
            tau=tau,
            beta=beta,
            iti_k=iti_k,
            iti_alpha=iti_alpha,
            iti_direction=iti_direction,
            var_p=var_p,
            var_rho=var_rho,
            vhr_alpha=vhr_alpha,
            multiplier=multiplier,
            **(dict(weight=weight) if method == "scalingvis" else {}),
            **(dict(weight1=weight1, weight2=weight2, threshold=threshold) if method == "adaptvis" else {}),
            **(dict(caa_layer=caa_layer, caa_coefficient=caa_coefficient) if method == "caa" else {}),
        )
    write_csv(out, res.table, overwrite=run.force)
    write_csv(examples_csv, res.examples, overwrite=run.force)
    table = Table(title=f"{task} ({split}) — {label}")
    for col in ("metric", "value", "n", "95% interval", "interval method"):
        table.add_column(col)
    for r in res.table.itertuples():
        table.add_row(r.metric, f"{r.value:.3f}", str(r.n), f"[{r.low:.3f}, {r.high:.3f}]", str(r.interval))
    run.show(table)
    return {"table": res.table.to_dict(orient="records"), "csv": str(out)}


def _method_kwargs(method: str, given: dict) -> dict:
    """The `evaluate` keywords of `method`'s options (as `eval_command` passes them)."""
    out = {k: given[k] for k in METHOD_OPTIONS[method]}
    for k in ("pasta_heads", "act_heads"):
        if out.get(k) == "auto":
            out[k] = None
    return out


def _baselines(run: Run, hm, task, method, split, limit, n, out, examples_csv, given, batch_size) -> dict:
    """`headsteer eval --baselines`: none / prompt / method / prompt + method, bootstrap table."""
    from probes.studies.baselines import evaluate_baselines
    from viz.tables import write_csv

    with run.progress(4 * n, f"{task} / baselines of {method}") as step:
        res = evaluate_baselines(
            hm,
            task,
            method,
            split=split,
            limit=limit,
            progress=step,
            batch_size=batch_size,
            max_new_tokens=given["max_new_tokens"],
            **_method_kwargs(method, given),
        )
    write_csv(out, res.table, overwrite=run.force)
    write_csv(examples_csv, res.examples, overwrite=run.force)
    table = Table(title=f"{task} ({split}) — {method} against the prompting baseline")
    for col in ("metric", "condition", "value", "95% interval", f"{method} - prompt [95%]"):
        table.add_column(col)
    for r in res.table.itertuples():
        diff = ""
        if r.beats_prompt is not None:
            verdict = "beats the prompt" if r.beats_prompt else "does not beat the prompt"
            diff = f"{r.diff:+.3f} [{r.diff_low:+.3f}, {r.diff_high:+.3f}] {verdict}"
        name = r.condition.replace("method", method)
        table.add_row(r.metric, name, f"{r.value:.3f}", f"[{r.low:.3f}, {r.high:.3f}]", diff)
    run.show(table)
    return {"table": res.table.to_dict(orient="records"), "csv": str(out), "interval": "bootstrap 95%"}


def _task_inputs(task: str, split: str, n: int):
    from probes.datasets.tasks import load_task

    ex = load_task(task, split).examples[:n]
    return ex


def profile_pasta(
    run: Run,
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
) -> dict:
    """PASTA multi-task profiling (Algorithm 1): every head steered alone, per task; the
    per-task scores are written beside the profile as `<out stem>.<task>.scores.json`."""
    from steer.pasta.method import check_alpha
    from steer.pasta.profiling import profile_heads, select_heads, smallest_k

    tasks = task or ["json_format", "pronoun_change", "counterfact", "occupation"]
    if mode not in ("intersection", "union"):
        raise HeadsteerValueError(f"--mode must be 'intersection' or 'union', got {short_repr(mode)}")
    _positive(examples=examples, heads=heads)
    check_alpha(alpha)  # before any work; warns on a no-op alpha
    inputs = {t: _task_inputs(t, split, examples) for t in tasks}
    for t, ex in inputs.items():
        if not all(e.emphasize for e in ex):
            raise HeadsteerValueError(f"task {short_repr(t)} has no emphasized span to profile PASTA on")
    out = run.output(out, suffixes=(".json",))
    score_files = {t: run.output(out.with_name(f"{out.stem}.{t}.scores.json")) for t in tasks}
    from heads.model.loading import read_geometry

    n_layers, per_layer = read_geometry(run.model)  # the config, before any weight is read
    n_heads = n_layers * per_layer
    if heads > n_heads:
        raise HeadsteerValueError(f"--heads {heads} is more than the model's {n_heads} heads")
    hm = run.load()
    profiles = {}
    for t, ex in inputs.items():
        with run.progress(n_heads, f"profiling {t}") as step:
            profiles[t] = profile_heads(
                hm,
                [e.prompt for e in ex],
                [e.answer for e in ex],
                emphasize=[e.emphasize for e in ex],
                chat=ex[0].chat,
                alpha=alpha,
                task=t,
                options=SweepOptions(progress=step),
            )
    k = smallest_k(profiles, heads, mode=mode)
    chosen = select_heads(profiles, n_heads=heads, mode=mode)
    for t, p in profiles.items():
        p.save(score_files[t], overwrite=run.force)
    chosen.save(out, overwrite=run.force)
    run.show(f"top-{k} {mode} over {', '.join(tasks)}: {len(chosen)} heads")
    return {"profile": str(out), "k": k, "heads": len(chosen), "tasks": tasks, "examples": examples}


def profile_act(
    run: Run,
    out: Annotated[Path, typer.Option(help='profile JSON to write ({"layer": [heads]})')],
    task: Annotated[str, typer.Option(help="choice task to calibrate on")] = "sentiment",
    examples: Annotated[int, typer.Option(help="calibration examples (from the start of the split)")] = 24,
    split: Annotated[str, typer.Option(help="split to calibrate on")] = "train",
    keep: Annotated[str, typer.Option(help="accuracy | margin: what a kept head must improve")] = "margin",
    delta: Annotated[float, typer.Option(help="required improvement over the base model")] = 0.0,
    beta: Annotated[float, typer.Option(help="ACT sink scale")] = 0.4,
) -> dict:
    """ACT head filtering: calibrate every head of layers 2..L-2 alone, keep those that help.
    The per-head gains are written beside the profile as `<out stem>.scores.json`."""
    from steer.act.calibration import calibrate_act_heads

    _positive(examples=examples)
    if keep not in ("accuracy", "margin"):
        raise HeadsteerValueError(f"--keep must be 'accuracy' or 'margin', got {short_repr(keep)}")
    ex = _task_inputs(task, split, examples)
    if ex[0].choices is None:
        raise HeadsteerValueError(
            f"ACT calibration needs a choice task, {short_repr(task)} is scored by generation"
        )
    out = run.output(out, suffixes=(".json",))
    scores_file = run.output(out.with_name(f"{out.stem}.scores.json"))
    hm = run.load()
    with run.progress(1, "calibrating heads") as step:
        cal = calibrate_act_heads(
            hm,
            [e.prompt for e in ex],
            [e.choices for e in ex],
            [e.label for e in ex],
            chat=ex[0].chat,
            beta=beta,
            keep=keep,
            delta=delta,
            options=SweepOptions(progress=step),
        )
    (cal.accuracy if keep == "accuracy" else cal.margin).save(scores_file, overwrite=run.force)
    cal.heads.save(out, overwrite=run.force)
    run.show(
        f"{len(cal.heads)} heads kept (base accuracy {cal.base_accuracy:.2f}, margin {cal.base_margin:.2f})"
    )
    return {
        "profile": str(out),
        "heads": len(cal.heads),
        "base_accuracy": cal.base_accuracy,
        "base_margin": cal.base_margin,
        "task": task,
        "examples": examples,
    }


def register(app: typer.Typer) -> None:
    """Add `eval` and `profile pasta|act` to the `headsteer` app."""
    command(app, "eval")(eval_command)
    command(profile_app, "pasta")(profile_pasta)
    command(profile_app, "act")(profile_act)
    app.add_typer(profile_app, name="profile")
