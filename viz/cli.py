"""The `headsteer` command line."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from .cli_common import (  # noqa: E402  (after the offline switch)
    _STATE,
    USER_ERRORS,
    EmphasizeOpt,
    JsonOpt,
    ModelOpt,
    QuietOpt,
    _fail,
    _folder_out,
    _html_out,
    _json,
    _load,
    _positive,
    _progress,
    _quiet_transformers,
    console,
    err,
)
from .cli_eval import eval_command, profile_app  # noqa: E402
from .cli_vision import register_vision  # noqa: E402

app = typer.Typer(
    help="headsteer: attention-head scoring and attention steering.",
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)
report_app = typer.Typer(
    help="Write self-contained HTML reports.", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(report_app, name="report")
app.add_typer(profile_app, name="profile")
app.command("eval")(eval_command)
register_vision(app, report_app)  # `headsteer vision generate`, `headsteer report vision`


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
    quiet: QuietOpt = False,
) -> None:
    _STATE["debug"] = debug
    _STATE["quiet"] = quiet


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="prompt with the span to emphasize in **double stars**")],
    pasta_heads: Annotated[
        str,
        typer.Option(
            help='"auto" (the shipped PASTA profile of the embedded model, else "span"), "span" '
            '(top-k heads by attention on the span, a heuristic) or a {"layer": [heads]} JSON file'
        ),
    ] = "auto",
    alpha: Annotated[float, typer.Option(help="PASTA scaling for tokens outside the span")] = 0.01,
    top_k: Annotated[int, typer.Option(help="heads chosen by --pasta-heads span")] = 20,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 64,
    emphasize: EmphasizeOpt = None,
    model: ModelOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Print the unsteered and the PASTA-steered answers side by side."""
    from heads import HeadSet
    from steer import Pasta

    from .steering import choose_heads, compare

    try:
        Pasta({}, alpha=alpha)  # check alpha before loading anything
        if pasta_heads not in ("auto", "span") and not len(HeadSet.parse(pasta_heads)):
            raise ValueError(f"head file {pasta_heads!r} selects no heads")
        _positive(top_k=top_k, max_new_tokens=max_new_tokens)
        hm = _load(model)
        heads = choose_heads(hm, prompt, pasta_heads, top_k, emphasize=emphasize)
        res = compare(hm, prompt, heads, alpha=alpha, max_new_tokens=max_new_tokens, emphasize=emphasize)
    except USER_ERRORS as exc:
        _fail(exc)
    if as_json:
        print(
            json.dumps(
                {"baseline": res.baseline, "steered": res.steered, "alpha": alpha, "heads": heads.to_dict()}
            )
        )
        return
    table = Table(show_lines=True)
    table.add_column("baseline", ratio=1)
    table.add_column(f"PASTA (alpha={alpha}, {len(heads)} heads)", ratio=1)
    table.add_row(escape(res.baseline), escape(res.steered))
    console.print(table)


