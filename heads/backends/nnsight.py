"""The nnsight backend: the Hugging Face model runs unchanged inside nnsight's `trace()` /
`generate()`, with the Hugging Face backend's placements (`heads.backends.hf`): headsteer's
attention function and hooks are part of each module's computation, so a user's interventions in
the same trace (`HeadModel.trace`) read and modify the edited values. `remote=True` forwards every
trace to NDIF; edits cannot run there (the remote server has no headsteer attention function or
hooks), so steering with `remote=True` is refused with a `ValueError`.

nnsight keeps one tracing state per model: two threads tracing at once corrupt each other's
trace, so forwards on one model are serialised (an `RLock`); HF and TransformerLens run them
concurrently.
"""

from __future__ import annotations

import threading
from functools import cache
from typing import Any, ClassVar, cast

from torch import nn

from heads._util.validation import check_bool
from heads.backends.hf import HFBackend
from heads.engine.state import active_edit_count
from heads.errors import HeadsteerValueError
from heads.model.families import Family

__all__ = ["NNsightBackend"]


class NNsightBackend(HFBackend):
    """Forwards inside an nnsight `trace()` / `generate()`; `remote=True` sends them to NDIF."""

    kind: ClassVar[str] = "nnsight"
    never_fired_hint: ClassVar[str] = (
        "on the nnsight backend, enter editing() outside trace() (the trace body runs apart); "
    )

    def __init__(
        self, module: nn.Module, family: Family, native: object | None = None, *, remote: bool = False
    ) -> None:
        check_bool("remote", remote, what="a bool")
        super().__init__(module, family, native)
        self.lm: Any = native
        self.remote = remote
        self._lock = threading.RLock()

    @classmethod
    def detect(cls, obj: object) -> bool:
        return type(obj).__module__.startswith("nnsight") and isinstance(
            getattr(obj, "_module", None), nn.Module
        )

    @classmethod
    def unwrap(cls, obj: object) -> tuple[nn.Module, Any]:
        lm: Any = obj
        return lm._module, getattr(lm, "tokenizer", None)

    def _check_remote(self) -> None:
        if self.remote and active_edit_count():
            raise HeadsteerValueError(
                "nnsight remote=True runs the model on NDIF, where headsteer's attention function and "
                "hooks do not exist: steering edits cannot run remotely (use remote=False, or only your "
                "own nnsight interventions)"
            )

    def run(self, **inputs: Any) -> Any:
        self._check_remote()
        with self._lock, self.lm.trace(**inputs, remote=self.remote):
            out = self.lm.output.save()
        return out

    def generate(self, **inputs: Any) -> Any:
        self._check_remote()
        # `tracer.result` is what `generate` returned (nnsight 0.8: `lm.generator.output` is deprecated)
        with self._lock, self.lm.generate(**inputs, remote=self.remote) as tracer:
            out = tracer.result.save()
        return out

    def trace(self, *inputs: Any, **kwargs: Any) -> Any:
        """The user's own `lm.trace(...)` tracer (with `remote` unless given), to enter with `with`.

        Its `with` block holds the model's engine lock, like `run` and `generate`: a second
        thread's trace (or headsteer forward) on this model waits until the block has run.
        """
        self._check_remote()
        kwargs.setdefault("remote", self.remote)
        tracer = self.lm.trace(*inputs, **kwargs)
        tracer.__class__ = _locked_tracer_class(cast(Any, type(tracer)))
        tracer._headsteer_lock = self._lock
        return tracer


@cache
def _locked_tracer_class(base: Any) -> type:
    """`base` (an nnsight tracer class) whose `with` block runs under `self._headsteer_lock`.

    nnsight finds the user's `with` block two frames above the function that reads it
    (`Tracer.capture`, `skip_context`), so `__enter__` calls them itself, exactly as
    `Tracer.__enter__` does, rather than through `super().__enter__()` (one frame deeper).
    """
    from nnsight.tracing.tracer import skip_context, skippable

    def __enter__(self: Any) -> Any:  # noqa: N807 - the context-manager protocol
        self._headsteer_lock.acquire()
        try:
            self.capture()
            if skippable(self.node):
                skip_context(self)
        except BaseException:
            self._headsteer_lock.release()
            raise
        return self

    def __exit__(self: Any, *exc: Any) -> Any:  # noqa: N807
        try:
            return base.__exit__(self, *exc)
        finally:
            self._headsteer_lock.release()

    return type(f"Locked{base.__name__}", (base,), {"__enter__": __enter__, "__exit__": __exit__})
