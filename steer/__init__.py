"""Steering interventions and the `SteeredModel` inference wrapper."""

from .ablate import Ablate
from .act import Act, ActEdit
from .model import Generation, Intervention, SteeredModel
from .pasta import Pasta, PastaBias, pasta_column_bias
from .spans import UnsteeredRowsWarning
from .spotlight import Spotlight, SpotlightEdit

__all__ = [
    "Ablate",
    "Act",
    "ActEdit",
    "Generation",
    "Intervention",
    "Pasta",
    "PastaBias",
    "SteeredModel",
    "Spotlight",
    "SpotlightEdit",
    "UnsteeredRowsWarning",
    "pasta_column_bias",
]
