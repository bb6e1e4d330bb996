"""The EAP / EAP-IG memory models (`plan_memory(..., "eap" | "eap_lean")`): residual-stream copies
(`[B, T, D]` fp32) each path keeps beside a forward's own peak (docs/long-context.md)."""

from __future__ import annotations

import math

__all__ = [
    "CIRCUIT_ROW_BYTES_PER_NODE",
    "EAP_GRAPH_COPIES",
    "EAP_LEAN_BLOCK",
    "EAP_LEAN_WORK_COPIES",
    "circuit_eval_bytes",
    "eap_copies",
]

EAP_GRAPH_COPIES = 10
"""Residual-stream copies (`[B, T, D]` fp32) one layer's graph with gradients holds beyond a plain
forward's own peak (EAP's default path; SmolLM2 at 1,024 tokens: planned 255 MB, measured 243 MB
of RSS; random 4-12-layer models: within 7% of the live bytes, tests/heads/test_planning.py)."""

EAP_LEAN_WORK_COPIES = 1
"""... the lean path's working set beside the block it keeps and the forward's own peak: its
sweeps run a layer's MLP in position chunks, so their peak is at the attention half, below a
forward's (random 4-6-layer models: within 10% of the live bytes, EAP and EAP-IG; SmolLM2 at 512
tokens: 11.3 copies planned, 11.2 counted; tests/heads/test_planning.py)."""

EAP_LEAN_BLOCK = 2
"""Downstream layers per sweep of the lean path when none is asked for (`eap_lean.BLOCK`; the
`"eap_lean"` plan's `block` parameter)."""


def eap_copies(analysis: str, g: dict[str, int], n_layers: int, block: int = EAP_LEAN_BLOCK) -> float:
    """Residual-stream copies (`[B, T, D]` fp32) EAP keeps beside a forward: default,
    `2 n + L / every + every + (H + 2 G + 1) + EAP_GRAPH_COPIES` (`n` the device's layers,
    `every ~ sqrt(L)`); lean, `block ((H + 2 G) d / D + 3) + 1 + EAP_LEAN_WORK_COPIES` (per layer
    of the block its input, its compact gradients and the next block's input; the gradient
    reaching the block). `g`: `plan.geometry`'s dict."""
    L, h, kv, d, D = g["n_layers"], g["n_heads"], g["n_kv_heads"], g["d_head"], g["d_model"]
    if analysis == "eap":
        every = max(1, round(math.sqrt(L)))
        return 2 * n_layers + math.ceil(L / every) + every + (h + 2 * kv + 1) + EAP_GRAPH_COPIES
    return block * ((h + 2 * kv) * d / D + 3) + 1 + EAP_LEAN_WORK_COPIES


CIRCUIT_ROW_BYTES_PER_NODE = 28
"""Measured bytes per row, token, upstream node and model dimension of `find_circuit`'s exact
evaluations (the faithfulness curve, the circuit's faithfulness): about seven fp32 `[U, D]`
tensors per row and token. On SmolLM2-135M (U = 301 upstream nodes, D = 576, IOI pairs of 15
tokens) `report circuit` peaked 70 MB per row above the loaded model (51 rows: +3.4 GiB; 12
rows: +0.8 GiB), 73 MB by this constant."""


def circuit_eval_bytes(g: dict[str, int], tokens: int, rows: int = 1) -> int:
    """Bytes of `rows` rows of `find_circuit`'s exact evaluations at `tokens` tokens:
    `CIRCUIT_ROW_BYTES_PER_NODE x U x D x T` a row, U = 1 + L (H + 1) upstream nodes (the input,
    every head, every MLP). Quadratic in nothing, but U times a residual stream: 4.7 GB for one
    pair of 977 tokens on SmolLM2. `g`: `plan.geometry`'s dict."""
    upstream = 1 + g["n_layers"] * (g["n_heads"] + 1)
    return int(CIRCUIT_ROW_BYTES_PER_NODE * upstream * g["d_model"] * tokens * rows)
