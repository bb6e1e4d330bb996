"""Memory planning from a model's config alone (`plan_memory`, docs/long-context.md)."""

from heads.planning.plan import ANALYSES, DevicePlan, MemoryPlan, MemoryRequest, plan_memory, rows_within
from heads.planning.units import format_bytes, parse_bytes

__all__ = [
    "ANALYSES",
    "DevicePlan",
    "MemoryPlan",
    "MemoryRequest",
    "format_bytes",
    "parse_bytes",
    "plan_memory",
    "rows_within",
]
