"""Fixtures of the CLI tests."""

from __future__ import annotations

import pytest


@pytest.fixture()
def no_load(monkeypatch):
    """Loading the model fails the test: the command must stop before it."""
    import heads

    def boom(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(heads, "load_model", boom)
