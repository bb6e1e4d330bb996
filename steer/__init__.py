"""Steering interventions and the `SteeredModel` inference wrapper.

Scorers that need a method's own edit live here beside the method: PASTA profiling
(`steer.profiling`: `profile_heads`, `select_heads`) and ACT head calibration
(`steer.act_calibration`). Read-only scorers are in `heads` (see its docstring).
"""

from .ablate import Ablate
from .act import Act, ActEdit
from .iti import Iti
from .model import Generation, Intervention, SteeredModel
from .pasta import Pasta, PastaBias, pasta_column_bias
from .profiling import profile_heads, select_heads, smallest_k
from .spans import UnsteeredRowsWarning
from .spotlight import Spotlight, SpotlightEdit
from .var import Var, VarEdit
from .vhd_trace import VhdTrace, vhd_trace
from .vhr import Vhr

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
    "UnsteeredRowsWarning",
    "Var",
    "VarEdit",
    "VhdTrace",
    "Vhr",
    "pasta_column_bias",
    "profile_heads",
    "select_heads",
    "smallest_k",
    "vhd_trace",
]
