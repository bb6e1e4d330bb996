"""Two threads calling `SteeredModel.generate` on one model answer as one thread does, on every
backend (nnsight's tracing is serialised per model)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from heads import load_model
from steer import Pasta, SteeredModel

PROMPTS = ["the key is **blue** and", "a **red** door"]


@pytest.mark.parametrize("backend", ["hf", "nnsight"])
def test_two_threads_match_one(tiny_llama_dir, backend):
    pytest.importorskip("nnsight") if backend == "nnsight" else None
    hm = load_model(tiny_llama_dir, backend=backend)
    sm = SteeredModel(hm)
    steer = Pasta(heads={"1": [0, 2]}, alpha=0.01)

    def one(prompt):
        return sm.generate(prompt, steer, max_new_tokens=4, chat=False, progress=False).token_ids

    alone = [one(p) for p in PROMPTS * 2]
    with ThreadPoolExecutor(2) as ex:
        both = list(ex.map(one, PROMPTS * 2))
    assert both == alone
