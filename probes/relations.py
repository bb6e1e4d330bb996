"""Deprecated alias of `probes.datasets.relations` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from probes.datasets.relations import *  # noqa: F403
from probes.datasets.relations import __all__  # noqa: F401

warnings.warn(
    "probes.relations moved to probes.datasets.relations; import it from there"
    " (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
