"""Deprecated alias of `heads.scorers.safety.ships` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from heads.scorers.safety.ships import *  # noqa: F403
from heads.scorers.safety.ships import __all__  # noqa: F401

warnings.warn(
    "heads.ships moved to heads.scorers.safety.ships; import it from there"
    " (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
