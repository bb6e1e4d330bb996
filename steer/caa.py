"""Contrastive Activation Addition (CAA): residual-stream steering vectors (Rimsky, Gabrieli,
Schulz, Tong, Hubinger and Turner, "Steering Llama 2 via Contrastive Activation Addition",
ACL 2024, arXiv:2312.06681).

Vector. For contrastive prompt pairs (p_i, n_i) (the same prompt ending in the behaviour's answer
and in its opposite), read the residual stream at the output of decoder layer `layer` (the hidden
state entering layer `layer + 1`) at the last token, and take the mean difference (paper §3):

    v = (1/N) sum_i [ h_layer(p_i)[-1] - h_layer(n_i)[-1] ]          `[d_model]`

Steering. Add `coefficient * v` to that residual at every position from `from_position` on:
the last prompt token (default `from_position=-1`) and every generated token, at prefill and at
every decode step (paper §3: "after the user's prompt"). It is a `ResidualEdit` (the pre-hook on
layer `layer + 1`), so it runs on every backend and composes with head methods in one
`steer=[...]` list, e.g. `[Caa(...), Pasta(...)]`.

Layer convention: `layer` is the decoder block whose *output* is read and steered, as in the paper
and the `steering-vectors` package (`layer_type="decoder_block"`, a forward hook on block
`layer`); the last block (`n_layers - 1`) has no next layer and is refused.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from heads._util.progress import progress_callback
from heads._util.validation import check_int, is_int, is_number, short_repr
from heads.engine.context import editing
from heads.engine.edits import MAX_FACTOR, AttentionCall, ResidualEdit, ResidualRecorder
from heads.engine.forward import forward
from heads.engine.options import SweepOptions, sweep_options
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, encode_prompts
from heads.model.adapter import HeadModel
from steer.noop import warn_noop

__all__ = ["Caa", "CaaAdd", "caa_vector", "load_caa_vectors", "save_caa_vectors"]

MAX_VECTORS = 64
"""Most vectors in one CAA vector file (`load_caa_vectors`)."""
MAX_NAME = 64
"""Longest vector name in a CAA vector file."""
MAX_ENTRY = math.sqrt(torch.finfo(torch.float32).max)
"""Largest `|coefficient * vector|` entry (about 1.8e19): the next layer's norm squares the
residual in float32, so a larger entry makes it inf and the model's output collapses
(greedy generation on SmolLM2-135M returns an empty text from 1e20 on). `Caa.check` also
bounds it by the model dtype's largest value (65504 in float16)."""


@dataclass(eq=False, repr=False)
class CaaAdd(ResidualEdit):
    """Add `vector` to the residual entering `layer` at absolute positions `>= from_position`.

    Attributes:
        vector: `[d_model]` fp32 (already times the coefficient).
        from_position: first steered absolute position (padded coordinates, >= 0).
    """

    vector: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    from_position: int = 0

    def is_identity(self) -> bool:
        return not bool(self.vector.any())

    def apply(self, x: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
        first = max(0, self.from_position - call.q_offset)
        if first >= x.shape[1]:
            return None
        out = x.clone()
        out[:, first:] = x[:, first:] + self.vector.to(device=x.device, dtype=x.dtype)
        return out


def _peak(vector: torch.Tensor, coefficient: float) -> float:
    """`max |coefficient * vector|`, in float64 (finite for any finite float32 vector)."""
    return abs(float(coefficient)) * float(vector.abs().max())


def _check_peak(peak: float, limit: float, why: str) -> None:
    if not peak <= limit:
        raise HeadsteerValueError(
            f"CAA coefficient x vector reaches {peak:.3g}, more than {limit:.3g} ({why}); "
            "use a smaller coefficient or vector"
        )


def _check_layer(model: HeadModel, layer: object) -> int:
    layer = check_int("CAA layer", layer, type_error=True)
    if not 0 <= layer < model.n_layers - 1:
        raise HeadsteerValueError(
            f"CAA layer {short_repr(layer)} is outside 0..{model.n_layers - 2} (the output of layer L is "
            "the input "
            "of layer L + 1; the last layer has none)"
        )
    return layer


def _check_pairs(pairs: object) -> list[tuple[str, str]]:
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence) or not pairs:
        raise HeadsteerValueError(
            f"pairs must be a non-empty list of (positive, negative) strings, got {short_repr(pairs)}"
        )
    out = []
    for i, p in enumerate(pairs):
        ok = isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(s, str) and s for s in p)
        if not ok:
            raise HeadsteerValueError(f"pairs[{i}] must be two non-empty strings, got {short_repr(p)}")
        out.append((p[0], p[1]))
    return out


