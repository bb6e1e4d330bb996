"""Shared checks for `headsteer` CLI tests (CliRunner results)."""

from __future__ import annotations

from typing import Any


def one_line_error(r: Any, message: str, code: int = 2, ignore: tuple[str, ...] = ("loading ",)) -> None:
    """`r` exited with `code`, printed `message`, no traceback, and exactly one `error: ` line on
    stderr (lines starting with one of `ignore` aside)."""
    assert r.exit_code == code, r.output
    assert message in r.output, r.output
    assert "Traceback" not in r.output
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith(ignore)]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
