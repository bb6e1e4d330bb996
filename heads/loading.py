"""Deprecated alias of `heads.model.loading` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from heads.model.loading import *  # noqa: F403
from heads.model.loading import __all__  # noqa: F401

warnings.warn(
    "heads.loading moved to heads.model.loading; import it from there (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
