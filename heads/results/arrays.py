"""Tensors inside a result's JSON file: float32 little-endian bytes in base64, with dtype and shape.

`encode(t)` gives `{"dtype": "float32", "shape": [...], "data": "<base64>"}`; `decode(obj,
what, shape=...)` reads it back and checks what a reader relies on (the dtype, the shape, the
byte count), so a malformed file is one `ValueError` naming the field, never a crash later.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence

import numpy as np
import torch

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError

__all__ = ["decode", "encode"]

_DTYPES: dict[str, tuple[np.dtype, torch.dtype]] = {
    "float32": (np.dtype("<f4"), torch.float32),
    "bool": (np.dtype("u1"), torch.bool),
}


def encode(t: torch.Tensor) -> dict:
    """`t` as a JSON-safe object (float tensors as float32; bool tensors as bytes)."""
    if t.dtype == torch.bool:
        arr = t.detach().cpu().numpy().astype("u1")
        kind = "bool"
    else:
        arr = t.detach().float().cpu().numpy().astype("<f4")
        kind = "float32"
    return {"dtype": kind, "shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode("ascii")}


def decode(obj: object, what: str, shape: Sequence[int | None] | None = None) -> torch.Tensor:
    """The tensor `encode` wrote.

    Args:
        obj: the JSON object.
        what: the field's name, for messages.
        shape: the expected shape (None entries: any size), or None (any shape).

    Raises:
        ValueError: not an encoded tensor, an unknown dtype, bad base64, a byte count or shape
            that does not match (one line naming `what`).
    """
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise HeadsteerValueError(f"{what}: not an encoded tensor (dtype, shape, data)")
    kind, dims, data = obj["dtype"], obj["shape"], obj["data"]
    if kind not in _DTYPES:
        raise HeadsteerValueError(f"{what}: unknown dtype {short_repr(kind)}")
    if not isinstance(dims, list) or any(
        isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in dims
    ):
        raise HeadsteerValueError(f"{what}: shape must be a list of sizes, got {short_repr(dims)}")
    if shape is not None and (
        len(shape) != len(dims) or any(w is not None and w != g for w, g in zip(shape, dims, strict=True))
    ):
        raise HeadsteerValueError(f"{what}: shape {dims} is not {list(shape)}")
    if not isinstance(data, str):
        raise HeadsteerValueError(f"{what}: data must be a base64 string")
    try:
        raw = base64.b64decode(data.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise HeadsteerValueError(f"{what}: data is not base64") from None
    np_dtype, torch_dtype = _DTYPES[kind]
    n = int(np.prod(dims)) if dims else 1
    if len(raw) != n * np_dtype.itemsize:
        raise HeadsteerValueError(f"{what}: {len(raw)} bytes do not hold shape {dims}")
    arr = np.frombuffer(raw, dtype=np_dtype).reshape(dims).copy()
    return torch.from_numpy(arr).to(torch_dtype)
