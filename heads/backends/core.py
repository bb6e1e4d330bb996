"""Backends: the library a `HeadModel`'s forwards run through (Hugging Face, TransformerLens, nnsight).

A TransformerLens `TransformerBridge` (TransformerLens 4.x) and an nnsight model
(`TransformersModel`, or its older name `LanguageModel`) both wrap a real `transformers` model.
headsteer keeps one `HeadModel` over that model and a small backend object that says how a
forward runs and where edits go:

* `"hf"` — the base: forwards call the model; attention edits run in headsteer's attention
  function (`AttentionInterface` + mask function), head-output edits in `o_proj` pre-hooks.
* `"transformer_lens"` — booting a bridge rewires the HF model in place: its layers, attention
  and projections become bridge components carrying TransformerLens hook points, and the bridge
  computes attention itself (the HF attention function is never called). Forwards run through
  that rewired module tree (every bridge hook point fires, the user's hooks included), and
  headsteer's edits are hooks on the bridge's hook points (`heads.backends.transformer_lens`): queries at
  `hook_rot_q` (`hook_q` for a family without rotary embeddings), logit biases at
  `hook_attn_scores`, pattern edits at `hook_pattern`, head-output edits at `hook_z`, residual
  edits at `hook_resid_pre`. Weight processing (`process_weights`: LayerNorm folding, centering)
  must be off: a processed bridge is refused, because folded weights are not the model's own.
* `"nnsight"` — the HF model runs unchanged inside nnsight's `trace()` / `generate()`; headsteer's
  attention function and hooks are part of each module's computation, so a user's interventions in
  the same trace (`HeadModel.trace`) read and modify the edited values. `remote=True` forwards
  every trace to NDIF; edits cannot run there (the remote server has no headsteer attention
  function), so steering with `remote=True` is refused with a `ValueError`.

Both libraries are imported lazily: `import heads` does not load them.
"""

from __future__ import annotations

import os
import threading
from functools import cache
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from heads._util.validation import check_bool
from heads.errors import HeadsteerTypeError, HeadsteerValueError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from heads.engine.edits import Edit
    from heads.engine.sites import HookSpec
    from heads.model.adapter import HeadModel

__all__ = ["BACKENDS", "Backend", "NNsightBackend", "TransformerLensBackend", "backend_kind", "make_backend"]

BACKENDS = ("hf", "transformer_lens", "nnsight")
"""Names accepted by `load_model(..., backend=)`."""


def _is_bridge(obj: object) -> bool:
    return type(obj).__module__.startswith("transformer_lens") and hasattr(obj, "original_model")


def _is_nnsight(obj: object) -> bool:
    return type(obj).__module__.startswith("nnsight") and isinstance(getattr(obj, "_module", None), nn.Module)


def backend_kind(obj: object) -> str | None:
    """`"transformer_lens"`, `"nnsight"` or `"hf"` for a bridge, an nnsight model or a HF model; else None."""
    if _is_bridge(obj):
        return "transformer_lens"
    if _is_nnsight(obj):
        return "nnsight"
    if isinstance(obj, nn.Module) and hasattr(obj, "config"):
        return "hf"
    return None


class Backend:
    """The Hugging Face backend: forwards and `generate` call the model itself."""

    kind = "hf"
    attention_via_hooks = False
    """The backend computes attention itself: attention edits go on its hook points, the
    `transformers` attention function is not switched, and the fused kernel is unavailable."""
    never_fired_hint = ""
    """Put first in an `EditNeverFired` message (what usually causes it on this backend)."""

    def hook_specs(self, hm: HeadModel, active: Sequence[Edit]) -> list[HookSpec]:
        """The hooks the active edits need on this backend (placed by `heads.engine.context`)."""
        from heads.engine.sites import hf_hook_specs

        return hf_hook_specs(hm, active)

    def run(self, hm: HeadModel, **inputs: Any) -> Any:
        """One forward of `hm`'s model (the `transformers` output object)."""
        return hm.model(**inputs)

    def check(self) -> None:
        """Raise if the backend's model can no longer be used as wrapped (checked by `editing`)."""

    def generate(self, hm: HeadModel, **inputs: Any) -> Any:
        """`transformers` `generate` (token ids, or the generate output object)."""
        return hm.model.generate(**inputs)  # type: ignore[operator]

    @property
    def native(self) -> object | None:
        """The object the user handed over (bridge or nnsight model); None for HF."""
        return None


