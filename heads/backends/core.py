"""Backends: the library a `HeadModel`'s forwards run through, and where its edits go.

A TransformerLens `TransformerBridge` (TransformerLens 4.x) and an nnsight model
(`TransformersModel`, or its older name `LanguageModel`) both wrap a real `transformers` model.
headsteer keeps one `HeadModel` over that model and a backend object, built from the Hugging
Face module, its family and the object handed over, that says how a forward runs and where each
engine site goes:

* `"hf"` (`heads.backends.hf`) — the base: forwards call the model; attention edits run in
  headsteer's attention function (`AttentionInterface` + mask function), the other sites in
  torch hooks on the model's modules.
* `"transformer_lens"` (`heads.backends.transformer_lens`) — the bridge's hook points carry the
  sites; weight processing (LayerNorm folding, centering) must be off.
* `"nnsight"` (`heads.backends.nnsight`) — the HF model runs unchanged inside nnsight's
  `trace()` / `generate()`, with the HF placements; `remote=True` runs traces on NDIF, where
  edits cannot run.

Both libraries are imported lazily: `import heads` does not load them. A new backend is one
module with a `heads.backends.base.Backend` subclass and one entry in `REGISTRY`.
"""

from __future__ import annotations

import os
from typing import Any

from heads._util.validation import check_bool
from heads.backends.base import Backend
from heads.backends.hf import HFBackend
from heads.backends.nnsight import NNsightBackend
from heads.backends.transformer_lens import TransformerLensBackend
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.families import family_of

__all__ = [
    "BACKENDS",
    "REGISTRY",
    "Backend",
    "HFBackend",
    "NNsightBackend",
    "TransformerLensBackend",
    "backend_kind",
    "make_backend",
]

REGISTRY: dict[str, type[Backend]] = {
    "transformer_lens": TransformerLensBackend,
    "nnsight": NNsightBackend,
    "hf": HFBackend,  # last: a bridge or nnsight model is also an nn.Module with a config
}
"""Backend name -> class, asked in order which one runs a given object (`Backend.detect`)."""

BACKENDS = ("hf", "transformer_lens", "nnsight")
"""Names accepted by `load_model(..., backend=)`."""


def backend_kind(obj: object) -> str | None:
    """`"transformer_lens"`, `"nnsight"` or `"hf"` for a bridge, an nnsight model or a HF model; else None."""
    return next((name for name, cls in REGISTRY.items() if cls.detect(obj)), None)


def make_backend(obj: object, *, remote: bool = False) -> tuple[Backend, Any]:
    """`(backend, tokenizer or None)` for a HF model, bridge or nnsight model.

    The family is read from the Hugging Face model's config (`heads.model.families.family_of`)
    and the backend resolves the model's parts (`heads.model.parts.ModelParts`).

    Raises:
        TypeError: `obj` is none of these (names its type).
        ValueError: a family headsteer does not support; a bridge with processed weights;
            `remote=True` for a non-nnsight model; a model without the modules its family names.
    """
    check_bool("remote", remote, what="a bool")
    kind = backend_kind(obj)
    if remote and kind != "nnsight":
        raise HeadsteerValueError(
            f"remote=True is an nnsight option; got a {kind or type(obj).__name__} model"
        )
    if kind is None:
        hint = (
            f"; to load {obj!r} use heads.load_model({obj!r})" if isinstance(obj, str | os.PathLike) else ""
        )
        raise HeadsteerTypeError(
            f"cannot wrap a {type(obj).__module__}.{type(obj).__name__}: expected a transformers causal LM "
            f"(PreTrainedModel), a TransformerLens TransformerBridge or an nnsight TransformersModel / "
            f"LanguageModel{hint}"
        )
    cls = REGISTRY[kind]
    module, tokenizer = cls.unwrap(obj)
    family = family_of(getattr(module, "config", None))  # ValueError for a refused family, before any change
    native = None if kind == "hf" else obj
    options = {"remote": True} if remote else {}  # checked above: only the nnsight backend takes it
    return cls(module, family, native, **options), tokenizer
