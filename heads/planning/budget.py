"""A memory budget checked from the config alone, before any weight loads (`check_budget`): the
front doors that load a model by name and take a budget (`headsteer run --max-memory`,
`headsteer report circuit --max-memory`) refuse a budget below the run's minimum first, naming it,
instead of loading the weights and refusing then."""

from __future__ import annotations

from typing import Any

import torch

from heads._util.validation import check_int
from heads.errors import HeadsteerValueError
from heads.planning.plan import MemoryPlan, plan_memory
from heads.planning.requests import MemoryRequest, as_memory_request
from heads.planning.units import format_bytes, parse_bytes

__all__ = ["WHOLE", "check_budget", "minimum_plan"]

WHOLE = ("patch", "path_patch", "sinks", "ships", "dataset_ships", "sahara")
"""Requests (by name) that run every row in one forward (the recorded runs of every pair, the
sink statistics' one forward, Ships' clean run of every prompt): their minimum is the plan at all
their rows, the others' at one row (their sweeps shrink the batch to what fits)."""


def minimum_plan(
    config: object,
    request: object,
    tokens: int,
    rows: int = 1,
    dtype: torch.dtype | str = torch.float32,
    devices: object = None,
) -> MemoryPlan:
    """The plan of the least memory `request` needs on `rows` rows (pairs / prompts) of at most
    `tokens` tokens: its plan (`REQUEST_PLANS`) at all `rows` for the requests of `WHOLE`, at one
    row for the others; EAP / EAP-IG at the lean path's plan (a budget below the default path's
    takes it); a request without a plan at a plain forward of one row (a lower bound: the weights
    and one forward's activations).

    Raises:
        HeadsteerValueError: a bad `tokens` / `rows`, or what `plan_memory` refuses.
    """
    tokens = check_int("tokens", tokens, lo=1)
    rows = check_int("rows", rows, lo=1)
    name = getattr(type(request), "NAME", request if isinstance(request, str) else None)
    try:
        req = as_memory_request(request)
    except HeadsteerValueError:
        if getattr(type(request), "NAME", None) is None or getattr(request, "method", None) == "attribution":
            raise  # patch(method="attribution") refuses a budget when it runs: refused here, before loading
        req = MemoryRequest("forward")  # no plan of its own: at least the weights and a forward
    whole = name in WHOLE and req.analysis in ("forward", "patch", "path_patch", "sinks")
    batch = rows if whole else 1
    if req.analysis == "eap":
        req = MemoryRequest("eap_lean", {"circuit": bool(req.get("circuit", False))})
    return plan_memory(config, req, tokens, batch, dtype, devices)


def check_budget(
    config: object,
    request: object,
    tokens: int,
    budget: object,
    rows: int = 1,
    dtype: torch.dtype | str = torch.float32,
    devices: object = None,
    option: str = "max_memory",
) -> MemoryPlan:
    """Refuse `budget` when it is below `request`'s minimum (`minimum_plan`) on `rows` rows of
    `tokens` tokens, from `config` alone (a model folder or name: its `config.json`; no weight is
    read). Returns the minimum plan.

    Raises:
        HeadsteerValueError: the budget is below the minimum (the message names the minimum, the
            plan and `option`); a bad budget.
    """
    limit = parse_bytes(budget, option)
    plan = minimum_plan(config, request, tokens, rows, dtype, devices)
    if plan.peak > limit:
        name: Any = getattr(type(request), "NAME", plan.request.analysis)
        raise HeadsteerValueError(
            f"{name} on {plan.batch} x {tokens} tokens needs at least {format_bytes(plan.peak)} "
            f"({plan!r}); {option} is {format_bytes(limit)}"
        )
    return plan
