"""Deprecated alias of `viz.reports.base` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from viz.reports.base import *  # noqa: F403
from viz.reports.base import __all__  # noqa: F401

warnings.warn(
    "viz.report moved to viz.reports.base; import it from there (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
