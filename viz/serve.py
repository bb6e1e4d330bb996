"""Deprecated alias of `viz.server.app` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from viz.server.app import *  # noqa: F403
from viz.server.app import __all__  # noqa: F401

warnings.warn(
    "viz.serve moved to viz.server.app; import it from there (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
