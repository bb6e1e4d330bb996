"""Deprecated alias of `steer.vhr.trace` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from steer.vhr.trace import *  # noqa: F403
from steer.vhr.trace import __all__  # noqa: F401

warnings.warn(
    "steer.vhd_trace moved to steer.vhr.trace; import it from there (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
