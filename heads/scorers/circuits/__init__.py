"""Circuit discovery over heads, MLPs, the input and the logits.

`graph` (nodes, edges into each head's q / k / v, the decomposed forward by hooks), `scores`
(EAP, EAP-IG, exact edge patching) and `circuit` (selection with pruning, exact
faithfulness, the faithfulness curve with MIB's CPR / CMD, the `Circuit` result). Sources:
Syed et al. 2024 (EAP), Hanna et al. 2024 (EAP-IG, faithfulness), Conmy et al. 2023 (ACDC),
Mueller et al. 2025 (MIB).

    pairs = encode_pairs(model, load_task_pairs("ioi"))
    circuit = find_circuit(model, pairs, method="eap-ig", size=5)   # top 5 % of the edges
    circuit.curve["cpr"], circuit.heads, circuit.to_frame()
"""

from heads.scorers.circuits.circuit import (
    DEFAULT_FAITHFULNESS,
    SIZES,
    Circuit,
    areas,
    evaluate,
    faithfulness_curve,
    find_circuit,
    prune,
    select,
    size_for_faithfulness,
    warn_most_heads,
)
from heads.scorers.circuits.graph import Graph, check_family, graph_of
from heads.scorers.circuits.scores import MAX_STEPS, METHODS, EdgeScores, edge_scores, exact_scores

__all__ = [
    "DEFAULT_FAITHFULNESS",
    "MAX_STEPS",
    "METHODS",
    "SIZES",
    "Circuit",
    "EdgeScores",
    "Graph",
    "areas",
    "check_family",
    "edge_scores",
    "evaluate",
    "exact_scores",
    "faithfulness_curve",
    "find_circuit",
    "graph_of",
    "prune",
    "select",
    "size_for_faithfulness",
    "warn_most_heads",
]
