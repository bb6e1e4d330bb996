"""Which EAP / EAP-IG path `edge_scores` / `find_circuit` take (`choose_path`), and its batching.

Two paths give the same scores (within float rounding): the default one (`eap.eap_chunk`) keeps
every upstream node's activation difference for the whole walk down the layers (about 2 L
residual-stream copies: 8.9x a plain forward's planned activations on SmolLM2, at any length);
the lean one (`eap_lean.eap_chunk_lean`) recomputes them block by block (1.9-2.3x) at about
`lean_work / default_work` times the CPU time (2.5-3x on SmolLM2's 30 layers; it grows with the
layers over the block).

`PATH = "auto"` (the default) takes the lean path when

* a `SweepOptions(max_memory=)` budget does not hold one pair of the default path's plan (the
  lean path is then planned within the budget, refused before any forward when one pair of it
  does not fit, naming that minimum), or
* with no budget: the default path's planned activations for one pair exceed `LEAN_RATIO` (2.5)
  times a plain forward's and exceed them by at least `LEAN_MIN_BYTES` (128 MiB: short prompts
  keep the faster path; SmolLM2 from 601 tokens on), and the lean path's estimated work is at
  most `LEAN_TIME` (5) times the default's (`work_ratio`: much deeper models keep the default
  path, e.g. EAP-IG with 5 points on 48 layers at block 2; on SmolLM2's 30 layers EAP and EAP-IG
  with up to 8 points go lean; measured on SmolLM2 at 1k tokens: EAP 2.5x, EAP-IG with 2 points
  about 3.6x the default path's CPU time).

The lean path's block (downstream layers held per sweep: each costs about `(H + 2 G) d / D + 4`
residual copies and saves sweeps) is the largest, up to `MAX_BLOCK`, whose plan fits the budget,
or without one stays within `LEAN_BLOCK_RATIO` (2) times a plain forward's planned activations
(block 2 on SmolLM2), at least 1. `with forced("lean")` / `forced("default")` (this thread)
or `PATH = "lean"` / `"default"` (every thread) force a path (a budget the forced default path
exceeds is refused).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from heads._util.validation import short_repr
from heads.engine.options import SweepOptions
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel

__all__ = [
    "LEAN_MIN_BYTES",
    "LEAN_RATIO",
    "LEAN_TIME",
    "PATH",
    "PATHS",
    "choose_path",
    "forced",
    "work_ratio",
]

PATHS = ("auto", "lean", "default")

PATH = "auto"
"""`"auto"` (`choose_path` decides), `"lean"` or `"default"` (forced), for every thread; `forced`
sets it for the calls inside a block of one thread."""

_FORCED: ContextVar[str | None] = ContextVar("heads_eap_path", default=None)


@contextmanager
def forced(path: str) -> Iterator[None]:
    """Within the block, this thread's `edge_scores` / `find_circuit` runs take `path`:
    `"lean"` (`eap_lean.eap_chunk_lean`), `"default"` (`eap.eap_chunk`) or `"auto"`
    (`choose_path`). E.g. `with forced("lean"): find_circuit(model, pairs)`.

    Raises:
        HeadsteerValueError: `path` not one of `PATHS` (before the block runs).
    """
    if path not in PATHS:
        raise HeadsteerValueError(f"path must be one of {PATHS}, got {short_repr(path)}")
    token = _FORCED.set(path)
    try:
        yield
    finally:
        _FORCED.reset(token)


LEAN_RATIO = 2.5
"""The default path is kept while its planned activations for one pair are within this many
times a plain forward's (issue 41's memory goal for gradient-based analyses)."""

LEAN_MIN_BYTES = 128 * 2**20
"""... or exceed a plain forward's by less than this (short prompts: a few MB either way, and
the default path is the faster one)."""

LEAN_TIME = 5.0
"""The most estimated work (`work_ratio`) the lean path may cost over the default one to be
taken without a budget (5: EAP-IG with the default 5 points on SmolLM2, 4.2, goes lean: on a
long prompt memory is what runs out, and the default path keeps 8.9x a forward's)."""

LEAN_BLOCK_RATIO = 2.0
"""Without a budget, the lean path's block is the largest whose planned activations stay within
this many times a plain forward's: block 2 on SmolLM2 (1.93x planned, 2.24x measured at 1k); the
plan undercounts larger blocks (block 3: 2.31x planned, 2.97x measured at 1k, over the 2.5x
goal)."""

MAX_BLOCK = 8
"""The largest block chosen (beyond it the sweeps are a small part of the work)."""

# The work of each part, in layer forwards (measured on SmolLM2 at 512 and 1,024 tokens, one
# thread): a layer's backward with its forward, one (upstream layer, downstream layer) pair's
# scoring on each path, a lean sweep's layer (attention half and MLP chunks).
_GRAD, _PAIR_DEFAULT, _PAIR_LEAN, _SWEEP = 3.0, 0.2, 0.4, 1.1


def _swept(n_layers: int, block: int) -> int:
    """Layer forwards of one swept run over a walk: each block sweeps the layers up to its top."""
    return sum(hi for hi in range(n_layers, 0, -block))


def work_ratio(n_layers: int, block: int, steps: int | None) -> float:
    """Estimated CPU work of the lean path over the default one (layer forwards: the recorded
    runs, the layers' backwards, the sweeps, the scoring of every pair of layers), for EAP
    (`steps` None) or EAP-IG with `steps` points."""
    L = n_layers
    pairs = L * (L + 1) // 2
    runs = 1 if steps is None else steps
    default = 2 * L + runs * (L + _GRAD * L + _PAIR_DEFAULT * pairs) + (runs - 1) * L
    sweeps = _SWEEP * _swept(L, block) * (3 * runs - 1)  # IG: a third run swept but in one walk
    lean = runs * (L + _GRAD * L + _PAIR_LEAN * pairs) + sweeps
    return lean / default


def _activations(model: HeadModel, request: object, tokens: int) -> int:
    from heads.planning import plan_memory

    return plan_memory(model, request, tokens, 1).devices[0].activations


def _lean_plan(block: int) -> object:
    from heads.planning import MemoryRequest

    return MemoryRequest("eap_lean", {"block": block})


def choose_path(
    model: HeadModel, budget: SweepOptions, tokens: int, method: str, steps: int | None
) -> tuple[int, bool, int | None]:
    """`(pairs per gradient chunk, lean, block)` of an `edge_scores` run of `method` on pairs of
    `tokens` tokens (module docstring): the default path with its rows within the budget's `"eap"`
    plan, or the lean path within its `"eap_lean"` plan at the chosen block (None: the default
    path). Refused before any forward when one pair does not fit the path taken."""
    if method == "exact":
        return budget.max_rows, False, None
    path = _FORCED.get() or PATH
    if path not in PATHS:
        raise HeadsteerValueError(f"eap_path.PATH must be one of {PATHS}, got {short_repr(path)}")
    L = model.n_layers
    if budget.max_memory is not None:
        if path != "lean":
            try:
                return budget.within(model, tokens, "eap").max_rows, False, None
            except HeadsteerValueError:
                if path == "default":
                    raise
        block = 1
        for b in range(2, min(MAX_BLOCK, L) + 1):
            try:
                budget.within(model, tokens, _lean_plan(b))
            except HeadsteerValueError:
                break
            block = b
        return budget.within(model, tokens, _lean_plan(block)).max_rows, True, block
    if path == "default":
        return budget.max_rows, False, None
    forward = _activations(model, "forward", tokens)
    if path == "auto":  # short prompts keep the default path: no block to plan
        default = _activations(model, "eap", tokens)
        if default <= LEAN_RATIO * forward or default - forward < LEAN_MIN_BYTES:
            return budget.max_rows, False, None
    block = 1
    for b in range(2, min(MAX_BLOCK, L) + 1):
        if _activations(model, _lean_plan(b), tokens) > LEAN_BLOCK_RATIO * forward:
            break
        block = b
    lean = path == "lean" or work_ratio(L, block, steps) <= LEAN_TIME
    return budget.max_rows, lean, block if lean else None
