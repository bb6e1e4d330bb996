"""Deprecated alias of `heads.inputs.images` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from heads.inputs.images import *  # noqa: F403
from heads.inputs.images import __all__  # noqa: F401

warnings.warn(
    "heads.images moved to heads.inputs.images; import it from there (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
