"""Deprecated alias of `heads.inputs.prompts` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from heads.inputs.prompts import *  # noqa: F403
from heads.inputs.prompts import __all__  # noqa: F401

warnings.warn(
    "heads.prompts moved to heads.inputs.prompts; import it from there (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
