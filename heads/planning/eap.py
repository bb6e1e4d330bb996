"""The EAP / EAP-IG memory models (`plan_memory(..., "eap" | "eap_lean")`): residual-stream copies
(`[B, T, D]` fp32) each path keeps beside a forward's own peak (docs/long-context.md)."""

from __future__ import annotations

import math

__all__ = [
    "CIRCUIT_NORM_CHUNK",
    "CIRCUIT_PATCH_MEMORY",
    "CIRCUIT_ROW_BYTES_PER_NODE",
    "EAP_GRAPH_COPIES",
    "EAP_LEAN_BLOCK",
    "EAP_LEAN_WORK_COPIES",
    "circuit_compact",
    "circuit_compact_streams",
    "circuit_diff_streams",
    "circuit_eval_bytes",
    "circuit_row_work_streams",
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


CIRCUIT_ROW_BYTES_PER_NODE = 8
"""Measured bytes per row, token, upstream node and model dimension of `find_circuit`'s exact
evaluations (the faithfulness curve, the circuit's faithfulness) while each row keeps every
upstream node's `[T, D]` fp32 difference: on SmolLM2-135M (U = 301 upstream nodes, D = 576), 51
random circuits on one pair of 15 tokens peaked 990 MB above the loaded model, 7.8 by this count
(the recorded clean and corrupted runs included)."""

CIRCUIT_PATCH_MEMORY = 512 * 2**20
"""Bytes one exact patched forward's upstream differences may take (`patched_metrics`): rows are
run in forwards that fit; when one row's full differences (`4 U D T`) pass it, the heads' are kept
as head outputs (`[T, H, d]` a layer) and projected by `W_O` when read (compact rows)."""


CIRCUIT_NORM_CHUNK = 4
"""Patched q / k / v inputs normalised at a time by an exact patched forward (`graph._NORM_CHUNK`)."""


def circuit_compact(g: dict[str, int], tokens: int) -> bool:
    """Whether one row at `tokens` tokens takes the compact differences (`CIRCUIT_PATCH_MEMORY`)."""
    upstream = 1 + g["n_layers"] * (g["n_heads"] + 1)
    return 4 * upstream * g["d_model"] * tokens > CIRCUIT_PATCH_MEMORY


def circuit_diff_streams(g: dict[str, int]) -> float:
    """fp32 residual streams (`[T, D]`) of upstream differences one compact row keeps at the most:
    the input's and every MLP's, and every layer's `[T, H, d]` head outputs (`H d / D` of a
    stream)."""
    return 1 + g["n_layers"] * (1 + g["n_heads"] * g["d_head"] / g["d_model"])


def circuit_row_work_streams(g: dict[str, int]) -> int:
    """fp32 residual streams of one exact patched row's working set beside its differences, as
    `patched_metrics` sizes a forward's rows (an upper bound of the measured set): one layer's
    H + 2 G patched inputs' deltas and their product with the differences (two each), one source
    layer's H projected heads, `CIRCUIT_NORM_CHUNK` normalised inputs with the norm's temporaries
    (three each) and the row's own forward (about 12)."""
    h, kv = g["n_heads"], g["n_kv_heads"]
    return 2 * (h + 2 * kv) + h + 3 * CIRCUIT_NORM_CHUNK + 12


def circuit_compact_streams(g: dict[str, int]) -> float:
    """fp32 residual streams (`[T, D]`) one compact row keeps: the input's and every MLP's
    differences, every layer's head outputs (`H d / D` of a stream), and the working set of one
    layer: its H + 2 G q / k / v inputs' deltas, one source layer's H projected heads, and the
    normalised copies of `CIRCUIT_NORM_CHUNK` inputs with the norm's temporaries (3 each). On
    SmolLM2 at 1,024 tokens: 97 streams planned, 97 measured."""
    h, kv = g["n_heads"], g["n_kv_heads"]
    return circuit_diff_streams(g) + (h + 2 * kv) + h + 3 * CIRCUIT_NORM_CHUNK


def circuit_eval_bytes(g: dict[str, int], tokens: int, rows: int = 1, itemsize: int = 4) -> int:
    """Bytes of `rows` rows of `find_circuit`'s exact evaluations at `tokens` tokens: the clean and
    corrupted runs' recorded activations (`4 L + 1` streams each in the model's dtype, `itemsize`
    bytes) plus, per row, `CIRCUIT_ROW_BYTES_PER_NODE x U x D x T` (U = 1 + L (H + 1) upstream
    nodes); where a row's full differences pass `CIRCUIT_PATCH_MEMORY` (long prompts), only the
    corrupted run's activations (the clean run keeps its logits) and the compact row's
    `4 x circuit_compact_streams x D x T`. Linear in the prompt either way. `g`: `plan.geometry`'s
    dict."""
    L, D = g["n_layers"], g["d_model"]
    upstream = 1 + L * (g["n_heads"] + 1)
    compact = circuit_compact(g, tokens)
    recorded = (1 if compact else 2) * (4 * L + 1) * D * tokens * itemsize
    if compact:
        row = 4 * circuit_compact_streams(g) * D * tokens
    else:
        row = CIRCUIT_ROW_BYTES_PER_NODE * upstream * D * tokens
    return int(recorded + row * rows)
