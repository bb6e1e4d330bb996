"""Shared pieces of the patching tests: two IOI-style pairs and a copy of a model's weights."""

from __future__ import annotations

from typing import Any

import torch

from heads.scorers.patching.pairs import PromptPair

PAIRS = [
    PromptPair(
        "When Mary and John went to the store, John gave a drink to",
        "When Mary and John went to the store, Mary gave a drink to",
        " Mary",
        " John",
    ),
    PromptPair(
        "Then Anna and Tom left. Tom thanked", "Then Anna and Tom left. Anna thanked", " Anna", " Tom"
    ),
]


def state_copy(model: Any) -> dict[str, torch.Tensor]:
    """A clone of every tensor of `model.model.state_dict()` (to check a sweep restores it bitwise)."""
    return {k: v.clone() for k, v in model.model.state_dict().items()}
