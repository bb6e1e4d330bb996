"""Deprecated alias of `probes.datasets.tasks` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from probes.datasets.tasks import *  # noqa: F403
from probes.datasets.tasks import __all__  # noqa: F401

warnings.warn(
    "probes.tasks moved to probes.datasets.tasks; import it from there (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
