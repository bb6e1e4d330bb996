"""`python -m viz.cli`: the headsteer command line."""

import sys

from viz.cli import run

sys.exit(run())
