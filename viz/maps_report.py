"""Deprecated alias of `viz.reports.maps` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from viz.reports.maps import *  # noqa: F403
from viz.reports.maps import __all__  # noqa: F401

warnings.warn(
    "viz.maps_report moved to viz.reports.maps; import it from there (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
