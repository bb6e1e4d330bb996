"""Sink dimensions of the residual stream and per-layer sink tokens (VAR §2, §4; docs/methods/var.md).

Massive activations (Sun et al. 2024, arXiv:2402.17762) live in a few fixed residual
dimensions of a backbone (`D_sink`); a token whose residual state entering layer l has a
massive value there is a *sink* at that layer (BOS, ".", "\\n", and in LMMs some image tokens).

* `sink_value(x, dims)`: phi(x) = max_{d in D_sink} |x_d| / RMS(x) (fp32, no norm weight,
  eps 1e-6); phi <= sqrt(D).
* `KNOWN_SINK_DIMS` / `sink_dims_for(model)`: the dims of known backbones, keyed by the
  text config (model type, width, depth); an unknown backbone raises unless dims are given.
* `find_sink_dims(model, prompts)`: rank dims by the median over prompts and layers >= 2 of
  |x_d| / RMS(x) at the first token, keep the few far above the rest, with the evidence.
* `SinkTracker`: flags sinks per layer from the residual entering the layer, at every forward
  (prefill and each decode step), per batch row, as a `[B, K]` key mask kept alongside the
  KV cache. It reads the residual at the engine's `residual` site (`resid_pre`): its `edits()`
  go into the same `editing()` context as the edits that use the flags, on every backend and
  per thread; `observe(layer, hidden, offset)` is the whole logic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pandas as pd
import torch

from heads._util.validation import is_int, short_repr
from heads.engine.activations import ActivationEdit
from heads.engine.edits import AttentionCall
from heads.engine.forward import forward
from heads.engine.options import SweepOptions, sweep_options
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import encode_prompts, normalize_prompts
from heads.model.adapter import HeadModel
from heads.results.sinks import SinkDims as SinkDims  # defined there; imported here as before
from heads.scorers.sink_requests import SinkDimsRequest

__all__ = [
    "CALIBRATED_TAU",
    "KNOWN_SINK_DIMS",
    "SinkDims",
    "SinkTracker",
    "default_tau",
    "find_sink_dims",
    "run_sink_dims",
    "sink_dims_for",
    "sink_tau_for",
    "sink_value",
]

EPS = 1e-6

KNOWN_SINK_DIMS: dict[tuple[str, int, int], tuple[int, ...]] = {
    # (text model_type, hidden_size, num_hidden_layers) -> D_sink (docs/methods/var.md)
    ("llama", 4096, 32): (1415, 2533),  # LLaMA-2-7B / LLaVA-1.5-7B (reference code)
    ("llama", 5120, 40): (2100, 4743),  # 13B: LLaVA-1.5-13B / LLaVA-1.6-vicuna-13B (reference code)
    ("qwen2", 3584, 28): (458, 2570),  # Qwen2-VL-7B (paper; no code)
    ("qwen2_vl_text", 3584, 28): (458, 2570),
    ("internlm2", 4096, 32): (3584,),  # InternVL2-8B (paper; no code)
    # SmolLM2-135M(-Instruct), the embedded model: found by `find_sink_dims` on 24 generic
    # prompts: median |x_d|/RMS at the first token 23.8 (dim 507, 483x the median dim); the
    # runner-up, dim 247, is 37x and does not single out the first token (tests/steer/test_var_sink_dims.py).
    ("llama", 576, 30): (507,),
}

CALIBRATED_TAU: dict[tuple[str, int, int], float] = {
    # SmolLM2-135M: dim 507 is large at every token (median phi ~12 in layers 2-28), the first
    # token reaches 20.7-23.8 (the bound is 24); tau = 20 flags it and ~1% of other tokens.
    ("llama", 576, 30): 20.0,
}


def _text_config(config: object) -> object:
    return getattr(config, "text_config", None) or config


def _key(model: HeadModel) -> tuple[str, int, int]:
    cfg = _text_config(model.model.config)
    return (str(getattr(cfg, "model_type", "")), int(model.d_model), int(model.n_layers))


def _check_dims(dims: object, width: int) -> tuple[int, ...]:
    if isinstance(dims, (str, bytes)) or not isinstance(dims, (list, tuple, range)) or not dims:
        raise HeadsteerValueError(f"sink dims must be a non-empty list of ints, got {short_repr(dims)}")
    out = []
    for d in dims:
        if not is_int(d) or not 0 <= int(d) < width:
            raise HeadsteerValueError(
                f"sink dim {short_repr(d)} is not an int in 0..{width - 1} (d_model = {width})"
            )
        out.append(int(d))
    if len(set(out)) != len(out):
        raise HeadsteerValueError(f"sink dims have duplicates: {short_repr(dims)}")
    return tuple(out)


def sink_dims_for(model: HeadModel, dims: Sequence[int] | None = None) -> tuple[int, ...]:
    """The sink dimensions of `model`'s backbone: `dims` if given (validated), else the table.

    Raises:
        ValueError: bad `dims`, or a backbone not in `KNOWN_SINK_DIMS` and no `dims`
            (find them with `find_sink_dims(model, prompts)` and pass them).
    """
    if dims is not None:
        return _check_dims(dims, model.d_model)
    key = _key(model)
    if key not in KNOWN_SINK_DIMS:
        raise HeadsteerValueError(
            f"no known sink dims for backbone {key} (model_type, d_model, n_layers): pass sink_dims=[...] "
            "or find them with heads.find_sink_dims(model, prompts)"
        )
    return KNOWN_SINK_DIMS[key]


def default_tau(d_model: int) -> float:
    """Sink threshold scaled to the width: 20 * sqrt(D / 4096) (docs/methods/var.md; 7.5 at D = 576)."""
    return 20.0 * math.sqrt(d_model / 4096)


def sink_tau_for(model: HeadModel) -> float:
    """The sink threshold of `model`: calibrated (`CALIBRATED_TAU`) for known backbones, else
    `default_tau(d_model)` (docs/methods/var.md: scale, then calibrate)."""
    return CALIBRATED_TAU.get(_key(model), default_tau(model.d_model))


def sink_value(x: torch.Tensor, dims: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """phi(x) = max over `dims` of |x_d| / RMS(x) (docs/methods/var.md), in fp32.

    Args:
        x: `[..., D]` residual states.
        dims: the sink dimensions (ints, or a long tensor on `x`'s device).

    Returns:
        `[...]` phi, at most sqrt(D) (64 at D = 4096, 8 at D = 64).
    """
    xf = x.float()
    rms = xf.pow(2).mean(-1).add(EPS).sqrt()
    idx = dims if isinstance(dims, torch.Tensor) else list(dims)
    return xf[..., idx].abs().amax(-1) / rms


@torch.no_grad()
def find_sink_dims(
    model: HeadModel,
    prompts: Sequence,
    *,
    from_layer: int = 2,
    max_dims: int = 3,
    min_ratio: float = 100.0,
) -> SinkDims:
    """Find a backbone's sink dimensions (docs/methods/var.md, "Finding D_sink").

    Runs `prompts` (20-50 generic texts; no chat template), takes the residual state entering
    each layer >= `from_layer` at the first token of each prompt, ranks dims by the median of
    |x_d| / RMS(x), and keeps the dims whose score is at least `min_ratio` (default 100) times
    the median score of all dims, at most `max_dims` (default 3), strongest first. Builds the
    `SinkDimsRequest` (its checks) and runs it (`run_sink_dims`, as `heads.run` does).

    Returns:
        `SinkDims` (dims and evidence DataFrame).

    Raises:
        ValueError: no prompts, `from_layer` outside 0..L-1, bad `max_dims` / `min_ratio`,
            or no dim far enough above the rest (the evidence is in the message).
    """
    request = SinkDimsRequest(from_layer=from_layer, max_dims=max_dims, min_ratio=min_ratio)
    return run_sink_dims(model, prompts, request)


def run_sink_dims(
    model: HeadModel, prompts: Sequence, request: SinkDimsRequest, options: SweepOptions | None = None
) -> SinkDims:
    """Run a `SinkDimsRequest` on `prompts` (what `find_sink_dims` does once it has built the
    request: its values are checked there, its `from_layer` here against `model`; `options` takes
    no sweep option, one forward of every prompt; see `find_sink_dims` for the rest)."""
    if not isinstance(request, SinkDimsRequest):
        raise HeadsteerTypeError(f"request must be a SinkDimsRequest, got {type(request).__name__}")
    sweep_options(options, {}, "find_sink_dims", takes=())
    items = normalize_prompts(prompts)[0]
    if not items:
        raise HeadsteerValueError("find_sink_dims needs prompts")
    request.check_config(model)  # from_layer in 0..L-1
    from_layer, max_dims, min_ratio = request.from_layer, request.max_dims, request.min_ratio
    enc = encode_prompts(model.tokenizer, items, chat=False, markup=False)
    out = forward(model, enc, output_hidden_states=True)
    real = enc.attention_mask.bool()
    first = real.float().argmax(-1)
    rows = torch.arange(enc.batch)
    states = torch.stack([out.hidden_states[la].float().cpu() for la in range(from_layer, model.n_layers)])
    rms = states.pow(2).mean(-1, keepdim=True).add(EPS).sqrt()
    ratio = states.abs() / rms  # [L', B, T, D]
    at_first = ratio[:, rows, first]  # [L', B, D]
    score = at_first.reshape(-1, model.d_model).median(0).values
    tok = model.tokenizer
    if tok is None:
        raise HeadsteerValueError("find_sink_dims needs a HeadModel with a tokenizer")
    punct_ids = {i for i in (tok.convert_tokens_to_ids("."), tok.convert_tokens_to_ids("Ċ")) if i is not None}
    punct = torch.isin(enc.input_ids, torch.tensor(sorted(punct_ids))) & real
    if bool(punct.any()):
        punct_score = ratio[:, punct].reshape(-1, model.d_model).median(0).values
    else:
        punct_score = torch.full((model.d_model,), float("nan"))
    med = float(score.median())
    order = score.argsort(descending=True)
    chosen = [int(d) for d in order[:max_dims] if float(score[d]) >= min_ratio * med]
    ev = pd.DataFrame(
        {
            "dim": order.tolist(),
            "score": score[order].tolist(),
            "ratio_to_median_dim": (score[order] / max(med, 1e-30)).tolist(),
            "punct_score": punct_score[order].tolist(),
        }
    )
    ev["selected"] = ev["dim"].isin(chosen)
    if not chosen:
        top = ev.head(5)[["dim", "score", "ratio_to_median_dim"]].to_dict("records")
        raise HeadsteerValueError(f"no residual dim is >= {min_ratio}x the median dim score; top dims: {top}")
    return SinkDims(
        tuple(chosen),
        ev,
        getattr(model, "name", ""),
        (model.n_layers, model.n_heads, model.n_kv_heads, model.d_model),
        {"from_layer": from_layer, "max_dims": max_dims, "min_ratio": float(min_ratio)},
    )


class SinkTracker:
    """Sink flags per layer and batch row, from the residual entering each layer (docs/methods/var.md).

    `observe(layer, hidden, offset)` sets the flags of key columns `offset .. offset + T` of
    layer `layer` from `hidden` `[B, T, D]`: phi >= tau (and column < `prefill_len` when
    `prefill_only`). A call with `offset == 0` starts a new sequence (flags reset), so state
    never leaks from one sample to the next. `mask(layer, k_len)` is the `[B, k_len]` flags.

    `edits()` are the engine edits that read the residual entering each tracked layer (site
    `residual`, `[B, T, D]`, absolute offset `call.q_offset`): apply them in the `editing()`
    context of the edits that read the flags, listed before those (the residual of a layer is
    read before its attention runs). Nothing is installed on the model outside that context.

    Args:
        dims: the sink dimensions.
        tau: threshold on phi (flag when phi >= tau).
        layers: the layers to track.
        prefill_only: flag only prompt columns (`< prefill_len`), the reference's behaviour.
        prefill_len: P, the padded prompt length.
    """

    def __init__(
        self,
        dims: Sequence[int],
        tau: float,
        layers: Sequence[int],
        *,
        prefill_only: bool = False,
        prefill_len: int = 0,
    ):
        self.dims = tuple(dims)
        self.tau = float(tau)
        self.layers = tuple(layers)
        self.prefill_only = prefill_only
        self.prefill_len = prefill_len
        self.flags: dict[int, torch.Tensor] = {}
        self._bufs: dict[int, torch.Tensor] = {}  # per layer, [B, capacity]; flags are its prefixes
        self._dims_index: dict[torch.device, torch.Tensor] = {}
        self.observed = 0

    def observe(self, layer: int, hidden: torch.Tensor, offset: int) -> None:
        """Flag sinks among the rows `hidden` `[B, T, D]` at absolute positions `offset ..`."""
        if layer not in self.layers:
            return
        phi = sink_value(hidden, self._index(hidden.device))  # [B, T]
        new = phi >= self.tau
        if self.prefill_only:
            pos = torch.arange(offset, offset + new.shape[1], device=new.device)
            new = new & (pos < self.prefill_len)
        n = offset + new.shape[1]
        buf = self._bufs.get(layer)
        if offset == 0 or buf is None or buf.shape[0] != new.shape[0] or buf.device != new.device:
            # a new sequence: a fresh buffer (flags handed out earlier stay as they were)
            buf = self._bufs[layer] = new.new_zeros(new.shape[0], max(2 * n, 64))
            seen = 0
        else:
            seen = self.flags[layer].shape[1]
        if buf.shape[1] < n:  # grow by doubling: O(1) amortised per decode step
            grown = new.new_zeros(buf.shape[0], max(n, 2 * buf.shape[1]))
            grown[:, :seen] = buf[:, :seen]
            buf = self._bufs[layer] = grown
        if seen < offset:  # unseen columns (should not happen): not sinks
            buf[:, seen:offset] = False
        buf[:, offset:n] = new
        self.flags[layer] = buf[:, :n]
        self.observed += 1

    def _index(self, device: torch.device) -> torch.Tensor:
        idx = self._dims_index.get(device)
        if idx is None:
            idx = self._dims_index[device] = torch.tensor(self.dims, dtype=torch.long, device=device)
        return idx

    def mask(self, layer: int, k_len: int, device: torch.device | None = None) -> torch.Tensor:
        """`[B, k_len]` bool sink flags of layer `layer` (columns not seen: False)."""
        f = self.flags[layer]
        if f.shape[1] < k_len:
            f = torch.cat([f, f.new_zeros(f.shape[0], k_len - f.shape[1])], 1)
        f = f[:, :k_len]
        return f if device is None else f.to(device)

    def edits(self) -> list[ActivationEdit]:
        """One `residual`-site read per tracked layer, calling `observe` (see the class docstring)."""
        return [ActivationEdit("residual", la, self._reader(la)) for la in self.layers]

    def _reader(self, layer: int) -> Callable[[torch.Tensor, AttentionCall], None]:
        def fn(hidden: torch.Tensor, call: AttentionCall) -> None:
            self.observe(layer, hidden, call.q_offset)

        return fn