@report_app.command("attention")
def report_attention(
    prompt: Annotated[str, typer.Option(help="prompt with the span in **double stars**")],
    out: Annotated[Path, typer.Option(help="HTML file to write (a CSV is written beside it)")],
    top_k: Annotated[int, typer.Option(help="heads outlined as top-k")] = 20,
    emphasize: EmphasizeOpt = None,
    model: ModelOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Attention mass on the emphasized span per (layer, head): heatmap + CSV."""
    from .steering import attention_report

    try:
        _html_out(out)
        _positive(top_k=top_k)
        hm = _load(model)
        html_path, csv_path, _ = attention_report(hm, prompt, out, top_k=top_k, emphasize=emphasize)
    except USER_ERRORS as exc:
        _fail(exc)
    if as_json:
        print(_json({"html": str(html_path), "csv": str(csv_path)}))
    else:
        console.print(f"wrote {html_path}\nwrote {csv_path}", highlight=False)


@report_app.command("maps")
def report_maps(
    out: Annotated[Path, typer.Option(help="HTML file to write")],
    relations: Annotated[str, typer.Option(help='"all" or comma-separated relation names')] = "all",
    top: Annotated[int, typer.Option(help="top heads listed per relation")] = 20,
    draws: Annotated[int, typer.Option(help="random-head draws in the ablation check")] = 5,
    prompts: Annotated[int, typer.Option(help="few-shot prompts per relation in the ablation check")] = 30,
    model: ModelOpt = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """MAPS: relation and suppression scores of every head from its weights, validated by inference."""
    _STATE["quiet"] = _STATE["quiet"] or quiet
    from probes.relations import parse_relation_names

    from .maps_report import maps_report

    try:
        _html_out(out)
        names = parse_relation_names(relations)  # checked before the model loads
        _positive(top=top, draws=draws, prompts=prompts)
        hm = _load(model)
        bar, step = _progress("MAPS")
        with bar:
            path, summary = maps_report(
                hm, out, relations=names, top=top, draws=draws, n_prompts=prompts, progress=step
            )
    except USER_ERRORS as exc:
        _fail(exc)
    if as_json:
        print(_json({"html": str(path), **summary}))
        return
    table = Table(title="MAPS validation")
    for col in ("relation", "r static~dynamic", "heads", "base acc", "top ablated", "random ablated"):
        table.add_column(col)
    for n in summary["relations"]:
        a = summary["ablation"][n]
        table.add_row(
            n,
            f"{summary['pearson_r'][n]:.2f}",
            str(a["n_heads"]),
            f"{a['base']:.2f}",
            "skipped" if a["skipped"] else f"{a['ablated']:.2f}",
            "" if a["skipped"] else f"{a['random_mean']:.2f}",
        )
    console.print(table)
    for n in summary["dropped"]:
        console.print(f"dropped: {n} (too few single-token pairs)", highlight=False)
    console.print(f"wrote {path}", highlight=False)


@report_app.command("safety")
def report_safety(
    out: Annotated[Path, typer.Option(help="HTML file to write")],
    prompts: Annotated[
        Path | None, typer.Option(help="harmful prompts: JSONL with a 'prompt' field, or one per line")
    ] = None,
    steps: Annotated[int, typer.Option(help="Sahara greedy steps")] = 3,
    system_prompt: Annotated[
        str | None, typer.Option(help="text put before the Query/Answer template")
    ] = None,
    score_prompts: Annotated[int, typer.Option(help="prompts used to score heads")] = 16,
    max_new_tokens: Annotated[int, typer.Option(help="tokens generated per answer")] = 48,
    model: ModelOpt = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Safety heads: Ships and dataset-level Ships heatmaps, Sahara, and ASR with heads ablated."""
    from .safety_report import read_prompts, safety_report

    _STATE["quiet"] = _STATE["quiet"] or quiet
    try:
        _html_out(out)
        _positive(steps=steps, score_prompts=score_prompts, max_new_tokens=max_new_tokens)
        texts = read_prompts(prompts) if prompts is not None else None
        hm = _load(model)
        bar, step = _progress("safety heads")
        with bar:
            path, summary = safety_report(
                hm,
                out,
                prompts=texts,
                steps=steps,
                system_prompt=system_prompt,
                n_score=score_prompts,
                max_new_tokens=max_new_tokens,
                progress=step,
            )
    except USER_ERRORS as exc:
        _fail(exc)
    if as_json:
        print(_json({"html": str(path), **summary}))
        return
    a = summary["asr"]
    console.print(
        f"ASR baseline {a['baseline']:.2f} | Sahara top-1 {a['sahara_top1']:.2f}"
        f" | top-3 {a['sahara_top3']:.2f} | 3 random heads {a['random3_mean']:.2f}\n"
        f"Sahara heads {summary['sahara_heads']}\nwrote {path}",
        highlight=False,
    )


@report_app.command("all")
def report_all(
    out: Annotated[Path, typer.Option(help="folder for the reports")] = Path("reports"),
    draws: Annotated[int, typer.Option(help="random-head draws in the MAPS ablation check")] = 5,
    prompts: Annotated[int, typer.Option(help="few-shot prompts per relation in the MAPS check")] = 30,
    model: ModelOpt = None,
    quiet: QuietOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Every available report (embedded model by default), with an index.html linking them."""
    from .all_reports import all_reports

    _STATE["quiet"] = _STATE["quiet"] or quiet
    try:
        _folder_out(out)
        _positive(draws=draws, prompts=prompts)
        hm = _load(model)
        bar, step = _progress("reports")
        with bar:
            written = all_reports(hm, out, draws=draws, n_prompts=prompts, progress=step)
    except USER_ERRORS as exc:
        _fail(exc)
    if as_json:
        print(_json({k: str(v) for k, v in written.items()}))
    else:
        for name, path in written.items():
            console.print(f"{name}: {path}", highlight=False)


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="folder for the report")] = Path("out"),
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 48,
    as_json: JsonOpt = False,
) -> None:
    """Run the main job on the embedded model: a JSON instruction buried after a biography."""
    from .demo import run_demo

    t0 = time.perf_counter()
    try:
        _folder_out(out)
        _positive(max_new_tokens=max_new_tokens)
        _quiet_transformers()
        result = run_demo(out, max_new_tokens=max_new_tokens, console=err if as_json else console)
    except USER_ERRORS as exc:
        _fail(exc)
    if as_json:
        print(_json(result))
    else:
        console.print(f"[dim]done in {time.perf_counter() - t0:.0f} s[/dim]")


def run() -> None:  # pragma: no cover
    app(prog_name="headsteer")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
