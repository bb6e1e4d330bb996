"""headsteer's exceptions: user errors are `HeadsteerError`s, everything else is a bug.

* `HeadsteerValueError` (also a `ValueError`): a bad value the caller can change — an unknown
  layer or head, a span not in the text, an empty prompt, a non-finite parameter, a refused
  model family. The message names the bad value.
* `HeadsteerTypeError` (also a `TypeError`): an argument of the wrong type.
* `EditNeverFired` (also a `RuntimeError`): an edit was installed but the model never ran it.
* `MissingDependency` (also an `ImportError`): an optional extra (Ray, ...) is not installed.

Catching the built-in base (`except ValueError`) keeps working. The CLI prints a
`HeadsteerError` as one line and exits 2; any other exception is reported as a bug, one
`internal error: ...` line and exit 1 (its traceback with `headsteer --debug` or `HEADSTEER_DEBUG=1`).
"""

from __future__ import annotations

__all__ = [
    "EditNeverFired",
    "HeadsteerError",
    "HeadsteerTypeError",
    "HeadsteerValueError",
    "MissingDependency",
]


class HeadsteerError(Exception):
    """Base of every error headsteer raises on purpose (bad input, refused model, idle edit)."""


class HeadsteerValueError(HeadsteerError, ValueError):
    """A bad value the caller can change; the message names the value."""


class HeadsteerTypeError(HeadsteerError, TypeError):
    """An argument of the wrong type; the message names the argument and the type it got."""


class EditNeverFired(HeadsteerError, RuntimeError):
    """An edit was installed but the model never ran it (e.g. wrong layer, no forward)."""


class MissingDependency(HeadsteerError, ImportError):
    """An optional dependency (an extra such as `headsteer[ray]`) is not installed; the message says how."""
