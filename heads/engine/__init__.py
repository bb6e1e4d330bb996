"""The edit engine: `editing()` and its sites, the edits, the kernels (blocked, fused), batched variants,
prefix reuse and the plain forward."""

from heads.engine.context import (
    FUSED_MIN_ROWS_CPU,
    KERNELS,
    QUERY_BLOCK,
    SITES,
    EditNeverFired,
    Site,
    active_edit_count,
    editing,
    fusable,
    registered_name,
)

__all__ = [
    "FUSED_MIN_ROWS_CPU",
    "KERNELS",
    "QUERY_BLOCK",
    "SITES",
    "EditNeverFired",
    "Site",
    "active_edit_count",
    "editing",
    "fusable",
    "registered_name",
]
