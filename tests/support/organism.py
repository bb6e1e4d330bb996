"""Tiny organism runs for the training-dynamics tests (seconds on CPU, a few MB on disk)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from probes.organism.recipe import OrganismSpec, train_organism

TINY_SPEC = OrganismSpec(
    name="tiny",
    n_layers=2,
    n_heads=2,
    d_model=32,
    vocab_size=256,
    context=32,
    steps=4,
    batch=2,
    warmup=1,
    checkpoint_every=2,
    seed=0,
)
"""A 2-layer attention-only run of 4 steps: checkpoints at steps 0, 1, 2, 4."""


def tiny_run(folder: str | Path, **changes) -> Path:
    """Train `TINY_SPEC` (with `changes`) into `folder`; returns it."""
    train_organism(replace(TINY_SPEC, **changes), folder)
    return Path(folder)
