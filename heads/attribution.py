"""Deprecated alias of `heads.scorers.safety.attribution` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from heads.scorers.safety.attribution import *  # noqa: F403
from heads.scorers.safety.attribution import __all__  # noqa: F401

warnings.warn(
    "heads.attribution moved to heads.scorers.safety.attribution; import it from there"
    " (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
