"""Causal Head Gating (CHG): one learned soft gate per head, and the head taxonomy built on it."""

from heads.scorers.gating.chg import (
    LABELS,
    GateTask,
    GatingResult,
    HeadGate,
    gate_edits,
    gate_heads,
    gate_task,
    gated_nll,
)

__all__ = [
    "LABELS",
    "GateTask",
    "GatingResult",
    "HeadGate",
    "gate_edits",
    "gate_heads",
    "gate_task",
    "gated_nll",
]
