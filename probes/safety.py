"""Deprecated alias of `probes.studies.safety` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from probes.studies.safety import *  # noqa: F403
from probes.studies.safety import __all__  # noqa: F401

warnings.warn(
    "probes.safety moved to probes.studies.safety; import it from there (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
