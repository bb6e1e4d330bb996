"""The model adapter (`HeadModel`), the model-family table and loading."""

from heads.model.adapter import HeadModel

__all__ = ["HeadModel"]
