"""`headsteer plan`: the planned peak memory of an analysis or a steered generation, per device, from
the model's config alone (`heads.plan_memory`; no weight is read)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from heads.errors import HeadsteerValueError
from viz.cli.common import Run, command

__all__ = ["plan_command", "register_plan"]


def _devices(value: str | None) -> object:
    """`--devices`: none (one device: --device), a GPU count (`4`), or device names (`cuda:0,cuda:1`)."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # not `¹`, not a 5000-digit count
        if len(value) > 4:
            raise HeadsteerValueError(
                f"--devices must be a GPU count of at most 4 digits, got {value[:20]!r}"
            )
        return int(value)
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise HeadsteerValueError(f"--devices must be a GPU count or device names, got {value!r}")
    return names


def plan_command(
    run: Run,
    analysis: Annotated[
        str,
        typer.Option(
            help="forward, generate, sinks, detectors, retrieval, qrhead, knockout, gradient, logits, "
            "eap, eap_lean, patch or path_patch"
        ),
    ] = "forward",
    tokens: Annotated[int, typer.Option(help="prompt length in tokens")] = 1024,
    batch: Annotated[int, typer.Option(help="rows per forward")] = 1,
    new_tokens: Annotated[int, typer.Option(help="tokens to generate (--analysis generate)")] = 0,
    devices: Annotated[
        str | None,
        typer.Option(
            help="a GPU count (layers split evenly) or device names, comma-separated [default: --device]"
        ),  # noqa: E501
    ] = None,
    max_memory: Annotated[
        str | None,
        typer.Option(help="budget per device (e.g. 24GB): exit 2 naming the minimum if it does not fit"),
    ] = None,
    request: Annotated[
        Path | None,
        typer.Option(
            help="a request JSON file as `headsteer run` takes: plan the analysis it runs (instead of "
            "--analysis; --batch: its pairs / prompts)"
        ),
    ] = None,
) -> dict:
    """Planned peak memory per device of an analysis or a steered generation (config only, no weights)."""
    from heads.model.loading import check_dtype
    from heads.planning import MemoryRequest, format_bytes, parse_bytes, plan_memory

    budget = parse_bytes(max_memory, "--max-memory") if max_memory is not None else None
    params = {"new_tokens": new_tokens} if analysis == "generate" and new_tokens else {}
    if new_tokens and analysis != "generate":
        raise HeadsteerValueError("--new-tokens applies to --analysis generate only")
    planned: object = MemoryRequest(analysis, params)
    if request is not None:
        from heads._util.validation import read_text_file
        from heads.scorers.request_base import Request

        if run.gave("analysis", analysis, "forward") or new_tokens:
            raise HeadsteerValueError("give --request or --analysis (--new-tokens), not both")
        if not request.is_file():
            raise typer.BadParameter(f"no request file {str(request)!r}", param_hint="--request")
        planned = Request.from_json(read_text_file(request))
    where = _devices(devices)
    with run.status("planning from the config…"):
        plan = plan_memory(
            run.model, planned, tokens, batch, check_dtype(run.dtype), run.device if where is None else where
        )
    if budget is not None and plan.peak > budget and request is not None:
        from heads.planning.budget import minimum_plan

        least = minimum_plan(
            run.model, planned, tokens, batch, check_dtype(run.dtype), run.device if where is None else where
        )
        if least.peak <= budget:  # the run takes its leaner path under this budget (EAP: eap_lean)
            plan = least
    analysis = plan.request.analysis
    if budget is not None and plan.peak > budget:
        raise HeadsteerValueError(
            f"{analysis} on {tokens} tokens x {batch} needs at least {format_bytes(plan.peak)} on one "
            f"device; --max-memory is {format_bytes(budget)}"
        )
    # patching: which activation (head_out, the plan's default, pattern, ...)
    kind = plan.request.params.get("kind", "head_out" if analysis == "patch" else None)
    label = analysis if kind is None else f"{analysis} ({kind})"
    if plan.request.params.get("circuit"):
        label += " with the circuit's exact evaluations"
    table = Table(title=f"{escape(label)}: {tokens} tokens x {batch}, {run.dtype}")
    for col in ("device", "layers", "weights", "activations", "peak"):
        table.add_column(col)
    for d in plan.devices:
        table.add_row(
            escape(d.device),
            str(d.layers),
            format_bytes(d.weights),
            format_bytes(d.activations),
            format_bytes(d.total),
        )
    run.show(table)
    return plan.to_json()


def register_plan(app: typer.Typer) -> None:
    """`headsteer plan` (writes no file)."""
    command(app, "plan", writes_files=False, uses_device=False)(plan_command)
