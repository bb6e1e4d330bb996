"""The skip allow-list: a test run fails on any skip whose reason is not on it.

A skipped test checks nothing, and a skip that happens everywhere (a reference that exists on
one machine only, a missing optional package, a browser not installed) hides a hole in the
suite. Only the skips that cannot run on the machine at hand are allowed: the CUDA-only tests
on a CPU machine and the CPU-only ones on a CUDA run. `pytest -rs` (the project's default
options) lists every skip with its reason; `tests/conftest.py` fails the run on any other one.
Set `HEADSTEER_ALLOW_SKIPS=1` to only warn (a local run without the browser, say).
"""

from __future__ import annotations

ALLOWED_SKIPS = (
    "needs CUDA",  # tests/heads/test_caches.py (offloaded cache)
    "needs a CUDA device besides the CPU",  # tests/heads/test_device_map.py
    "flex_attention has a backward pass on CUDA",  # tests/heads/test_fused.py, on a CUDA run
    "the CPU threshold of kernel='auto'",  # tests/heads/test_fused.py, on a CUDA run
)
"""Substrings of the skip reasons allowed (the CUDA-only tests, the CPU-only ones on CUDA)."""


def skip_reason(report: object) -> str:
    """The reason of a skipped test or module report (`"Skipped: "` dropped)."""
    longrepr = getattr(report, "longrepr", None)
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return str(text).removeprefix("Skipped: ")


def unlisted_skip(report: object) -> str | None:
    """`"nodeid: reason"` for a skipped report whose reason is not on `ALLOWED_SKIPS`, else None
    (not skipped, an expected failure, or allowed)."""
    if not getattr(report, "skipped", False) or hasattr(report, "wasxfail"):
        return None
    reason = skip_reason(report)
    if any(allowed in reason for allowed in ALLOWED_SKIPS):
        return None
    return f"{getattr(report, 'nodeid', '?')}: {reason}"
