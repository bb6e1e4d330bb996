"""What every backend is: the `Backend` base class and the `Placement` the engine installs.

A backend is built from the Hugging Face module, its model family and the object the user
handed over (a TransformerLens bridge, an nnsight model, or the module itself); it never sees
`HeadModel`. It says how a forward runs (`run`, `generate`) and where each engine site sits on
its model (`placements`): one `Placement` per hook (or attention switch, or layer-skip wrapper),
with a key under which the engine counts its users across contexts and threads
(`heads.engine.context`), so that a hook is installed once, shared, and removed when the last
context using it exits.

Adding a backend: one module under `heads/backends/` with a `Backend` subclass (`kind`,
`detect`, `placements`, and `run` / `generate` if forwards go elsewhere), and its name in
`heads.backends.core.REGISTRY`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from heads.engine.edits import Edit
from heads.errors import HeadsteerValueError
from heads.model.families import Family
from heads.model.parts import ModelParts

__all__ = ["Backend", "Placement"]


class Placement(NamedTuple):
    """One thing the engine installs on a model for the active edits.

    Attributes:
        key: identifies it across contexts and threads (e.g. `(id(module), "resid_post")`); two
            contexts needing the same key share one installation.
        install: installs it and returns the function that removes it. It may raise (e.g. a
            model whose attention backend cannot be switched): the engine then removes what
            it had installed for the context and re-raises, leaving the model as it was.
    """

    key: Hashable
    install: Callable[[], Callable[[], None]]


class Backend:
    """Base of the backends: how forwards run and where the engine's sites go.

    Args:
        module: the Hugging Face model (`PreTrainedModel`), inside a bridge or nnsight model the
            one they wrap.
        family: its `heads.model.families.Family` entry.
        native: the object the user handed over (bridge, nnsight model), or None for HF.
    """

    kind: ClassVar[str] = "base"
    attention_via_hooks: ClassVar[bool] = False
    """The backend computes attention itself: attention edits go on its hook points, the
    `transformers` attention function is not switched, and the fused kernel is unavailable."""
    never_fired_hint: ClassVar[str] = ""
    """Put first in an `EditNeverFired` message (what usually causes it on this backend)."""

    def __init__(self, module: nn.Module, family: Family, native: object | None = None, **options: Any):
        if options:
            raise HeadsteerValueError(f"the {self.kind} backend takes no options, got {sorted(options)}")
        self.module = module
        self.family = family
        self.parts = ModelParts(module, family)
        self._native = native

    @classmethod
    def detect(cls, obj: object) -> bool:
        """True when `obj` is a model this backend runs (the registry asks each in turn)."""
        return False

    @classmethod
    def unwrap(cls, obj: object) -> tuple[nn.Module, Any]:
        """`(Hugging Face module, tokenizer or None)` inside `obj` (a detected object)."""
        raise NotImplementedError

    def placements(self, active: Sequence[Edit]) -> list[Placement]:
        """What the engine installs for `active` (ValueError for a site this model lacks)."""
        raise NotImplementedError

    def skip_placements(self, layer: int) -> list[Placement]:
        """What `layer_skip` needs installed on blocks `0 .. layer - 1` (installed once, shared)."""
        raise NotImplementedError

    def layer_skip(self, layer: int, residual: torch.Tensor) -> contextlib.AbstractContextManager[None]:
        """Within the block, this thread's forwards skip blocks `< layer` and feed `residual` to it
        (`heads.engine.prefix.starting_at`); other threads run the whole model."""
        raise NotImplementedError

    def run(self, **inputs: Any) -> Any:
        """One forward of the model (the `transformers` output object)."""
        return self.module(**inputs)

    def generate(self, **inputs: Any) -> Any:
        """`transformers` `generate` (token ids, or the generate output object)."""
        return self.module.generate(**inputs)  # type: ignore[operator]

    def check(self) -> None:
        """Raise if the model can no longer be used as wrapped (checked by `editing`)."""

    @property
    def native(self) -> object | None:
        """The object the user handed over (bridge or nnsight model); None for HF."""
        return self._native
