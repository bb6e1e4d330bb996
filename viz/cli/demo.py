"""`headsteer demo` / `make demo`: PASTA on the embedded model, end to end."""

from __future__ import annotations

import contextlib
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from heads import HeadModel, load_model
from heads._util.files import check_output
from heads._util.progress import Progress
from heads.errors import HeadsteerValueError
from viz.cli.jobs import DEFAULT_TOP_K, attention_report, choose_heads, compare

BIO = (
    "Maria Gonzalez was born in 1978 in Valencia, Spain. She studied marine biology at the University "
    "of Barcelona and spent ten years on research ships in the Atlantic, where she tracked migrating "
    "whales. In 2015 she moved to Lisbon and founded a small company that builds underwater "
    "microphones. She is married, has two children, and spends her weekends sailing and teaching "
    "kids to swim."
)
INSTRUCTION = 'Answer in JSON format with the keys "name" and "occupation".'
DEMO_PROMPT = f"Biography: {BIO}\n**{INSTRUCTION}**\nQuestion: Describe Maria's career."


def run_demo(
    out: str | Path = "out",
    *,
    model: HeadModel | None = None,
    max_new_tokens: int = 48,
    console: Console | None = None,
    quiet: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict:
    """Baseline vs PASTA-steered answer on `DEMO_PROMPT`, plus the attention report.

    Args:
        out: folder for `demo_report.html` and `demo_report.csv`.
        model: the model (default: the embedded SmolLM2-135M-Instruct, loaded here).
        max_new_tokens: tokens generated per answer.
        console: where the prompt and the answers are printed (default stdout).
        quiet: no spinners.
        progress: `progress(done, total)` in decoding steps of the two answers (`total = 2 *
            max_new_tokens`; `heads._util.progress`), shown instead of the spinner; None: a spinner.
        overwrite: replace existing report files.

    Returns a dict with the two answers, the heads and the report paths.

    Raises:
        ValueError: `out` is a file, or a report file exists and `overwrite` is False.
    """
    console = console or Console()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise HeadsteerValueError(f"{str(out)!r} exists and is not a folder")
    html_out = check_output(out / "demo_report.html", overwrite)
    check_output(html_out.with_suffix(".csv"), overwrite)

    def status(msg: str):
        return contextlib.nullcontext() if quiet else console.status(msg)

    if model is None:
        with status("loading the embedded SmolLM2-135M-Instruct…"):
            model = load_model()
    console.print(Panel(escape(DEMO_PROMPT), title="prompt (the **span** is emphasized)"))
    with status("scoring heads and generating…") if progress is None else contextlib.nullcontext():
        heads = choose_heads(model, DEMO_PROMPT, "span", DEFAULT_TOP_K)
        res = compare(model, DEMO_PROMPT, heads, alpha=0.01, max_new_tokens=max_new_tokens, progress=progress)
    table = Table(
        show_lines=True, expand=True, title=f"PASTA alpha=0.01 on {len(heads)} heads (top span attention)"
    )
    table.add_column("baseline", ratio=1)
    table.add_column("PASTA-steered", ratio=1)
    table.add_row(escape(res.baseline), escape(res.steered))
    console.print(table)
    html_path, csv_path, _ = attention_report(
        model, DEMO_PROMPT, html_out, comparison=res, overwrite=overwrite
    )
    return {
        "baseline": res.baseline,
        "steered": res.steered,
        "heads": heads.to_dict(),
        "html": str(html_path),
        "csv": str(csv_path),
    }