@torch.no_grad()
def _last_residuals(model: HeadModel, enc: EncodedPrompts, layer: int) -> torch.Tensor:
    """`[B, d_model]` fp32 output of block `layer` at each row's last token (left padding)."""
    rec = ResidualRecorder(layer=layer + 1, fn=lambda x, call: x[:, -1].float().clone())
    with editing(model, [rec]):
        forward(model, enc, logits_to_keep=1)
    last: torch.Tensor = rec.records[0].cpu()
    return last


def caa_vector(
    model: HeadModel,
    pairs: Sequence[tuple[str, str]],
    layer: int,
    *,
    chat: bool = False,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> torch.Tensor:
    """The CAA steering vector: mean over pairs of the last-token residual difference.

    Args:
        model: a `HeadModel` with a tokenizer.
        pairs: `(positive, negative)` prompt strings (used as given; `chat=True` renders each as
            one user message with the model's chat template).
        layer: the decoder block whose output is read (0 .. n_layers - 2).
        options: `heads.SweepOptions`: `max_rows` rows per forward (each pair is two rows, so
            `max_rows // 2` pairs; without options 8 pairs; rows are left-padded, so the last
            position is every row's last token), `progress` (True: a bar over pairs, False /
            None, or `progress(done, total)`) and `max_memory` (fewer pairs per forward where the
            plan needs it; refused before any forward when one pair does not fit).
        **deprecated: `batch_size=` (pairs per forward) and `progress=` as keywords (one
            release; a `DeprecationWarning`).

    Returns:
        `[d_model]` fp32 vector on the CPU.

    Raises:
        ValueError: empty or malformed pairs, a layer outside 0 .. n_layers - 2, bad batch_size.
    """
    batch_size = deprecated.pop("batch_size", None)
    opts = sweep_options(options, deprecated, "caa_vector", takes=("max_rows", "progress", "max_memory"))
    if batch_size is not None:
        warnings.warn(
            "caa_vector(batch_size=) is deprecated: pass options=SweepOptions(max_rows=2 * batch_size) "
            "(two rows per pair; the keyword is removed in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        batch_size = check_int("batch_size", batch_size, lo=1)
    elif options is None:
        batch_size = 8
    else:
        batch_size = max(1, opts.max_rows // 2)
    layer = _check_layer(model, layer)
    items = _check_pairs(pairs)
    if opts.max_memory is not None:  # two rows per pair, at most the longest text's length
        longest = encode_prompts(
            model.tokenizer, [t for p in items for t in p], chat=chat, markup=False
        ).length
        opts.check_run(model, longest, batch=2)
        batch_size = max(1, opts.replace(max_rows=2 * batch_size).within(model, longest).max_rows // 2)
    total = torch.zeros(model.d_model, dtype=torch.float64)
    with progress_callback(opts.progress, "CAA vector", "pairs") as report:
        for a in range(0, len(items), batch_size):
            chunk = items[a : a + batch_size]
            texts = [p for p, _ in chunk] + [n for _, n in chunk]
            enc = encode_prompts(model.tokenizer, texts, chat=chat, markup=False)
            h = _last_residuals(model, enc, layer).double()
            total += (h[: len(chunk)] - h[len(chunk) :]).sum(0)
            if report is not None:
                report(a + len(chunk), len(items))
    return (total / len(items)).float()


@dataclass(frozen=True)
class Caa:
    """Add `coefficient * vector` to the residual output of decoder block `layer`.

    Args:
        vector: `[d_model]` steering vector (e.g. from `caa_vector` / `Caa.from_pairs`).
        layer: the decoder block whose output is steered (0 .. n_layers - 2).
        coefficient: multiplier (default 1; the paper sweeps -2 .. 2); 0 is a bitwise no-op.
        from_position: first steered position of the padded prompt; negative counts from the
            prompt's end (default -1: the last prompt token, then every generated token);
            None: every position.

    Raises:
        TypeError: a layer or position that is not an int.
        ValueError: a vector that is not 1-D, not floating point or holds NaN/inf, a coefficient
            that is not finite or beyond +-1e4, `|coefficient * vector|` above `MAX_ENTRY`
            (about 1.8e19); when applied, a vector length other than d_model, a layer outside
            0 .. n_layers - 2, a `|coefficient * vector|` entry beyond the model dtype's range
            (e.g. 65504 in float16), or a position before the prompt.

    Source: Rimsky et al. 2024, §3 (mean difference at the answer token; added at every
    position after the prompt).
    """

    vector: torch.Tensor
    layer: int
    coefficient: float = 1.0
    from_position: int | None = -1

    def __post_init__(self) -> None:
        raw = torch.as_tensor(self.vector).detach()
        if not raw.is_floating_point():  # an int / bool vector is a wrong file or a mask, not a direction
            raise HeadsteerValueError(
                f"CAA vector must be floating point, got dtype {_dtype_name(raw.dtype)}"
            )
        if raw.ndim != 1 or not len(raw):
            raise HeadsteerValueError(f"CAA vector must be 1-D [d_model], got shape {tuple(raw.shape)}")
        if not torch.isfinite(raw).all():
            raise HeadsteerValueError("CAA vector holds NaN or inf")
        v = raw.float().cpu()
        if not torch.isfinite(v).all():  # a float64 value beyond float32's range
            big = float(raw.double().abs().max())
            raise HeadsteerValueError(f"CAA vector holds {big:.3g}, beyond float32's range (3.4e38)")
        c = self.coefficient
        if isinstance(c, bool) or not is_number(c) or not math.isfinite(c) or abs(c) > MAX_FACTOR:
            raise HeadsteerValueError(
                f"CAA coefficient must be a finite number within +-{MAX_FACTOR:g}, got {short_repr(c)}"
            )
        _check_peak(_peak(v, c), MAX_ENTRY, "the next layer's norm would square it past float32's range")
        check_int("CAA layer", self.layer, type_error=True)
        p = self.from_position
        if p is not None and (not is_int(p)):
            raise HeadsteerTypeError(f"from_position must be an int or None, got {short_repr(p)}")
        object.__setattr__(self, "vector", v)
        if c == 0 or not bool(v.any()):
            warn_noop("CAA with coefficient 0 or a zero vector is a no-op: output equals the unsteered model")

    @classmethod
    def from_pairs(
        cls,
        model: HeadModel,
        pairs: Sequence[tuple[str, str]],
        layer: int,
        coefficient: float = 1.0,
        *,
        from_position: int | None = -1,
        chat: bool = False,
        options: SweepOptions | None = None,
        **deprecated: Any,
    ) -> Caa:
        """`Caa(caa_vector(model, pairs, layer, ...), layer, coefficient)` (see `caa_vector`;
        `batch_size=` / `progress=` are deprecated keywords for `options=SweepOptions(...)`)."""
        v = caa_vector(model, pairs, layer, chat=chat, options=options, **deprecated)
        return cls(v, layer, coefficient, from_position)

    def check(self, model: HeadModel) -> int:
        """The layer, after checking it and the vector length against `model`.

        Raises:
            ValueError: a layer outside 0 .. n_layers - 2, a vector length other than d_model,
                a `|coefficient * vector|` entry beyond the largest value of the model's dtype.
        """
        layer = _check_layer(model, self.layer)
        if self.vector.shape[0] != model.d_model:
            raise HeadsteerValueError(
                f"CAA vector has length {self.vector.shape[0]}, the model's d_model is {model.d_model}"
            )
        dtype = model.dtype
        if dtype.is_floating_point:
            top = float(torch.finfo(dtype).max)
            _check_peak(_peak(self.vector, self.coefficient), top, f"the largest {_dtype_name(dtype)} value")
        return layer

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[CaaAdd]:
        """One `CaaAdd` on the input of layer `layer + 1` (none when the coefficient is 0)."""
        layer = self.check(model)
        if self.coefficient == 0 or not bool(self.vector.any()):
            return []
        p = self.from_position
        start = 0 if p is None else (p if p >= 0 else enc.length + p)
        if start < 0:
            raise HeadsteerValueError(
                f"from_position {short_repr(p)} is before the prompt start (length {enc.length})"
            )
        return [CaaAdd(layer=layer + 1, vector=float(self.coefficient) * self.vector, from_position=start)]

    def __repr__(self) -> str:
        return f"Caa(layer={self.layer}, coefficient={self.coefficient}, from_position={self.from_position})"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > MAX_NAME:
        raise HeadsteerValueError(
            f"CAA vector name must be 1..{MAX_NAME} letters, digits, '_', '.' or '-', got {short_repr(name)}"
        )
    return name


def save_caa_vectors(path: str | os.PathLike, vectors: Mapping[str, Caa], *, overwrite: bool = False) -> Path:
    """Write named CAA vectors to one safetensors file (atomic; `overwrite` to replace a file).

    Each vector is stored as a `[d_model]` fp32 tensor under its name, its `layer` in the file's
    metadata (`"layer.<name>"`); the coefficient and `from_position` are not stored (a user of the
    file picks them). Read back with `load_caa_vectors`; `headsteer serve --caa-vector FILE` serves them.

    Returns:
        the path written.

    Raises:
        ValueError: no vectors, more than `MAX_VECTORS`, a bad name (letters, digits, `_ . -`),
            a value that is not a `Caa`; see `heads._util.files.check_output` for the path.
    """
    from safetensors.torch import save

    from heads._util.files import write_bytes

    if not isinstance(vectors, Mapping) or not vectors or len(vectors) > MAX_VECTORS:
        raise HeadsteerValueError(f"vectors must map 1..{MAX_VECTORS} names to Caa objects")
    tensors, meta = {}, {"format": "headsteer-caa"}
    for name, caa in vectors.items():
        _check_name(name)
        if not isinstance(caa, Caa):
            raise HeadsteerTypeError(f"vectors[{short_repr(name)}] must be a Caa, got {type(caa).__name__}")
        tensors[name] = caa.vector.contiguous()
        meta[f"layer.{name}"] = str(caa.layer)
    return write_bytes(path, save(tensors, metadata=meta), overwrite=overwrite)


def load_caa_vectors(path: str | os.PathLike) -> dict[str, Caa]:
    """Named `Caa`s (coefficient 1) from a file written by `save_caa_vectors`.

    Safetensors only (no pickle is ever read). Every vector is checked as stored (never cast
    first): floating point (an int or bool tensor is refused by its dtype's name), 1-D, finite,
    every entry within `MAX_ENTRY`, with an integer layer in the metadata.

    Raises:
        ValueError: a missing or unreadable file, not a headsteer CAA file, more than
            `MAX_VECTORS` vectors, a bad name, a vector that is not floating point, not 1-D,
            not finite, beyond `MAX_ENTRY` or has no layer.
    """
    from safetensors import safe_open

    from heads._util.files import is_file, short_path

    if not is_file(path):
        raise HeadsteerValueError(f"CAA vector file {short_path(path)} is not a file")
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            meta = f.metadata() or {}
            names = list(f.keys())
            if meta.get("format") != "headsteer-caa":
                raise HeadsteerValueError(
                    f"{short_path(path)} is not a headsteer CAA vector file (write it with save_caa_vectors)"
                )
            if not names or len(names) > MAX_VECTORS:
                raise HeadsteerValueError(
                    f"{short_path(path)} holds {len(names)} vectors, not 1..{MAX_VECTORS}"
                )
            tensors = {n: f.get_tensor(n) for n in names}
    except HeadsteerValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parse failure of the file is one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise HeadsteerValueError(f"CAA vector file {short_path(path)} cannot be read: {first}") from None
    out = {}
    for name, v in tensors.items():
        _check_name(name)
        layer = meta.get(f"layer.{name}", "")
        if not re.fullmatch(r"\d{1,6}", layer):
            raise HeadsteerValueError(
                f"CAA vector {short_repr(name)} in {short_path(path)} has no integer layer"
            )
        try:
            out[name] = Caa(v, int(layer))  # checked in its own dtype
        except ValueError as exc:
            raise HeadsteerValueError(f"CAA vector {short_repr(name)} in {short_path(path)}: {exc}") from None
    return out
