"""`plan_memory`: the peak memory of an analysis or a steered generation, per device, from a model's
config alone (docs/long-context.md, "Memory model").

    peak(device) = weights(device) + max(fixed + kept, attention + kept + extra)
    kept = sum over its layers of per_layer[kind]

* `weights`: the parameters the device holds (a `meta`-device build; tied once) x dtype size.
* `fixed + per_layer`: the live activation bytes of the family's own forward, traced without
  weights (`heads.planning.trace`): the largest transient of a layer, the residual stream and
  mask, plus what each layer keeps (its KV cache for a generation, its saved activations for a
  gradient). Every device of a split holds the fixed part (the residual, mask and transients
  travel with the layers); the per-layer part only for its own layers.
* `extra`: what the analysis adds to the model's own forward, a closed form per analysis
  (`ANALYSES`): the pattern readers' query blocks, the blocked kernel's pattern block, the
  fused kernel's padded copies. These live beside a layer's attention, so they add to the live
  bytes traced at the attention (`attention`), not to the model's own peak (usually the MLP's).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

import torch

from heads._util.validation import check_int
from heads.engine import state
from heads.errors import HeadsteerValueError
from heads.planning.configs import _config_of
from heads.planning.devices import _device_split, _layer_of, _owns
from heads.planning.eap import EAP_LEAN_BLOCK, circuit_eval_bytes, eap_copies
from heads.planning.patching import full_cache_bytes, lean_rows, patch_kept
from heads.planning.requests import ANALYSES, REQUEST_PLANS, MemoryRequest, as_memory_request
from heads.planning.trace import layer_kinds, n_layers_of, text_config, traced_peak
from heads.planning.units import format_bytes, parse_bytes

__all__ = [
    "ANALYSES",
    "DevicePlan",
    "MemoryPlan",
    "MemoryRequest",
    "REQUEST_PLANS",
    "geometry",
    "plan_memory",
    "rows_within",
    "weight_bytes",
]


@dataclass(frozen=True)
class DevicePlan:
    """Planned peak bytes of one device.

    Attributes:
        device: the device name (`"cpu"`, `"cuda:0"`, ...).
        weights: bytes of the parameters it holds.
        activations: bytes of live activations at the peak (the analysis' extra included).
        layers: decoder layers it holds.
    """

    device: str
    weights: int
    activations: int
    layers: int

    @property
    def total(self) -> int:
        """`weights + activations`, the planned peak in bytes."""
        return self.weights + self.activations


@dataclass(frozen=True)
class MemoryPlan:
    """The planned peak memory of one run, per device (`plan_memory`).

    Attributes:
        model: the config's model type.
        request: what was planned.
        tokens: the run's sequence length.
        batch: the run's batch rows.
        dtype: the run's dtype.
        devices: one `DevicePlan` per device, in order.
    """

    model: str
    request: MemoryRequest
    tokens: int
    batch: int
    dtype: str
    devices: tuple[DevicePlan, ...]

    @property
    def peak(self) -> int:
        """The largest planned device total, in bytes."""
        return max(d.total for d in self.devices)

    def fits(self, budget: object) -> bool:
        """True when every device's planned peak is within `budget` (bytes or `"24GB"`)."""
        return self.peak <= parse_bytes(budget, "budget")

    def to_json(self) -> dict:
        """The plan as plain JSON values (bytes as ints)."""
        return {
            "model": self.model,
            "analysis": self.request.analysis,
            "params": dict(self.request.params),
            "tokens": self.tokens,
            "batch": self.batch,
            "dtype": self.dtype,
            "peak_bytes": self.peak,
            "devices": [
                {
                    "device": d.device,
                    "layers": d.layers,
                    "weights_bytes": d.weights,
                    "activation_bytes": d.activations,
                    "total_bytes": d.total,
                }
                for d in self.devices
            ],
        }

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{d.device}: {format_bytes(d.total)} ({format_bytes(d.weights)} weights + "
            f"{format_bytes(d.activations)} activations, {d.layers} layers)"
            for d in self.devices
        )
        return (
            f"MemoryPlan({self.model} {self.request.analysis}, {self.tokens} tokens x {self.batch}, "
            f"{self.dtype}: peak {format_bytes(self.peak)}; {parts})"
        )


# ---------------------------------------------------------------- geometry and weights
def geometry(config: Any) -> dict[str, int]:
    """`n_layers, n_heads, n_kv_heads, d_head, d_model, d_vocab` read from a config (a
    vision-language config: its language model)."""
    cfg = text_config(config)

    def first(*names: str, default: int | None = None) -> int:
        for n in names:
            v = getattr(cfg, n, None)
            if isinstance(v, int) and v > 0:
                return v
        if default is None:
            raise HeadsteerValueError(f"{type(cfg).__name__} sets none of {names}: cannot plan its memory")
        return default

    d_model = first("hidden_size", "n_embd", "d_model")
    n_heads = first("num_attention_heads", "n_head", "num_heads")
    return {
        "n_layers": n_layers_of(cfg),
        "n_heads": n_heads,
        "n_kv_heads": first("num_key_value_heads", "num_kv_heads", default=n_heads),
        "d_head": first("head_dim", default=d_model // n_heads),
        "d_model": d_model,
        "d_vocab": first("vocab_size"),
    }


_CACHE: dict[tuple, Any] = {}  # (what, config key, ...) -> result; configs are not hashable


def _cached(key: tuple, make: Any) -> Any:
    hit = _CACHE.get(key)
    if hit is None:
        if len(_CACHE) > 128:
            _CACHE.clear()
        hit = _CACHE[key] = make()
    return hit


def _config_key(config: Any, whole: bool = False) -> str:
    d = (config if whole else text_config(config)).to_dict()
    for k in ("architectures", "auto_map", "transformers_version", "_name_or_path"):
        d.pop(k, None)
    return json.dumps(d, sort_keys=True, default=str)


def _param_sizes(config: Any) -> tuple[tuple[str, int], ...]:
    """`(name, numel)` of every parameter of a `meta`-device build (tied weights once); a
    vision-language config builds the whole model (vision tower and projector included), as
    `load_model` loads it."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    def make() -> tuple[tuple[str, int], ...]:
        with torch.device("meta"):
            if text_config(config) is not config:
                model = AutoModelForImageTextToText.from_config(copy.deepcopy(config))
            else:
                model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
        return tuple((n, p.numel()) for n, p in model.named_parameters())

    sizes: tuple[tuple[str, int], ...] = _cached(("params", _config_key(config, whole=True)), make)
    return sizes


_FIRST_DEVICE = ("embed", ".wte.", ".wpe.", "vision", "visual", "multi_modal", "connector", "image")
"""Parameter-name parts an even split puts on the first device (the inputs' side: embeddings,
a vision tower and its projector, whose layers are not decoder layers)."""


def weight_bytes(config: Any, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of every parameter (by name) of the model of `config` in `dtype`, without weights."""
    size = torch.empty(0, dtype=dtype).element_size()
    return {n: k * size for n, k in _param_sizes(config)}


# ---------------------------------------------------------------- the analyses' extras
def _fused(request: MemoryRequest, tokens: int, device: str) -> bool:
    kernel = request.get("kernel", "auto")
    if kernel != "auto":
        return bool(kernel == "fused")
    return device.startswith("cuda") or tokens >= state.FUSED_MIN_ROWS_CPU


def _extra(
    request: MemoryRequest, g: dict[str, int], tokens: int, batch: int, dtype: torch.dtype, device: str
) -> int:
    """Bytes an analysis adds to the model's own forward (the closed forms of docs/long-context.md)."""
    b, h, d, t = batch, g["n_heads"], g["d_head"], tokens
    item = torch.empty(0, dtype=dtype).element_size()
    kv_copies = 2 * b * h * t * d * item  # the explicit path repeats K and V per query head (GQA)
    name = request.analysis
    if name in ("sinks", "detectors", "retrieval", "qrhead"):
        rows = min(t, state.read_block_rows(b, h, t))
        if name in ("retrieval", "qrhead"):
            rows = min(rows, int(request.get("query_rows", 64)))
        block = b * h * rows * t * 4  # fp32 pattern block
        return kv_copies + READ_COPIES.get(name, READ_BLOCK_COPIES) * block
    if name in ("generate", "knockout"):
        if _fused(request, t, device):  # only the edited heads run through flex_attention, padded
            return FUSED_COPIES * b * h * (t + 128) * d * item
        if name == "knockout":  # a logit bias shared by the heads: SDPA with `[B, 1, rows, K]` masks
            return BIAS_COPIES * b * min(state.bias_block_rows(b, t), t) * t * 4
        rows = min(state.QUERY_BLOCK, t)
        return kv_copies + BLOCKED_COPIES * b * h * rows * t * 4
    return 0


def _patch_kept(
    req: MemoryRequest, g: dict[str, int], tokens: int, pairs: int, dtype: torch.dtype
) -> tuple[int, int]:
    """`(rows per forward, bytes kept beside the forwards)` of activation / path patching on
    `pairs` pairs (`heads.planning.patching`): `patch`'s default path (the lean path's sites, its
    forwards at most `lean_rows` rows; or both runs' full caches, the recorded runs of every
    pair), `path_patch`'s full caches (no q / k / v projections)."""
    item = torch.empty(0, dtype=dtype).element_size()
    if req.analysis == "path_patch":
        return pairs, 2 * full_cache_bytes(g, item, pairs, tokens, keys=False)
    layers, positions = req.get("layers", None), req.get("positions", None)
    lean, kept = patch_kept(g, item, req.get("kind", "head_out"), pairs, tokens, layers, positions)
    return (min(pairs, lean_rows(64, tokens)) if lean else pairs), kept


READ_BLOCK_COPIES = 6
"""fp32 pattern-block-sized tensors alive while a block is read (logits, mask, pattern, product)."""

READ_COPIES = {"sinks": 3, "detectors": 5}
"""... for the one-pass readers (logits, pattern; sinks' column sums, detectors' entr + masks)."""

BLOCKED_COPIES = 5
"""... on the blocked kernel's edited path (logits, biased logits, probabilities, edited pattern,
its value product input)."""

BIAS_COPIES = 4
"""fp32 `[B, 1, rows, K]` masks alive at once on the blocked kernel's biased-SDPA path (knockout):
the model's mask for the block, the bias block, the bias on its rows, their sum (clamped in place);
SDPA reads query, key and value as they are."""

FUSED_COPIES = 4
"""`[B, H, T_padded, d]` tensors the fused kernel adds (padded query, key, value, output)."""


def plan_memory(
    config: object,
    request: object = "forward",
    tokens: int = 1024,
    batch: int = 1,
    dtype: torch.dtype | str = torch.float32,
    devices: object = None,
) -> MemoryPlan:
    """The planned peak memory per device of `request` on `batch` rows of `tokens` tokens, from
    the model's config alone: no weight is read or allocated (docs/long-context.md).

    Args:
        config: a `transformers` config (a vision-language config: its language model), a
            `HeadModel` (its config) or a model folder / name as `load_model` takes (its
            `config.json` only).
        request: an analysis name of `ANALYSES` (default `"forward"`), a `MemoryRequest` (an
            analysis and its parameters), or a request object with `memory_request()`.
        tokens: the sequence length (the prompt; `generate` adds `new_tokens`), >= 1.
        batch: rows per forward, >= 1.
        dtype: the model's dtype (`torch.bfloat16` or `"bfloat16"`, ...; default float32).
        devices: None (one device, `"cpu"`), a device name, a GPU count (layers split evenly
            over `cuda:0..n-1`), a list of device names (the same), or a `device_map`
            (`{module name: device}`, as `load_model(device_map=...)` takes).

    Returns:
        a `MemoryPlan` (per device: weights, activations, total; `peak`, `fits(budget)`).

    Raises:
        HeadsteerValueError: an unknown analysis, a bad length / batch / dtype, more tokens than
            the model's positions, a device_map that leaves a parameter unplaced.
        HeadsteerTypeError: a config, request or devices of a wrong type.

    Measured against RSS peaks on CPU (0.1B-1B random-weight models, fp32 and bf16): the
    benchmark `benchmarks/long_context_analyses.py` reports the largest error, `plan_error_max`.
    """
    from heads.model.loading import check_dtype

    cfg = _config_of(config)
    from heads.model.families import family_of

    family_of(cfg)  # a family load_model refuses is not planned either (the reason named)
    req = as_memory_request(request)
    tokens = check_int("tokens", tokens, lo=1)
    batch = check_int("batch", batch, lo=1, hi=1 << 24)
    dt = check_dtype(dtype)
    limit = getattr(text_config(cfg), "max_position_embeddings", None)
    total_tokens = tokens + int(req.get("new_tokens", 0))
    if isinstance(limit, int) and total_tokens > limit:
        raise HeadsteerValueError(f"{total_tokens} tokens exceed the model's limit of {limit} positions")
    g = geometry(cfg)
    kinds = layer_kinds(cfg)
    mode = {"generate": "cache", "gradient": "backward"}.get(req.analysis, "forward")
    rows, kept = batch, 0  # patching: batch = pairs, its forwards' rows and what it keeps
    if req.analysis in ("patch", "path_patch"):
        rows, kept = _patch_kept(req, g, total_tokens, batch, dt)
    traced = _cached(
        ("trace", _config_key(cfg), mode, total_tokens, rows, dt),
        lambda: traced_peak(cfg, mode, total_tokens, rows, dt),
    )
    sizes = weight_bytes(cfg, dt)
    split = _device_split(list(sizes), kinds, devices)
    plans = []
    for i, (dev, layers, prefixes) in enumerate(split):
        if prefixes:
            w = sum(v for n, v in sizes.items() if any(_owns(p, n) for p in prefixes))
        else:  # an even split: layer parameters by index, the rest on the first / last device
            w = 0
            for n, v in sizes.items():
                first = any(part in n for part in _FIRST_DEVICE)
                la = None if first else _layer_of(n)
                if la is not None:
                    w += v if la in layers else 0
                elif first and i == 0:
                    w += v
                elif not first and i == len(split) - 1:
                    w += v
        count: dict[str, int] = {}
        for la in layers:
            count[kinds[la]] = count.get(kinds[la], 0) + 1
        # the analysis' tensors live beside a layer's attention, not at the model's own peak
        # (the MLP's, usually): the larger of the two
        extra = _extra(req, g, total_tokens, batch, dt, dev)
        act = traced.at(count) if not extra else max(traced.at(count), traced.at_attention(count) + extra)
        if req.analysis in ("eap", "eap_lean"):  # kept for the whole walk: on top of the forward's peak
            copies = eap_copies(req.analysis, g, len(layers), int(req.get("block", EAP_LEAN_BLOCK)))
            act += int(copies * batch * total_tokens * g["d_model"] * 4)
            if req.get("circuit", False):  # find_circuit: its exact evaluations, after the scores
                share = len(layers) / max(1, g["n_layers"])
                item = torch.empty(0, dtype=dt).element_size()
                evals = traced.at(count) + int(share * batch * circuit_eval_bytes(g, total_tokens, 1, item))
                act = max(act, evals)
        if req.analysis in ("patch", "path_patch"):  # kept beside every forward of the sweep
            act += kept
        if req.analysis == "logits" and i == len(split) - 1:  # [B, T, V]: logits, copy, fp16 copy
            act += batch * total_tokens * g["d_vocab"] * (2 * torch.empty(0, dtype=dt).element_size() + 2)
        plans.append(DevicePlan(dev, int(w), int(act), len(layers)))
    return MemoryPlan(
        str(text_config(cfg).model_type), req, tokens, batch, str(dt).replace("torch.", ""), tuple(plans)
    )


def rows_within(
    config: object,
    budget: object,
    request: object = "forward",
    tokens: int = 1024,
    dtype: torch.dtype | str = torch.float32,
    devices: object = None,
    most: int | None = None,
) -> int:
    """The largest batch (at most `most`) whose planned peak stays within `budget`, from the
    plans at batch 1 and 2 (activations grow linearly in the batch).

    Raises:
        HeadsteerValueError: even one row does not fit: the message names the minimum (the
            plan at batch 1) and the budget; a bad budget.
    """
    limit = parse_bytes(budget, "max_memory")
    one = plan_memory(config, request, tokens, 1, dtype, devices)
    if one.peak > limit:
        raise HeadsteerValueError(
            f"{one.request.analysis} on {tokens} tokens needs at least {format_bytes(one.peak)} "
            f"(one row: {one!r}); max_memory is {format_bytes(limit)}"
        )
    two = plan_memory(config, request, tokens, 2, dtype, devices)
    rows = most if most is not None else 1 << 20
    for a, b in zip(one.devices, two.devices, strict=True):
        step = max(1, b.total - a.total)
        rows = min(rows, 1 + (limit - a.total) // step)
    return max(1, int(rows))
