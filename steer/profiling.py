"""Deprecated alias of `steer.pasta.profiling` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from steer.pasta.profiling import *  # noqa: F403
from steer.pasta.profiling import __all__  # noqa: F401

warnings.warn(
    "steer.profiling moved to steer.pasta.profiling; import it from there"
    " (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
