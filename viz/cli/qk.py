"""`headsteer report qk`: QK attribution of one head on induction, IOI or a prompt file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from viz.cli.common import Run, _at_most, _positive

_HEAD = re.compile(r"^\s*(\d+)\.(\d+)\s*$")


def report_qk(
    run: Run,
    out: Annotated[Path, typer.Option(help="HTML file to write (the attribution JSON is written beside it)")],
    head: Annotated[str, typer.Option(help="the head as L.H (layer.head, e.g. 18.6)")],
    task: Annotated[
        str, typer.Option(help="induction, ioi, or a prompt file (one per line, or JSONL with 'prompt')")
    ] = "induction",
    prompts: Annotated[int, typer.Option(help="prompts to read (at most 64)")] = 4,
) -> dict:
    """Why a head attends where it does: its logits as query x key component terms, through
    source tokens, with the Q / K composition into it."""
    from viz.reports.qk import MAX_PROMPTS, TASKS, qk_report, qk_steps, read_prompt_file

    m = _HEAD.match(head)
    if m is None:
        raise HeadsteerValueError(f"--head must look like L.H (e.g. 18.6), got {short_repr(head)}")
    _positive(prompts=prompts)
    _at_most("--prompts", prompts, MAX_PROMPTS)
    if task not in TASKS:
        if not Path(task).is_file():
            raise typer.BadParameter(
                f"{short_repr(task)} is neither {' / '.join(TASKS)} nor a prompt file", param_hint="--task"
            )
        read_prompt_file(task)  # a bad file fails here, before the model loads
    out = run.output(out, suffixes=(".html", ".htm"))
    js = run.output(out.with_suffix(".json"))
    hm = run.load()
    pair = (int(m.group(1)), int(m.group(2)))
    hm.check_head(*pair)
    with run.progress(qk_steps(), "qk") as step:
        _, summary = qk_report(
            hm, out, head=pair, task=task, n_prompts=prompts, overwrite=run.force, attribution_json=js,
            progress=step,
        )  # fmt: skip
    run.show(
        f"{summary['head']} on {summary['task']}: logit {summary['focus_logit']:.3f}, attention "
        f"{summary['focus_attention']:.3f} at the focus cells; max |sum - logit| {summary['max_error']:.2g}"
    )
    for side in ("key", "query"):
        top = ", ".join(f"{c} {v:+.2f}" for c, v in summary[f"top_{side}_side"][:3])
        run.show(f"top {side}-side components: {top}")
    return {"html": str(out), "attribution": str(js), **summary}
