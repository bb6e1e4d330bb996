"""`viz.web.body.read_body`: a declared Content-Length is read as ASCII digits, never as an
unbounded int (a 5,000-digit length is refused as too large, not an internal error)."""

from __future__ import annotations

import asyncio

import pytest

from viz.web.body import BodyTooLarge, read_body


class _Request:
    def __init__(self, length: str, body: bytes):
        self.headers = {"content-length": length}
        self._body = body

    async def stream(self):
        yield self._body


@pytest.mark.parametrize("length", ["9" * 5000, "1" + "0" * 30, "2048"])
def test_a_declared_length_above_the_limit_is_refused_before_reading(length):
    with pytest.raises(BodyTooLarge, match="larger than the limit of 1024 bytes"):
        asyncio.run(read_body(_Request(length, b"{}"), 1024))


@pytest.mark.parametrize("length", ["2", "\u00b9", "abc"])
def test_a_small_or_unreadable_declared_length_reads_the_body(length):
    assert asyncio.run(read_body(_Request(length, b"{}"), 1024)) == b"{}"
