"""Steering interventions and the `SteeredModel` inference wrapper."""

from .ablate import Ablate
from .act import Act, ActEdit
from .iti import Iti
from .model import Generation, Intervention, SteeredModel
from .pasta import Pasta, PastaBias, pasta_column_bias
from .spotlight import Spotlight, SpotlightEdit

__all__ = [
    "Ablate",
    "Act",
    "ActEdit",
    "Generation",
    "Intervention",
    "Iti",
    "Pasta",
    "PastaBias",
    "SteeredModel",
    "Spotlight",
    "SpotlightEdit",
    "pasta_column_bias",
]
