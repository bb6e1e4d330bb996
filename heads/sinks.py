"""Deprecated alias of `heads.scorers.sinks` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from heads.scorers.sinks import *  # noqa: F403
from heads.scorers.sinks import __all__  # noqa: F401

warnings.warn(
    "heads.sinks moved to heads.scorers.sinks; import it from there (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
