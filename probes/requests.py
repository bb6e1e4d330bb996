"""Deprecated alias of `probes.datasets.requests` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from probes.datasets.requests import *  # noqa: F403
from probes.datasets.requests import __all__  # noqa: F401

warnings.warn(
    "probes.requests moved to probes.datasets.requests; import it from there"
    " (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
