"""The EAP / EAP-IG memory models (`plan_memory(..., "eap" | "eap_lean")`): residual-stream copies
(`[B, T, D]` fp32) each path keeps beside a forward's own peak (docs/long-context.md)."""

from __future__ import annotations

import math

__all__ = ["EAP_GRAPH_COPIES", "EAP_LEAN_BLOCK", "EAP_LEAN_WORK_COPIES", "eap_copies"]

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
