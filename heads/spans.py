"""Deprecated alias of `heads.inputs.spans` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from heads.inputs.spans import *  # noqa: F403
from heads.inputs.spans import __all__  # noqa: F401

warnings.warn(
    "heads.spans moved to heads.inputs.spans; import it from there (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
