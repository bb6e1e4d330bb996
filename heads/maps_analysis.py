"""Deprecated alias of `heads.scorers.maps.analysis` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from heads.scorers.maps.analysis import *  # noqa: F403
from heads.scorers.maps.analysis import __all__  # noqa: F401

warnings.warn(
    "heads.maps_analysis moved to heads.scorers.maps.analysis; import it from there"
    " (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
