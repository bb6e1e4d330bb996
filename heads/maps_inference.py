"""Deprecated alias of `heads.scorers.maps.inference` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from heads.scorers.maps.inference import *  # noqa: F403
from heads.scorers.maps.inference import __all__  # noqa: F401

warnings.warn(
    "heads.maps_inference moved to heads.scorers.maps.inference; import it from there"
    " (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
