"""The engine's shared state, a leaf module: which edits are active (per thread and context), the
chosen kernel, the reference counts of what the backends installed (hooks, attention switches,
layer-skip wrappers), and the constants
every kernel reads. It imports only the edits, so backends and kernels can use it without cycles."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from heads._util.validation import short_repr
from heads.engine.edits import (
    AttentionCall,
    Edit,
    HeadOutputEdit,
    QueryEdit,
)
from heads.errors import HeadsteerTypeError, HeadsteerValueError

__all__ = [
    "ACTIVE",
    "BIAS_BLOCK_ELEMENTS",
    "BIAS_BLOCK_MIN_ROWS",
    "FUSED_MIN_ROWS_CPU",
    "INSTALLED",
    "KERNEL",
    "KERNELS",
    "LOCK",
    "MIN_LOGIT",
    "OFFSETS",
    "QUERY_BLOCK",
    "READ_BLOCK_ELEMENTS",
    "READ_BLOCK_ROW_HEADS",
    "LayerEdits",
    "acquire",
    "active_edit_count",
    "apply_head_edits",
    "bias_block_rows",
    "cast_result",
    "read_block_rows",
    "release",
]

QUERY_BLOCK = 1024
"""Query rows per block in edited layers (memory is O(QUERY_BLOCK x keys) per head)."""


READ_BLOCK_ROW_HEADS = 512
"""A layer whose pattern edits only read the pattern (recorders, the analyses' reductions) computes
it in blocks of `read_block_rows` query rows: at least this many (batch row x head x query row)
triples per block, so a block is `[B, H, rows, K]` with `B * H * rows` about 512 and the reading
costs memory linear in the keys K (about 12% of a plain SDPA prefill on SmolLM2 at any length)."""


READ_BLOCK_ELEMENTS = 2**19
"""... and at least this many pattern entries per block (2 MiB in fp32), so short prompts are not
cut into many tiny blocks."""


def read_block_rows(batch: int, n_heads: int, k_len: int) -> int:
    """Query rows per block when a layer's pattern is only read (see `READ_BLOCK_ROW_HEADS`):
    `max(READ_BLOCK_ROW_HEADS // (B H), READ_BLOCK_ELEMENTS // (B H K))`, within 1..`QUERY_BLOCK`."""
    bh = max(1, batch * n_heads)
    rows = max(READ_BLOCK_ROW_HEADS // bh, READ_BLOCK_ELEMENTS // (bh * max(1, k_len)))
    return max(1, min(QUERY_BLOCK, rows))


BIAS_BLOCK_ELEMENTS = 2**19
"""The blocked kernel's SDPA path for logit biases (PASTA, attention knockout below
`FUSED_MIN_ROWS_CPU` rows) hands SDPA one fp32 additive mask per block of `bias_block_rows`
query rows, `[B, 1, rows, K]` for a bias shared by its heads: about this many entries (2 MiB),
so its few mask-sized tensors stay small beside a forward's own peak (at 1,024 tokens a
`[1, 1, 1024, 1024]` block per tensor, with indexed copies of the query, key and value, was
1.47x a plain forward's peak on SmolLM2; 512-row blocks give 0.99x)."""


BIAS_BLOCK_MIN_ROWS = 512
"""... and at least this many rows per block: CPU SDPA with a mask is about 2.3x slower per layer
in blocks of 256 rows than of 512 or 1,024 (SmolLM2's 9 heads at 1,024 tokens)."""


def bias_block_rows(batch: int, k_len: int) -> int:
    """Query rows per block on the blocked kernel's biased-SDPA path: `BIAS_BLOCK_ELEMENTS // (B K)`,
    at least `BIAS_BLOCK_MIN_ROWS`, at most `QUERY_BLOCK`."""
    rows = BIAS_BLOCK_ELEMENTS // max(1, batch * k_len)
    return max(1, min(QUERY_BLOCK, max(BIAS_BLOCK_MIN_ROWS, rows)))


KERNELS = ("auto", "fused", "blocked")
"""Values of `editing(..., kernel=)`."""


