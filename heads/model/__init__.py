"""The model adapter (`HeadModel`), the model-family table, the model's parts and loading.

`HeadModel` is loaded on first access, so that the leaves of this package (`families`, `parts`)
import without the adapter (the backends build on them and the adapter on the backends)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from heads.model.adapter import HeadModel

__all__ = ["HeadModel"]


def __getattr__(name: str) -> Any:
    if name == "HeadModel":
        from heads.model.adapter import HeadModel

        return HeadModel
    raise AttributeError(f"module 'heads.model' has no attribute {name!r}")
