"""Fixtures of the viz tests (CLI, explorer)."""

from __future__ import annotations

import pytest


@pytest.fixture()
def no_load(monkeypatch):
    """Loading the model fails the test: the command must stop before it."""
    import heads

    def boom(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(heads, "load_model", boom)


@pytest.fixture(scope="module")
def model(tokenizer):
    """The explorer tests' model: a tiny random Llama (a module may define its own)."""
    from tests.support import make_tiny

    return make_tiny("llama", tokenizer)


@pytest.fixture(scope="module")
def client(model):
    """A FastAPI test client of the explorer on `model` (a module may define its own)."""
    from fastapi.testclient import TestClient

    from viz.explorer import create_explorer

    return TestClient(create_explorer(model))
