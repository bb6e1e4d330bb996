"""Mechanisms across training: any analysis over a series of checkpoints, and the comparisons
across steps (emergence, role timelines, circuit overlap, function persistence), after Tigges et
al. 2024 and Olsson et al. 2022 (docs/methods/training_dynamics.md)."""

from heads.dynamics.analyses import ANALYSES, Analysis, tidy
from heads.dynamics.checkpoints import Checkpoint, find_checkpoints, read_step
from heads.dynamics.compare import (
    Emergence,
    component_emergence,
    edge_overlap,
    emergence,
    head_overlap,
    overlap,
    persistence,
    quantity,
    role_timelines,
)
from heads.dynamics.icl import icl_score, icl_sequences
from heads.dynamics.runner import over_checkpoints
from heads.results.dynamics import CheckpointSeries

__all__ = [
    "ANALYSES",
    "Analysis",
    "Checkpoint",
    "CheckpointSeries",
    "Emergence",
    "component_emergence",
    "edge_overlap",
    "emergence",
    "find_checkpoints",
    "head_overlap",
    "icl_score",
    "icl_sequences",
    "over_checkpoints",
    "overlap",
    "persistence",
    "quantity",
    "read_step",
    "role_timelines",
    "tidy",
]
