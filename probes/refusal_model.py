"""Deprecated alias of `probes.studies.refusal_model` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from probes.studies.refusal_model import *  # noqa: F403
from probes.studies.refusal_model import __all__  # noqa: F401

warnings.warn(
    "probes.refusal_model moved to probes.studies.refusal_model; import it from there"
    " (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