class TransformerLensBackend(Backend):
    """Forwards through a `TransformerBridge`'s rewired module tree; edits on its hook points."""

    kind = "transformer_lens"
    attention_via_hooks = True

    def hook_specs(self, hm: HeadModel, active: Sequence[Edit]) -> list[HookSpec]:
        from heads.backends.transformer_lens import tl_hook_specs

        return tl_hook_specs(hm, active)

    def __init__(self, bridge: Any):
        self.bridge = bridge
        self.check()

    @property
    def native(self) -> object:
        return self.bridge

    def check(self) -> None:
        """ValueError once the bridge's weights were processed (LayerNorm folding, centering)."""
        if getattr(self.bridge, "_weights_processed", False):
            raise HeadsteerValueError(
                "this TransformerBridge has processed weights (process_weights(): LayerNorm folding / "
                "centering), so its weights and logits are no longer the model's own; boot it without "
                "process_weights() to use it with headsteer"
            )

    def run(self, hm: HeadModel, **inputs: Any) -> Any:
        self.check()
        return super().run(hm, **inputs)

    def generate(self, hm: HeadModel, **inputs: Any) -> Any:
        self.check()
        return super().generate(hm, **inputs)

    def hook_point(self, layer: int, name: str) -> nn.Module:
        """The bridge's hook point `blocks.{layer}.<name>` (e.g. `attn.hook_pattern`).

        Raises:
            ValueError: the bridge has no such hook point (the edit needing it cannot run on
                this backend).
        """
        obj: Any = self.bridge.blocks[layer]
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if not isinstance(obj, nn.Module) or not hasattr(obj, "add_hook"):
            raise HeadsteerValueError(
                f"the TransformerLens bridge has no hook point blocks.{layer}.{name}; this edit cannot run "
                "on the transformer_lens backend for this model"
            )
        return obj


class NNsightBackend(Backend):
    """Forwards inside an nnsight `trace()` / `generate()`; `remote=True` sends them to NDIF."""

    kind = "nnsight"
    never_fired_hint = "on the nnsight backend, enter editing() outside trace() (the trace body runs apart); "

    def __init__(self, lm: Any, remote: bool = False):
        check_bool("remote", remote, what="a bool")
        self.lm = lm
        self.remote = remote
        # nnsight keeps one tracing state per model: two threads tracing at once corrupt each
        # other's trace, so forwards are serialised (HF and TransformerLens run them concurrently).
        self._lock = threading.RLock()

    @property
    def native(self) -> object:
        return self.lm

    def _check_remote(self) -> None:
        from heads.engine.state import active_edit_count

        if self.remote and active_edit_count():
            raise HeadsteerValueError(
                "nnsight remote=True runs the model on NDIF, where headsteer's attention function and "
                "hooks do not exist: steering edits cannot run remotely (use remote=False, or only your "
                "own nnsight interventions)"
            )

    def run(self, hm: HeadModel, **inputs: Any) -> Any:
        self._check_remote()
        with self._lock, self.lm.trace(**inputs, remote=self.remote):
            out = self.lm.output.save()
        return out

    def generate(self, hm: HeadModel, **inputs: Any) -> Any:
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


def make_backend(obj: object, *, remote: bool = False) -> tuple[nn.Module, Backend, Any]:
    """`(hf model, backend, tokenizer or None)` for a HF model, bridge or nnsight model.

    Raises:
        TypeError: `obj` is none of these (names its type).
        ValueError: a bridge with processed weights; `remote=True` for a non-nnsight model.
    """
    check_bool("remote", remote, what="a bool")
    kind = backend_kind(obj)
    if remote and kind != "nnsight":
        raise HeadsteerValueError(
            f"remote=True is an nnsight option; got a {kind or type(obj).__name__} model"
        )
    if kind == "transformer_lens":
        bridge: Any = obj
        return bridge.original_model, TransformerLensBackend(bridge), getattr(bridge, "tokenizer", None)
    if kind == "nnsight":
        lm: Any = obj
        return lm._module, NNsightBackend(lm, remote=remote), getattr(lm, "tokenizer", None)
    if kind == "hf":
        return obj, Backend(), None  # type: ignore[return-value]
    hint = f"; to load {obj!r} use heads.load_model({obj!r})" if isinstance(obj, str | os.PathLike) else ""
    raise HeadsteerTypeError(
        f"cannot wrap a {type(obj).__module__}.{type(obj).__name__}: expected a transformers causal LM "
        f"(PreTrainedModel), a TransformerLens TransformerBridge or an nnsight TransformersModel / "
        f"LanguageModel{hint}"
    )
