"""ACT (Yu et al., ICML 2024): the attention-sink calibration and its head filtering."""

from steer.act.calibration import NOISE, ActCalibration, calibrate_act_heads, choice_ids
from steer.act.method import Act, ActEdit, calibrate_rows, default_act_layers

__all__ = [
    "NOISE",
    "Act",
    "ActCalibration",
    "ActEdit",
    "calibrate_act_heads",
    "calibrate_rows",
    "choice_ids",
    "default_act_layers",
]
