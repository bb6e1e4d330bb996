"""Every head's attention pattern on one prompt, from one forward, kept per browser tab.

A click on a head in the explorer draws that head's pattern. Running the model per click costs
a full forward; instead the first request for a prompt records all layers' patterns in one
forward (`all_patterns`) and `PatternCache` keeps them, keyed by (tab id, prompt), within a
byte budget (least recently used dropped first), so later clicks on that prompt only read.
"""

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Recorder
from heads.engine.forward import forward
from heads.inputs.prompts import encode_prompts
from heads.inputs.tokens import readable_tokens
from heads.model.adapter import HeadModel

__all__ = ["PatternCache", "Patterns", "Stopped", "all_patterns", "pattern_bytes"]


class Stopped(Exception):
    """`all_patterns` was stopped by its `stop` event (the explorer's job was cancelled)."""


@dataclass(frozen=True)
class Patterns:
    """All heads' patterns on one prompt.

    Attributes:
        probs: fp16 `[L, H, T, T]` post-softmax patterns (query rows, key columns); fp16 keeps
            each value within 2.5e-4 of the fp32 pattern (values are in [0, 1]).
        tokens: the T tokens as readable text (`heads.inputs.tokens.readable_tokens`).
        spans: the `**…**` span token ranges `(start, end)`.
    """

    probs: torch.Tensor
    tokens: list[str]
    spans: list[tuple[int, int]]

    @property
    def nbytes(self) -> int:
        return self.probs.numel() * self.probs.element_size()


def pattern_bytes(n_layers: int, n_heads: int, n_tokens: int) -> int:
    """Bytes of the fp16 `[L, H, T, T]` patterns of a prompt of `n_tokens` tokens."""
    return 2 * n_layers * n_heads * n_tokens * n_tokens


def all_patterns(
    model: HeadModel, prompt: str, *, chat: bool | None = None, stop: threading.Event | None = None
) -> Patterns:
    """Every layer's `[H, T, T]` pattern of `prompt` from one forward (the model's own attention:
    the recorders only read).

    Args:
        chat: apply the chat template (default: when the tokenizer has one, as `encode_prompts`).
        stop: an event that, once set, stops the forward at the next layer (`Stopped`).

    Raises:
        ValueError: what `encode_prompts` raises on a bad prompt.
        Stopped: `stop` was set.
    """
    enc = encode_prompts(model.tokenizer, prompt, chat=chat)

    def keep(probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        if stop is not None and stop.is_set():
            raise Stopped
        return probs[0].detach().to(torch.float16).cpu()  # [H, q, K]

    recorders = [Recorder(layer=layer, fn=keep) for layer in range(model.n_layers)]
    with editing(model, recorders):
        forward(model, enc)
    probs = torch.stack([torch.cat(rec.records, dim=1) for rec in recorders])  # [L, H, T, T]
    tokens = readable_tokens(model.tokenizer, enc.input_ids[0])
    return Patterns(probs, tokens, list(enc.spans[0]))


class _Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


P = TypeVar("P", bound=_Sized)


class PatternCache(Generic[P]):
    """`Patterns` (or a long prompt's `viz.explorer.overview.Overview`) per (tab, prompt), least
    recently used dropped once over `budget` bytes (the explorer's defaults:
    `viz.explorer.app.PATTERN_CACHE_BYTES`, `viz.explorer.limits.OVERVIEW_CACHE_BYTES`).

    Thread-safe. A prompt whose patterns alone exceed the budget is not cached (`fits` is
    False for it: the caller computes the one head it needs instead)."""

    def __init__(self, budget: int):
        self.budget = budget
        self._items: OrderedDict[tuple[str, str, bool], P] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, tab: str, prompt: str, *, chat: bool = True) -> P | None:
        """The patterns of `prompt` (rendered with the chat template or not) for `tab`, or None."""
        key = (tab, prompt, chat)
        with self._lock:
            got = self._items.get(key)
            if got is not None:
                self._items.move_to_end(key)
            return got

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.budget

    def put(self, tab: str, prompt: str, patterns: P, *, chat: bool = True) -> None:
        if not self.fits(patterns.nbytes):
            return
        key = (tab, prompt, chat)
        with self._lock:
            self._items.pop(key, None)
            self._items[key] = patterns
            while self.nbytes() > self.budget:
                self._items.popitem(last=False)

    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._items.values())

    def __len__(self) -> int:
        return len(self._items)
