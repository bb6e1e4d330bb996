"""The `headsteer` command line.

Every command runs in the skeleton of `viz.cli.common.command`: the shared options
`--model --device --dtype --quiet --json --force`, output paths checked before any
work, a status line while the model loads, progress, one-line errors (exit 2).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from heads._util.validation import check_seed, short_repr
from heads.errors import HeadsteerValueError
from viz.cli.causal import report_circuit, report_patching  # noqa: E402
from viz.cli.common import (
    EmphasizeOpt,
    OneLineUsageErrors,
    Run,
    _at_most,
    _positive,
    check_head_file,
    check_prompt,
    command,
    console,
    err,
    set_global,
    warn_line,
)
from viz.cli.eval import register as register_eval  # noqa: E402
from viz.cli.explore import explore_command  # noqa: E402
from viz.cli.head_reports import HTML, MAX_DRAWS, MAX_FEW_SHOT, report_atlas, report_attention, report_maps  # noqa: E402
from viz.cli.plan import register_plan  # noqa: E402
from viz.cli.probes import report_probes  # noqa: E402
from viz.cli.qk import report_qk  # noqa: E402
from viz.cli.run_request import run_request  # noqa: E402
from viz.cli.training import register_training  # noqa: E402
from viz.cli.vision import (  # noqa: E402
    VISION_METHODS,
    ImageOpt,
    refuse_unused,
    register_vision,
    steered_pair,
)
from viz.server.app import serve_command  # noqa: E402

app = typer.Typer(
    cls=OneLineUsageErrors,
    help="headsteer: attention-head scoring and attention steering.",
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)
report_app = typer.Typer(
    help="Write self-contained HTML reports.", no_args_is_help=True, rich_markup_mode=None
)
build_app = typer.Typer(
    help="Build derived models (e.g. the refusal-tuned model).", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(report_app, name="report")
app.add_typer(build_app, name="build")
register_eval(app)
register_plan(app)  # `headsteer plan`
command(app, "serve", writes_files=False, json_help="print the URL and model as one JSON line once serving")(
    serve_command
)
command(
    app, "explore", writes_files=False, json_help="print the URL and model as one JSON line once serving"
)(explore_command)
command(report_app, "probes")(report_probes)
command(report_app, "qk")(report_qk)
command(report_app, "patching")(report_patching)
command(report_app, "circuit")(report_circuit)
command(app, "run")(run_request)  # `headsteer run REQUEST.json`: any analysis request
register_vision(app, report_app)  # `headsteer vision generate`, `headsteer report vision`
register_training(build_app, report_app)  # `headsteer build organism`, `headsteer report training`
command(report_app, "attention")(report_attention)
command(report_app, "maps")(report_maps)
command(report_app, "atlas")(report_atlas)

PASTA_ALPHA = 0.01
"""`headsteer generate --alpha` default (PASTA's scaling outside the span)."""
INSTABOOST_MULTIPLIER = 5.0
"""`headsteer generate --multiplier` default (`steer.instaboost.DEFAULT_MULTIPLIER`)."""


def _print_version(value: bool) -> None:
    if value:
        from heads._version import __version__

        typer.echo(f"headsteer {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", help="no status lines or progress bars")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="print the version and exit"),
    ] = False,
) -> None:
    set_global(debug, quiet)


