"""`headsteer demo` / `make demo`: PASTA on the embedded model, end to end."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from heads import load_model

from .steering import DEFAULT_TOP_K, attention_report, choose_heads, compare

BIO = (
    "Maria Gonzalez was born in 1978 in Valencia, Spain. She studied marine biology at the University "
    "of Barcelona and spent ten years on research ships in the Atlantic, where she tracked migrating "
    "whales. In 2015 she moved to Lisbon and founded a small company that builds underwater "
    "microphones. She is married, has two children, and spends her weekends sailing and teaching "
    "kids to swim."
)
INSTRUCTION = 'Answer in JSON format with the keys "name" and "occupation".'
DEMO_PROMPT = f"Biography: {BIO}\n**{INSTRUCTION}**\nQuestion: Describe Maria's career."


def run_demo(out: str | Path = "out", *, max_new_tokens: int = 48, console: Console | None = None) -> dict:
    """Baseline vs PASTA-steered answer on `DEMO_PROMPT`, plus the attention report.

    Returns a dict with the two answers, the heads and the report paths.
    """
    console = console or Console()
    out = Path(out)
    with console.status("loading the embedded SmolLM2-135M-Instruct…"):
        hm = load_model()
    console.print(Panel(escape(DEMO_PROMPT), title="prompt (the **span** is emphasized)"))
    with console.status("scoring heads and generating…"):
        heads = choose_heads(hm, DEMO_PROMPT, "span", DEFAULT_TOP_K)
        res = compare(hm, DEMO_PROMPT, heads, alpha=0.01, max_new_tokens=max_new_tokens)
    table = Table(show_lines=True, title=f"PASTA alpha=0.01 on {len(heads)} heads (top span attention)")
    table.add_column("baseline", ratio=1)
    table.add_column("PASTA-steered", ratio=1)
    table.add_row(escape(res.baseline), escape(res.steered))
    console.print(table)
    html_path, csv_path, _ = attention_report(hm, DEMO_PROMPT, out / "demo_report.html", comparison=res)
    console.print(f"report: {html_path.resolve()}\nscores: {csv_path.resolve()}")
    return {
        "baseline": res.baseline,
        "steered": res.steered,
        "heads": heads.to_dict(),
        "html": str(html_path),
        "csv": str(csv_path),
    }
