"""VHR (vision-aware head reinforcement) and its per-token VHD trace."""

from steer.vhr.method import (
    VhdProbe,
    Vhr,
    VhrSelection,
    default_vhr_layers,
    measure_vhd,
    no_span_rows,
    probe_inputs,
    select_heads_vhd,
    t_vhd,
)
from steer.vhr.trace import VhdTrace, vhd_trace

__all__ = [
    "VhdProbe",
    "VhdTrace",
    "Vhr",
    "VhrSelection",
    "default_vhr_layers",
    "measure_vhd",
    "no_span_rows",
    "probe_inputs",
    "select_heads_vhd",
    "t_vhd",
    "vhd_trace",
]
