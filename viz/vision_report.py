"""Deprecated alias of `viz.reports.vision` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from viz.reports.vision import *  # noqa: F403
from viz.reports.vision import __all__  # noqa: F401

warnings.warn(
    "viz.vision_report moved to viz.reports.vision; import it from there"
    " (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
