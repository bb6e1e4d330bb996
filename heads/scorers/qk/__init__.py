"""Why a head attends where it does: QK attribution and head composition.

`qk_attribution` splits one head's attention logits into query-side x key-side component terms
(exact under the frozen-scale convention; `by="source_token"` follows upstream heads to the
tokens they read); `composition_scores` gives Elhage et al.'s Q-, K- and V-composition between
every pair of heads from the weights, and `data_composition_scores` its data-dependent
counterpart from the decomposition.
"""

from heads.scorers.qk.attribution import BY, qk_attribution, qk_attributions
from heads.scorers.qk.circuits import CircuitQK, circuit_qk
from heads.scorers.qk.composition import composition_scores, data_composition_scores
from heads.scorers.qk.family import ACCEPTED, check_qk_model

__all__ = [
    "ACCEPTED",
    "BY",
    "CircuitQK",
    "circuit_qk",
    "check_qk_model",
    "composition_scores",
    "data_composition_scores",
    "qk_attribution",
    "qk_attributions",
]
