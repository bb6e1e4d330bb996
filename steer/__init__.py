"""Steering interventions and the `SteeredModel` inference wrapper.

Scorers that need a method's own edit live here beside the method: PASTA profiling
(`steer.pasta.profiling`: `profile_heads`, `select_heads`) and ACT head calibration
(`steer.act.calibration`). Read-only scorers are in `heads` (see its docstring).
"""

from steer.ablate import Ablate
from steer.act.method import Act, ActEdit
from steer.adaptvis import AdaptVis, AdaptVisScale, ScalingVis
from steer.caa import Caa, CaaAdd, caa_vector, load_caa_vectors, save_caa_vectors
from steer.carve import Carve, CarveMaps
from steer.head_gates import HeadGates
from steer.instaboost import InstaBoost, InstaBoostBias
from steer.iti import Iti
from steer.knockout import Knockout, KnockoutBias
from steer.pasta.method import Pasta, PastaBias, pasta_column_bias
from steer.pasta.profiling import profile_heads, select_heads, smallest_k
from steer.pattern_injection import PatternEdit, PatternInjection
from steer.span_rows import UnsteeredRowsWarning
from steer.spotlight import Spotlight, SpotlightEdit
from steer.steered_model import Generation, Intervention, SteeredModel
from steer.var import Var, VarEdit
from steer.vhr.method import Vhr
from steer.vhr.trace import VhdTrace, vhd_trace
from steer.visual_modulation import ModulationBias, VisualModulation

__all__ = [
    "Ablate",
    "Act",
    "ActEdit",
    "Caa",
    "CaaAdd",
    "Carve",
    "CarveMaps",
    "Generation",
    "HeadGates",
    "InstaBoost",
    "InstaBoostBias",
    "Intervention",
    "Iti",
    "Knockout",
    "KnockoutBias",
    "ModulationBias",
    "Pasta",
    "PastaBias",
    "PatternEdit",
    "PatternInjection",
    "SteeredModel",
    "Spotlight",
    "SpotlightEdit",
    "UnsteeredRowsWarning",
    "Var",
    "VarEdit",
    "VhdTrace",
    "Vhr",
    "VisualModulation",
    "caa_vector",
    "load_caa_vectors",
    "save_caa_vectors",
    "pasta_column_bias",
    "profile_heads",
    "select_heads",
    "smallest_k",
    "vhd_trace",
    "AdaptVis",
    "AdaptVisScale",
    "ScalingVis",
]
