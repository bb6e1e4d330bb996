"""`headsteer report qk`: QK attribution of one head on induction, IOI or a prompt file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from heads._util.validation import short_repr
from viz.cli.common import Run, _at_most, _positive


def report_qk(
    run: Run,
    out: Annotated[Path, typer.Option(help="HTML file to write (the attribution JSON is written beside it)")],
    head: Annotated[str, typer.Option(help="the head as L.H (layer.head, e.g. 18.6) or L18.H6")],
    task: Annotated[
        str, typer.Option(help="induction, ioi, or a prompt file (one per line, or JSONL with 'prompt')")
    ] = "induction",
    prompts: Annotated[int, typer.Option(help="prompts to read (at most 64)")] = 4,
) -> dict:
    """Why a head attends where it does: its logits as query x key component terms, through
    source tokens, with the Q / K composition into it."""
    from heads.scorers.qk.request import QKRequest
    from viz.cli.requests import build_request, check_request
    from viz.reports.qk import MAX_PROMPTS, TASKS, qk_report, qk_steps, read_prompt_file

    # the request `heads.qk_attribution` builds: the head checked there, and against the model's
    # config (its family, its range) before the weights load
    options = {"head": "--head"}
    request = build_request(QKRequest, options, head=head, by="source_token")
    _positive(prompts=prompts)
    _at_most("--prompts", prompts, MAX_PROMPTS)
    if task not in TASKS:
        if not Path(task).is_file():
            raise typer.BadParameter(
                f"{short_repr(task)} is neither {' / '.join(TASKS)} nor a prompt file", param_hint="--task"
            )
        given = read_prompt_file(task)[:prompts]  # a bad file fails here, before the model loads
    out = run.output(out, suffixes=(".html", ".htm"))
    js = run.output(out.with_suffix(".json"))
    check_request(run, options, request)
    if task not in TASKS:  # a prompt over the model's positions: tokenizer and config alone
        from viz.cli.run_request import check_inputs

        check_inputs(run.model, given, pairs=False, option="--task")
    hm = run.load()
    with run.progress(qk_steps(), "qk") as step:
        _, summary = qk_report(
            hm, out, head=request.head, request=request, task=task, n_prompts=prompts,
            overwrite=run.force, attribution_json=js, progress=step,
        )  # fmt: skip
    run.show(
        f"{summary['head']} on {summary['task']}: logit {summary['focus_logit']:.3f}, attention "
        f"{summary['focus_attention']:.3f} at the focus cells; max |sum - logit| {summary['max_error']:.2g}"
    )
    for side in ("key", "query"):
        top = ", ".join(f"{c} {v:+.2f}" for c, v in summary[f"top_{side}_side"][:3])
        run.show(f"top {side}-side components: {top}")
    return {"html": str(out), "attribution": str(js), **summary}
