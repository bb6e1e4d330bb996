"""The edit engine: `editing()` and its sites, the edits, the kernels (blocked, fused), batched variants,
prefix reuse and the plain forward."""

from heads.engine import context as _context
from heads.engine.context import *  # noqa: F403  (the engine's public names: `context.__all__`)

__all__ = list(_context.__all__)