FUSED_MIN_ROWS_CPU = 2048
"""`kernel="auto"` on CPU runs the fused kernel for calls with at least this many query rows
(long prefills), and for any call of more than `QUERY_BLOCK` rows in a layer with a span-share
edit (SpotLight at layer / head granularity pools the whole prefill, which the blocked path
would split into query blocks); shorter calls and decoding stay on the blocked path, whose cost
has no compile step (README, "Kernels"). On CUDA, auto runs the fused kernel for every call of
two or more rows."""


MIN_LOGIT = torch.finfo(torch.float32).min


@dataclass
class LayerEdits:
    layer: int
    n_heads: int
    window: int | None = None  # sliding-window size of the layer, if any
    sites: dict[str, list[Edit]] = field(default_factory=dict)

    def get(self, site: str) -> list[Edit]:
        return self.sites.get(site, [])


# id(attention module) -> its edits; a ContextVar so threads do not see each other's edits.
ACTIVE: ContextVar[dict[int, LayerEdits]] = ContextVar("headsteer_active_edits", default={})  # noqa: B039


KERNEL: ContextVar[str] = ContextVar("headsteer_kernel", default="auto")


# id(attention module) -> cached keys before the current call (its first absolute position).
OFFSETS: ContextVar[dict[int, int]] = ContextVar("headsteer_call_offsets", default={})  # noqa: B039


# Shared model state, reference-counted across contexts and threads: placement key (a backend's
# `Placement.key`: a hook, an attention switch, a layer-skip wrapper) -> [count, remover].
LOCK = threading.Lock()


INSTALLED: dict[Hashable, list] = {}


def acquire(placements: Sequence[tuple[Hashable, Callable[[], Callable[[], None]]]]) -> list[Hashable]:
    """Install each `(key, install)` not yet installed, count one more user of each; returns the
    keys to hand to `release`. If an install raises, what this call installed is removed again
    (and the counts restored) before the error propagates: the model is left as it was."""
    done: list[Hashable] = []
    with LOCK:
        try:
            for key, install in placements:
                if key in done:
                    continue
                slot = INSTALLED.get(key)
                if slot is None:
                    slot = INSTALLED[key] = [0, install()]
                slot[0] += 1
                done.append(key)
        except BaseException:
            _release(done)
            raise
    return done


def release(keys: Sequence[Hashable]) -> None:
    """One user fewer of each key; the last user's release removes it (in reverse order)."""
    with LOCK:
        _release(keys)


def _release(keys: Sequence[Hashable]) -> None:
    for key in reversed(keys):
        slot = INSTALLED.get(key)
        if slot is None:
            continue
        slot[0] -= 1
        if slot[0] == 0:
            del INSTALLED[key]
            slot[1]()


def apply_head_edits(
    edits: Sequence[QueryEdit | HeadOutputEdit], z: torch.Tensor, call: AttentionCall
) -> torch.Tensor:
    """Apply per-head edits to `z` `[B, T, H, d]` (each only on its (row, head) pairs).

    An edit that does not act on this call (`Edit.acts_on`, e.g. positions outside it) is
    skipped and not counted as fired. What an edit returns is cast to `z`'s dtype and device
    (a user's edit may add an fp32 or CPU tensor to a bf16 / GPU model).

    Raises:
        HeadsteerTypeError: an edit that returns something other than a tensor.
        HeadsteerValueError: an edit whose result does not have `z`'s shape.
    """
    for e in edits:
        if not e.acts_on(call):
            continue
        e.calls += 1
        mask = e.head_mask(z.shape[0], z.shape[2], z.device)[:, None, :, None]
        z = torch.where(mask, cast_result(e, e.apply(z, call), z), z)
    return z


def cast_result(edit: Edit, new: object, like: torch.Tensor) -> torch.Tensor:
    """`new` (what `edit` returned for `like`) in `like`'s dtype and device and with its shape."""
    if not isinstance(new, torch.Tensor):
        raise HeadsteerTypeError(f"{short_repr(edit)} returned {type(new).__name__}, not a torch.Tensor")
    if new.shape != like.shape:
        raise HeadsteerValueError(
            f"{short_repr(edit)} returned shape {tuple(new.shape)}; it must return the shape it was given, "
            f"{tuple(like.shape)}"
        )
    return new.to(device=like.device, dtype=like.dtype)


def active_edit_count() -> int:
    """How many edits the calling context has active (on any model)."""
    return sum(len(x) for v in ACTIVE.get().values() for x in v.sites.values())
