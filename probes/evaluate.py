"""Deprecated alias of `probes.studies.evaluate` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from probes.studies.evaluate import *  # noqa: F403
from probes.studies.evaluate import __all__  # noqa: F401

warnings.warn(
    "probes.evaluate moved to probes.studies.evaluate; import it from there"
    " (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
