"""Head-specific visual modulation: dual-stream token selection and sensitivity-proportional
amplification of the attention on the selected tokens."""

from steer.visual_modulation.method import (
    ModulationBias,
    TokenSelection,
    VisualModulation,
    default_modulation_layers,
    local_scores,
    select_tokens,
)

__all__ = [
    "ModulationBias",
    "TokenSelection",
    "VisualModulation",
    "default_modulation_layers",
    "local_scores",
    "select_tokens",
]
