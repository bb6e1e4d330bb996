"""Waiting on an observable state in tests (never on a fixed time)."""

from __future__ import annotations

import time
from collections.abc import Callable

LIMIT_S = 120.0
"""The longest a test waits for a state: only a broken build reaches it (the wait ends as soon as
the state holds), so it is generous for a loaded 2-core machine."""


def wait_until(
    predicate: Callable[[], object], what: str, limit_s: float = LIMIT_S, poll_s: float = 0.01
) -> None:
    """Return as soon as `predicate()` is true; fail the test naming `what` after `limit_s`."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"never happened within {limit_s:.0f} s: {what}"
        time.sleep(poll_s)
