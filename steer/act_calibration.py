"""Deprecated alias of `steer.act.calibration` (moved in 0.2.0; this alias goes in 0.3.0)."""

import warnings

from steer.act.calibration import *  # noqa: F403
from steer.act.calibration import __all__  # noqa: F401

warnings.warn(
    "steer.act_calibration moved to steer.act.calibration; import it from there"
    " (this alias goes in headsteer 0.3.0)",
    DeprecationWarning,
    stacklevel=2,
)
