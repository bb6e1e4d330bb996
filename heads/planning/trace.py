"""Peak memory of a model's own forward (or forward and backward) from its config alone.

The model is built inside `torch._subclasses.fake_tensor.FakeTensorMode` (no weight is
allocated, no arithmetic runs) and run once on fake inputs while a dispatch mode counts the
bytes of every storage an operation creates until Python frees it (`weakref.finalize` on the
storage). The largest count is the peak of live activation memory, the weights excluded: exact
for the family's own code (its mask, its MLP, its attention path), because it is that code that
runs. Kernel workspaces inside one operation (SDPA's per-thread blocks) are not seen; they are
small and bounded.

To be quick for any size the traced model has two and three decoder layers of each layer kind
(e.g. Gemma 2's sliding and global layers), and the peak of the whole model is extrapolated
linearly, `a + sum of b_kind` over its layers (b = 0 for a forward without cache or gradient; the
KV cache or the saved activations of a layer otherwise).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError

__all__ = ["MODES", "LiveBytes", "TracedPeak", "layer_kinds", "n_layers_of", "text_config", "traced_peak"]

MODES = ("forward", "cache", "backward")
"""What is traced: `"forward"` (no gradient, no KV cache, the last position's logits only),
`"cache"` (a prefill that keeps its KV cache, as generation does) and `"backward"` (a forward
with gradients on the activations and a backward from a scalar of the last position's logits)."""

_LOCK = threading.Lock()  # FakeTensorMode and the dispatch mode are process-wide while active


_ATTENTION_OPS = ("scaled_dot_product", "_softmax")
"""Operator names (substrings) that mark a layer's attention: SDPA's kernels, eager softmax."""


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live storages created by operations; `peak` is the largest count.

    `attention` is the largest count just after an attention operation (SDPA, or the softmax
    of eager attention) returned: what is alive while a layer's attention output is formed,
    beside which the engine's pattern readers and the fused kernel add their own tensors.
    Storages that already existed (the weights, registered with `ignore`) are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.attention = 0
        self._sizes: dict[int, int] = {}
        self._ignored: set[int] = set()

    def ignore(self, tensors: Any) -> None:
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._ignored.add(t.untyped_storage()._cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._sizes or key in self._ignored:
                continue
            n = int(storage.nbytes())
            self._sizes[key] = n
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        name = str(func)
        if any(op in name for op in _ATTENTION_OPS):
            self.attention = max(self.attention, self.live)
        return out

    def _free(self, key: int) -> None:
        n = self._sizes.pop(key, None)
        if n is not None:
            self.live -= n


@contextlib.contextmanager
def _quiet_fake_tensor() -> Iterator[None]:
    """torch logs a traceback at ERROR level when a fake kernel refuses an input (e.g. fp32 MoE
    experts through `_grouped_mm`); the plan reports the failure or works around it itself."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@dataclass(frozen=True)
class TracedPeak:
    """Live activation bytes of a traced run, as `fixed + sum over layers of per_layer[kind]`.

    Attributes:
        fixed: bytes that do not grow with the layer count (the largest transient of a layer,
            the residual stream, the mask, the logits).
        per_layer: bytes each further decoder layer of a kind keeps (its KV cache, its saved
            activations), by layer kind (`config.layer_types`; `"layer"` when it has none).
        attention: the part of `fixed` alive when a layer's attention output has just been
            formed (`LiveBytes.attention`); what an analysis adds at that moment comes on top.
    """

    fixed: int
    per_layer: dict[str, int]
    attention: int = 0

    def at(self, kinds: dict[str, int]) -> int:
        """Bytes for a model with `kinds[k]` decoder layers of each kind k."""
        return self.fixed + sum(self.per_layer.get(k, 0) * n for k, n in kinds.items())

    def at_attention(self, kinds: dict[str, int]) -> int:
        """Bytes alive at a layer's attention output in a model with `kinds[k]` layers of kind k."""
        return self.attention + sum(self.per_layer.get(k, 0) * n for k, n in kinds.items())


def text_config(config: Any) -> Any:
    """The language model's config (a vision-language config's `text_config`), else `config`."""
    return getattr(config, "text_config", None) or config


def n_layers_of(config: Any) -> int:
    """The decoder layer count of `config` (`num_hidden_layers` and its aliases)."""
    cfg = text_config(config)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        n = getattr(cfg, name, None)
        if isinstance(n, int) and n > 0:
            return n
    raise HeadsteerValueError(
        f"{short_repr(type(cfg).__name__)} has no decoder layer count (num_hidden_layers)"
    )


def layer_kinds(config: Any) -> list[str]:
    """The kind of every decoder layer: `config.layer_types` (e.g. `"sliding_attention"`), or
    `"layer"` for each when the config has none."""
    cfg = text_config(config)
    types = getattr(cfg, "layer_types", None)
    n = n_layers_of(cfg)
    if isinstance(types, (list, tuple)) and len(types) == n:
        return [str(t) for t in types]
    return ["layer"] * n


def _reduced(config: Any, kind: str, layers: int) -> Any:
    """A copy of the text config with `layers` decoder layers, all of `kind`."""
    cfg = copy.deepcopy(text_config(config))
    cfg.num_hidden_layers = layers
    if kind != "layer":
        cfg.layer_types = [kind] * layers
    return cfg


@contextlib.contextmanager
def _unpacked_in_this_thread() -> Iterator[None]:
    """While tracing, `transformers`' packed-sequence detection answers "not packed" in this
    thread, as it does for the traced (unpacked) rows in a real run: on fake tensors it cannot
    read the positions and would build the full causal mask that a real run skips (SDPA's
    `is_causal`). Other threads get the original function."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    me = threading.get_ident()

    def find(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if threading.get_ident() == me else original(position_ids)

    masking_utils.find_packed_sequence_indices = find
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _run(config: Any, mode: str, tokens: int, batch: int, dtype: torch.dtype) -> tuple[int, int]:
    """Peak live bytes, and live bytes at attention, of one traced run of a model of `config`."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    with _unpacked_in_this_thread(), FakeTensorMode(allow_non_fake_inputs=True):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        except ValueError:  # a family without SDPA (Gemma 2): its eager attention, as it loads
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager")
        model.eval()
        model.requires_grad_(False)
        tracker = LiveBytes()
        tracker.ignore(list(model.parameters()) + list(model.buffers()))
        ids = torch.zeros(batch, tokens, dtype=torch.long)
        if mode == "backward":
            emb = model.get_input_embeddings()
            with tracker:
                x = emb(ids).detach().requires_grad_(True)
                out = model(inputs_embeds=x, use_cache=False, logits_to_keep=1)
                out.logits.float().logsumexp(-1).sum().backward()
                del out, x
        else:
            with torch.no_grad(), tracker:
                out = model(input_ids=ids, use_cache=mode == "cache", logits_to_keep=1)
                del out
    return tracker.peak, tracker.attention


def traced_peak(config: Any, mode: str, tokens: int, batch: int, dtype: torch.dtype) -> TracedPeak:
    """Live activation bytes of the model of `config` on `batch` rows of `tokens` tokens.

    Each layer kind is traced with two and with three layers of that kind; the difference is
    what a layer of the kind keeps, the rest is fixed (the largest over the kinds).

    Args:
        config: a `transformers` config (a vision-language config: its language model).
        mode: one of `MODES`.
        tokens, batch: the sequence length and the batch rows.
        dtype: the model's dtype.

    Raises:
        HeadsteerValueError: an unknown mode; a config `transformers` cannot build a causal LM
            from (its message named).
    """
    if mode not in MODES:
        raise HeadsteerValueError(f"mode must be one of {MODES}, got {short_repr(mode)}")
    fixed, attention, per_layer = 0, 0, {}
    try:
        with _LOCK, _quiet_fake_tensor():
            for kind in dict.fromkeys(layer_kinds(config)):
                # two and three layers: the first layer's transients can overlap the model's
                # own set-up (embedding, mask), so the slope is taken after it
                p2, a2 = _run(_reduced(config, kind, 2), mode, tokens, batch, dtype)
                p3, _ = _run(_reduced(config, kind, 3), mode, tokens, batch, dtype)
                per_layer[kind] = max(0, p3 - p2)
                fixed = max(fixed, p2 - 2 * per_layer[kind])
                attention = max(attention, a2 - 2 * per_layer[kind])
    except HeadsteerValueError:
        raise
    except Exception as exc:  # transformers' own message names what it could not build
        if dtype == torch.float32 and "BF16" in str(exc):
            # MoE experts through `_grouped_mm`, whose fake kernel takes bf16 only: the bf16 trace
            # with every byte doubled (index tensors counted twice: an upper bound)
            half = traced_peak(config, mode, tokens, batch, torch.bfloat16)
            return TracedPeak(
                fixed=2 * half.fixed,
                per_layer={k: 2 * v for k, v in half.per_layer.items()},
                attention=2 * half.attention,
            )
        raise HeadsteerValueError(
            f"cannot trace {type(text_config(config)).__name__} for a memory plan: {exc}"
        ) from exc
    return TracedPeak(fixed=max(0, fixed), per_layer=per_layer, attention=max(0, attention))
