"""Deprecated alias of `heads.results.scores` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from heads.results.scores import *  # noqa: F403
from heads.results.scores import __all__  # noqa: F401

warnings.warn(
    "heads.scores moved to heads.results.scores; import it from there (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