@command(app, writes_files=False)
def generate(
    run: Run,
    prompt: Annotated[str, typer.Argument(help="prompt with the span to emphasize in **double stars**")],
    pasta_heads: Annotated[
        str,
        typer.Option(
            help='"auto" (the shipped PASTA profile of the embedded model, else "span"), "span" '
            '(top-k heads by attention on the span, a heuristic) or a {"layer": [heads]} JSON file'
        ),
    ] = "auto",
    alpha: Annotated[float, typer.Option(help="PASTA scaling for tokens outside the span")] = PASTA_ALPHA,
    top_k: Annotated[int | None, typer.Option(help="heads chosen by --pasta-heads span (default 20)")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 64,
    emphasize: EmphasizeOpt = None,
    steer: Annotated[
        str,
        typer.Option(
            "--steer",
            help="pasta | instaboost | var | vhr | adaptvis | scalingvis | carve | modulation (the vision "
            "methods: on --image, or the **marked** passage, with the defaults; carve: --image only; "
            "instaboost: all heads, on the **marked** instruction)",
        ),
    ] = "pasta",
    image: ImageOpt = None,
    multiplier: Annotated[
        float, typer.Option(help="InstABoost factor on the attention to the instruction")
    ] = INSTABOOST_MULTIPLIER,
) -> dict:
    """Print the unsteered and the steered (PASTA, InstABoost, VAR, VHR, AdaptVis or ScalingVis)
    answers side by side (`headsteer vision generate` sets the vision methods' options)."""
    from heads import HeadSet
    from steer.pasta.method import check_alpha
    from viz.cli.jobs import DEFAULT_TOP_K, choose_heads, compare

    if steer in VISION_METHODS:  # the papers' defaults; `headsteer vision generate` sets them
        refuse_unused(
            steer,
            {
                "--alpha": run.gave("alpha", alpha, PASTA_ALPHA),
                "--pasta-heads": run.gave("pasta_heads", pasta_heads, "auto"),
                "--top-k": run.gave("top_k", top_k, None),
                "--emphasize": run.gave("emphasize", emphasize, None),
                "--multiplier": run.gave("multiplier", multiplier, INSTABOOST_MULTIPLIER),
            },
        )
        _positive(max_new_tokens=max_new_tokens)
        run.check_new_tokens(max_new_tokens)  # from the config, before the weights
        kw = dict(alpha=2.0, p=0.6, rho=0.5, tau=None, sink_dims=None, max_new_tokens=max_new_tokens)
        return steered_pair(run, prompt, steer, image, **kw)
    if steer != "instaboost" and run.gave("multiplier", multiplier, INSTABOOST_MULTIPLIER):
        raise HeadsteerValueError(f"--multiplier is not used by --steer {steer}; drop it")
    if steer == "instaboost":
        refuse_unused(
            steer,
            {
                "--alpha": run.gave("alpha", alpha, PASTA_ALPHA),
                "--pasta-heads": run.gave("pasta_heads", pasta_heads, "auto"),
                "--top-k": run.gave("top_k", top_k, None),
                "--image": run.gave("image", image, None),
            },
        )
        return _instaboost_pair(run, prompt, multiplier, max_new_tokens, emphasize)
    if steer != "pasta":
        raise HeadsteerValueError(
            f"--steer must be pasta, instaboost, var, vhr, adaptvis or scalingvis, got {short_repr(steer)}"
        )
    if image is not None:
        raise HeadsteerValueError(
            "--image needs --steer var, vhr, adaptvis or scalingvis (PASTA on an image span: "
            "Pasta(spans='image') in Python)"
        )

    check_alpha(alpha)  # before loading anything; warns on a no-op or a de-emphasizing alpha
    file_heads = None
    if pasta_heads not in ("auto", "span"):
        file_heads = HeadSet.parse(pasta_heads)
        check_head_file(pasta_heads, file_heads, option="--pasta-heads")
    if top_k is not None and pasta_heads not in ("auto", "span"):
        warn_line(f"--top-k {top_k} is ignored: the heads come from {pasta_heads}")
    top_k = DEFAULT_TOP_K if top_k is None else top_k
    _positive(top_k=top_k, max_new_tokens=max_new_tokens)
    run.check_new_tokens(max_new_tokens)  # from the config, before the weights
    check_prompt(prompt, emphasize)
    if file_heads is not None:  # its range, from the model's config before any weight is read
        from heads.model.loading import read_geometry

        geometry = read_geometry(run.model)
        check_head_file(pasta_heads, file_heads, option="--pasta-heads", geometry=geometry)
    hm = run.load()
    with run.status("choosing heads…"):
        heads = choose_heads(hm, prompt, pasta_heads, top_k, emphasize=emphasize)
    with run.progress(2 * max_new_tokens, "generating (PASTA, then baseline) tokens") as step:
        res = compare(
            hm,
            prompt,
            heads,
            alpha=alpha,
            max_new_tokens=max_new_tokens,
            emphasize=emphasize,
            progress=step,
        )
    table = Table(show_lines=True, expand=True)  # ratio=1 columns: equal widths
    table.add_column("baseline", ratio=1)
    table.add_column(f"PASTA (alpha={alpha}, {len(heads)} heads)", ratio=1)
    table.add_row(escape(res.baseline), escape(res.steered))
    run.show(table)
    return {"baseline": res.baseline, "steered": res.steered, "alpha": alpha, "heads": heads.to_dict()}


def _instaboost_pair(run: Run, prompt: str, multiplier: float, max_new_tokens: int, emphasize) -> dict:
    """Unsteered and InstABoost answers side by side (`headsteer generate --steer instaboost`)."""
    from heads._util.progress import offset_progress
    from steer import InstaBoost, SteeredModel

    method = InstaBoost(multiplier=multiplier)  # checked before the model loads
    _positive(max_new_tokens=max_new_tokens)
    run.check_new_tokens(max_new_tokens)  # from the config, before the weights
    check_prompt(prompt, emphasize)
    hm = run.load()
    sm = SteeredModel(hm)
    n = max_new_tokens
    with run.progress(2 * n, "generating (baseline, then InstABoost) tokens") as step:
        kw = dict(max_new_tokens=n, emphasize=emphasize)
        base = sm.generate(prompt, [], progress=offset_progress(step, 0, 2 * n) or False, **kw)
        steered = sm.generate(prompt, [method], progress=offset_progress(step, n, 2 * n) or False, **kw)
    table = Table(show_lines=True)
    table.add_column("baseline", ratio=1)
    table.add_column(f"InstABoost (multiplier={multiplier:g}, all heads)", ratio=1)
    table.add_row(escape(base.text), escape(steered.text))
    run.show(table)
    return {"baseline": base.text, "steered": steered.text, "steer": "instaboost", "multiplier": multiplier}


@command(report_app, "safety")
def report_safety(
    run: Run,
    out: Annotated[Path, typer.Option(help="HTML file to write")],
    prompts: Annotated[
        Path | None,
        typer.Option(
            help="harmful prompts: JSONL with a 'prompt' field, or one per line (read line by line)"
        ),
    ] = None,
    steps: Annotated[int, typer.Option(help="Sahara greedy steps")] = 3,
    system_prompt: Annotated[
        str | None,
        typer.Option(help="text put before the Query/Answer template ({query} in it is replaced too)"),
    ] = None,
    score_prompts: Annotated[int, typer.Option(help="prompts used to score heads")] = 16,
    max_new_tokens: Annotated[int, typer.Option(help="tokens generated per answer")] = 48,
    batch_size: Annotated[int, typer.Option(help="prompts per generate call in the ASR step")] = 16,
    ray: Annotated[
        str | None, typer.Option(help='run the Ships sweeps as Ray tasks: "local" or a cluster address')
    ] = None,
) -> dict:
    """Safety heads: Ships and dataset-level Ships heatmaps, Sahara, and ASR with heads ablated."""
    from heads.engine.executors import RayExecutor
    from heads.scorers.safety.request import SaharaRequest
    from heads.scorers.safety.ships import fill_template
    from viz.cli.requests import build_request, check_request
    from viz.reports.safety import read_prompts, safety_report, safety_template

    _positive(score_prompts=score_prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    run.check_new_tokens(max_new_tokens)  # from the config, before the weights
    template = safety_template(system_prompt)
    fill_template(template, ["check"])  # the template, before any work
    # Sahara's request (`heads.sahara`): --steps checked there, and against the model's heads
    options = {"steps": "--steps", "template": "--system-prompt"}
    sahara_request = build_request(SaharaRequest, options, steps=steps, template=template)
    texts = read_prompts(prompts) if prompts is not None else None
    out = run.output(out, suffixes=HTML)
    check_request(run, options, sahara_request)
    hm = run.load()
    with run.progress(5, "safety heads") as step:
        _, summary = safety_report(
            hm,
            out,
            prompts=texts,
            steps=sahara_request.steps,
            system_prompt=system_prompt,
            n_score=score_prompts,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            overwrite=run.force,
            progress=step,
            executor=None if ray is None else RayExecutor(ray),
        )
    a = summary["asr"]
    found = len(summary["sahara_heads"])
    top3 = "top-3" if found >= 3 else f"top-3 (Sahara found {found})"
    run.show(
        f"ASR baseline {a['baseline']:.2f} | Sahara top-1 {a['sahara_top1']:.2f}"
        f" | {top3} {a['sahara_top3']:.2f} | 3 random heads {a['random3_mean']:.2f}\n"
        f"Sahara heads {summary['sahara_heads']}"
    )
    return {"html": str(out), **summary}


@command(report_app, "all")
def report_all(
    run: Run,
    out: Annotated[Path, typer.Option(help="folder for the reports")] = Path("reports"),
    draws: Annotated[
        int, typer.Option(help=f"random-head draws in the MAPS ablation check (at most {MAX_DRAWS})")
    ] = 5,
    prompts: Annotated[
        int, typer.Option(help=f"few-shot prompts per relation in the MAPS check (at most {MAX_FEW_SHOT})")
    ] = 30,
    relations: Annotated[
        str, typer.Option(help='MAPS relations: "all" or comma-separated names (fewer: faster)')
    ] = "all",
) -> dict:
    """Every available report (embedded model by default), with an index.html linking them.

    The index is written last; on an error or Ctrl-C the files written so far are named."""
    from probes.datasets.relations import parse_relation_names
    from viz.reports.all import FILES, all_reports

    names = parse_relation_names(relations)  # checked before the model loads
    _positive(draws=draws, prompts=prompts)
    _at_most("--draws", draws, MAX_DRAWS)
    _at_most("--prompts", prompts, MAX_FEW_SHOT)
    run.folder(out, list(FILES))
    hm = run.load()
    with run.progress(1, "reports") as step:
        written = all_reports(
            hm, out, draws=draws, n_prompts=prompts, relations=names, overwrite=run.force, progress=step
        )
    return {k: str(v) for k, v in written.items()}


@command(build_app, "refusal-model")
def build_refusal_model_command(
    run: Run,
    out: Annotated[
        Path | None,
        typer.Option(help="folder for the model (default: $HEADSTEER_CACHE/smollm2-135m-refusal)"),
    ] = None,
    seed: Annotated[int, typer.Option(help="torch and shuffling seed")] = 0,
    epochs: Annotated[int, typer.Option(help="passes over the train pairs")] = 3,
) -> dict:
    """Fine-tune a refusal-tuned variant of the model (embedded by default) for the safety report.

    Harmful train requests -> a refusal, harmless ones -> the model's own answer; seeded; saved
    as safetensors with its tokenizer and a JSON summary (refusal rates on the test requests)."""
    from probes.studies.refusal_model import (
        REFUSAL_MODEL_FILES,
        build_refusal_model,
        planned_files,
        refusal_model_dir,
    )

    _positive(epochs=epochs)
    check_seed("--seed", seed)
    folder = refusal_model_dir() if out is None else out
    run.folder(folder, list(REFUSAL_MODEL_FILES))
    hm = run.load()
    run.folder(folder, planned_files(hm.tokenizer))  # the tokenizer's own files too, before the fine-tune
    with run.progress(1, "refusal model") as step:
        summary = build_refusal_model(
            folder, model=hm, seed=seed, epochs=epochs, overwrite=run.force, progress=step
        )
    run.show(
        f"explicit refusals on the test requests: harmful {summary['explicit_refusal_harmful_test']:.2f},"
        f" harmless {summary['explicit_refusal_harmless_test']:.2f}"
        f" (loss {summary['first_loss']} -> {summary['last_loss']}, {summary['seconds']:.0f} s)\n"
        f"use it with --model {folder}"
    )
    return summary


@command(app)
def demo(
    run: Run,
    out: Annotated[Path, typer.Option(help="folder for the report")] = Path("out"),
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 48,
) -> dict:
    """PASTA measured on counterfact and occupation (embedded model by default), with the answers it fixed."""
    from viz.cli.demo import run_demo

    t0 = time.perf_counter()
    _positive(max_new_tokens=max_new_tokens)
    run.check_new_tokens(max_new_tokens)  # from the config, before the weights
    run.folder(out, ["demo_report.html", "demo_report.csv"])
    hm = run.load()
    with run.progress(2 * max_new_tokens, "generating (PASTA, then baseline) tokens") as step:
        result = run_demo(
            out,
            model=hm,
            max_new_tokens=max_new_tokens,
            console=err if run.as_json else console,
            quiet=run.quiet,
            overwrite=run.force,
            progress=step,
        )
    run.show(f"done in {time.perf_counter() - t0:.0f} s")
    return result


def run() -> None:  # pragma: no cover
    app(prog_name="headsteer")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
