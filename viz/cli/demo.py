"""`headsteer demo` / `make demo`: PASTA on the embedded model, end to end, with its measured effect.

The demo runs where the Results table shows PASTA's clear wins: the `occupation` task (a
biography states the occupation in its first sentence, then piles up distracting details) and
`counterfact` (a "Previously, ... Currently, ..." update). On the first `n` test examples of
each it measures the task metric (`probes.studies.evaluate`: top-1 over the task's choices /
new-fact efficacy) without and with PASTA, then prints, for the first examples PASTA fixed
(wrong before, right after), the two greedy continuations, cut where the answer ends
(`STOP`), and writes the attention report of the first of them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from heads import HeadModel, load_model
from heads._util.files import check_output
from heads._util.progress import Progress
from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from viz.cli.jobs import DEFAULT_TOP_K, Comparison, attention_report, choose_heads

BIO = (
    "Maria Gonzalez was born in 1978 in Valencia, Spain. She studied marine biology at the University "
    "of Barcelona and spent ten years on research ships in the Atlantic, where she tracked migrating "
    "whales. In 2015 she moved to Lisbon and founded a small company that builds underwater "
    "microphones. She is married, has two children, and spends her weekends sailing and teaching "
    "kids to swim."
)
INSTRUCTION = 'Answer in JSON format with the keys "name" and "occupation".'
DEMO_PROMPT = f"Biography: {BIO}\n**{INSTRUCTION}**\nQuestion: Describe Maria's career."
"""A JSON instruction buried after a biography (the attention report of `headsteer report all`)."""

DEMO_TASKS = ("counterfact", "occupation")
"""The tasks the demo measures: PASTA's clear wins in the README's Results table."""
DEMO_EXAMPLES = 16
"""Test examples per task the demo measures (the first of the split)."""
SHOWN = 2
"""Examples per task whose two answers are printed (the first PASTA fixed: wrong before, right after)."""
STOP = (".", "\n")
"""A continuation ends at the first of these (kept): the answer is one short clause."""
ALPHA = 0.01


@dataclass
class TaskEffect:
    """The metric of one task without and with PASTA, on the same examples."""

    task: str
    metric: str
    n: int
    baseline: float
    steered: float
    fixed: int
    broken: int


def until_stop(text: str, stops: tuple[str, ...] = STOP) -> str:
    """`text` up to and including the first stop string (the whole text when none occurs)."""
    cut = min((text.find(s) + len(s) for s in stops if s in text), default=len(text))
    return text[:cut]


def marked(prompt: str, span: str) -> str:
    """`prompt` with its (once-occurring) `span` wrapped in `**...**` markup."""
    return prompt.replace(span, f"**{span}**", 1)


def run_demo(
    out: str | Path = "out",
    *,
    model: HeadModel | None = None,
    max_new_tokens: int = 48,
    n: int = DEMO_EXAMPLES,
    console: Console | None = None,
    quiet: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict:
    """Measure PASTA (the shipped profile, alpha 0.01) on `DEMO_TASKS`, print the effect and
    the answers PASTA changed, and write the attention report of the first one.

    Args:
        out: folder for `demo_report.html` and `demo_report.csv`.
        model: the model (default: the embedded SmolLM2-135M-Instruct, loaded here). A model
            without a shipped profile is steered on the top heads by span attention (a warning).
        max_new_tokens: the most tokens of a continuation (it stops earlier at `STOP`).
        n: test examples measured per task (default `DEMO_EXAMPLES` = 16).
        console: where the effect and the answers are printed (default stdout).
        quiet: no spinners.
        progress: `progress(done, total)` with `total = 2 * max_new_tokens` over the whole
            run (`heads._util.progress`), shown instead of the spinner; None: a spinner.
        overwrite: replace existing report files.

    Returns a dict: `effects` (per task: metric, n, baseline, steered, fixed, broken),
    `examples` (the printed ones, PASTA's first fixes: id, task, answer, both top choices and both texts), the
    heads and the report paths.

    Raises:
        ValueError: `out` is a file, a report file exists and `overwrite` is False, or bad `n`.
    """
    from probes.datasets.tasks import load_task
    from probes.studies.evaluate import evaluate

    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise HeadsteerValueError(f"n must be an int >= 2, got {short_repr(n)}")
    console = console or Console()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise HeadsteerValueError(f"{str(out)!r} exists and is not a folder")
    html_out = check_output(out / "demo_report.html", overwrite)
    check_output(html_out.with_suffix(".csv"), overwrite)

    def status(msg: str):
        return contextlib.nullcontext() if quiet or progress is not None else console.status(msg)

    total = 2 * max_new_tokens
    steps = 3 * len(DEMO_TASKS)  # per task: baseline metric, PASTA metric, the two answers

    def advance(k: int) -> None:
        if progress is not None:
            progress(total * k // steps, total)

    if model is None:
        with status("loading the embedded SmolLM2-135M-Instruct…"):
            model = load_model()
    examples = {t: load_task(t, "test").examples[:n] for t in DEMO_TASKS}
    first = examples[DEMO_TASKS[0]][0]
    heads = choose_heads(model, marked(first.prompt, first.emphasize), "auto", DEFAULT_TOP_K)
    effects, shown, done = [], [], 0
    for task in DEMO_TASKS:
        with status(f"measuring {task} without and with PASTA…"):
            base = evaluate(model, task, "none", limit=n, progress=False)
            advance(done := done + 1)
            steered = evaluate(model, task, "pasta", limit=n, pasta_heads=heads, alpha=ALPHA, progress=False)
            advance(done := done + 1)
        b, s = base.examples.set_index("id"), steered.examples.set_index("id")
        effects.append(
            TaskEffect(
                task,
                str(base.table.metric.iloc[0]),
                len(b),
                float(base.table.value.iloc[0]),
                float(steered.table.value.iloc[0]),
                int((~b.correct & s.correct).sum()),
                int((b.correct & ~s.correct).sum()),
            )
        )
        changed = [e for e in examples[task] if s.correct[e.id] and not b.correct[e.id]][:SHOWN]
        if changed:
            with status(f"generating the answers PASTA changed ({task})…"):
                texts = _answers(model, changed, heads, max_new_tokens)
            for e, (bt, st) in zip(changed, texts, strict=True):
                shown.append(
                    {
                        "id": e.id,
                        "task": task,
                        "prompt": marked(e.prompt, e.emphasize),
                        "answer": e.choices[e.label],
                        "baseline_choice": b.predicted[e.id],
                        "steered_choice": s.predicted[e.id],
                        "baseline": bt,
                        "steered": st,
                    }
                )
        advance(done := done + 1)
    _print(console, effects, shown, len(heads))
    report_prompt = shown[0]["prompt"] if shown else marked(first.prompt, first.emphasize)
    comparison = None
    if shown:
        comparison = Comparison(report_prompt, heads, ALPHA, shown[0]["baseline"], shown[0]["steered"])
    html_path, csv_path, _ = attention_report(
        model, report_prompt, html_out, comparison=comparison, overwrite=overwrite, chat=False
    )
    return {
        "effects": [vars(e) for e in effects],
        "examples": shown,
        "heads": heads.to_dict(),
        "html": str(html_path),
        "csv": str(csv_path),
    }


def _answers(model: HeadModel, examples: list, heads, max_new_tokens: int) -> list[tuple[str, str]]:
    """Greedy baseline and PASTA continuations of `examples`, each cut at `STOP`."""
    from transformers import StoppingCriteriaList, StopStringCriteria

    from steer import Pasta, SteeredModel

    sm = SteeredModel(model)
    stop = StoppingCriteriaList([StopStringCriteria(model.tokenizer, list(STOP))])
    kw = dict(
        emphasize=[[e.emphasize] for e in examples],
        chat=False,
        markup=False,
        max_new_tokens=max_new_tokens,
        progress=False,
        stopping_criteria=stop,
    )
    prompts = [e.prompt for e in examples]
    base = sm.generate(prompts, **kw).texts
    steered = sm.generate(prompts, [Pasta(heads, alpha=ALPHA)], **kw).texts
    return [(until_stop(b), until_stop(s)) for b, s in zip(base, steered, strict=True)]


def _print(console: Console, effects: list[TaskEffect], shown: list[dict], n_heads: int) -> None:
    title = f"PASTA alpha={ALPHA} on {n_heads} heads, first {effects[0].n} test examples per task"
    table = Table(title=title)
    for col in ("task", "metric", "baseline", "PASTA", "fixed", "broken"):
        table.add_column(col)
    for e in effects:
        steered = f"[bold]{e.steered:.2f}[/bold]"
        table.add_row(e.task, e.metric, f"{e.baseline:.2f}", steered, str(e.fixed), str(e.broken))
    console.print(table)
    for ex in shown:
        tail = ex["prompt"]
        console.print(f"\n[bold]{ex['id']}[/bold] (right answer: {escape(ex['answer'])})\n{escape(tail)}")
        side = Table(show_lines=True, expand=True)
        side.add_column("baseline", ratio=1)
        side.add_column("PASTA-steered", ratio=1)
        side.add_row(
            f"top choice: {escape(ex['baseline_choice'])}\ntext: …{escape(ex['baseline'])}",
            f"top choice: {escape(ex['steered_choice'])}\ntext: …{escape(ex['steered'])}",
        )
        console.print(side)
    if not shown:
        console.print("PASTA fixed no answer on these examples.")
