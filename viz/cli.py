"""The `headsteer` command line."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

os.environ.setdefault("HF_HUB_OFFLINE", "1")

app = typer.Typer(help="headsteer: attention-head scoring and attention steering.", no_args_is_help=True)
report_app = typer.Typer(help="Write self-contained HTML reports.", no_args_is_help=True)
app.add_typer(report_app, name="report")

console = Console()
err = Console(stderr=True)
_STATE = {"debug": False}

ModelOpt = Annotated[
    str | None, typer.Option("--model", help="HF model folder (default: embedded SmolLM2-135M-Instruct)")
]


@app.callback()
def main(debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False) -> None:
    _STATE["debug"] = debug


def _fail(exc: Exception) -> None:
    if _STATE["debug"]:
        raise exc
    err.print(f"[red]error:[/red] {exc}", highlight=False, markup=True)
    raise typer.Exit(2)


def _quiet_transformers() -> None:
    """No per-weight progress bars or info logs from transformers in the terminal."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _load(model: str | None):
    from heads import load_model

    _quiet_transformers()
    with err.status("loading model…"):
        return load_model(model)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="prompt with the span to emphasize in **double stars**")],
    pasta_heads: Annotated[
        str,
        typer.Option(
            help='"auto" (top-k heads by span attention, a heuristic) or a {"layer": [heads]} JSON file'
        ),
    ] = "auto",
    alpha: Annotated[float, typer.Option(help="PASTA scaling for tokens outside the span")] = 0.01,
    top_k: Annotated[int, typer.Option(help="heads chosen by --pasta-heads auto")] = 20,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 64,
    model: ModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
) -> None:
    """Print the unsteered and the PASTA-steered answers side by side."""
    from .steering import choose_heads, compare

    try:
        hm = _load(model)
        heads = choose_heads(hm, prompt, pasta_heads, top_k)
        res = compare(hm, prompt, heads, alpha=alpha, max_new_tokens=max_new_tokens)
    except (ValueError, TypeError, FileNotFoundError) as exc:
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
    table.add_row(res.baseline, res.steered)
    console.print(table)


@report_app.command("attention")
def report_attention(
    prompt: Annotated[str, typer.Option(help="prompt with the span in **double stars**")],
    out: Annotated[Path, typer.Option(help="HTML file to write (a CSV is written beside it)")],
    top_k: Annotated[int, typer.Option(help="heads outlined as top-k")] = 20,
    model: ModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the written paths as JSON")] = False,
) -> None:
    """Attention mass on the emphasized span per (layer, head): heatmap + CSV."""
    from .steering import attention_report

    try:
        hm = _load(model)
        html_path, csv_path, _ = attention_report(hm, prompt, out, top_k=top_k)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        _fail(exc)
    if as_json:
        print(json.dumps({"html": str(html_path), "csv": str(csv_path)}))
    else:
        console.print(f"wrote {html_path}\nwrote {csv_path}")


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="folder for the report")] = Path("out"),
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 48,
) -> None:
    """Run the main job on the embedded model: a JSON instruction buried after a biography."""
    from .demo import run_demo

    t0 = time.perf_counter()
    _quiet_transformers()
    try:
        run_demo(out, max_new_tokens=max_new_tokens, console=console)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        _fail(exc)
    console.print(f"[dim]done in {time.perf_counter() - t0:.0f} s[/dim]")


def run() -> None:  # pragma: no cover
    app(prog_name="headsteer")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
