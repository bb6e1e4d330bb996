"""Deprecated alias of `heads.scorers.maps.static` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from heads.scorers.maps.static import *  # noqa: F403
from heads.scorers.maps.static import __all__  # noqa: F401

warnings.warn(
    "heads.maps moved to heads.scorers.maps.static; import it from there"
    " (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
