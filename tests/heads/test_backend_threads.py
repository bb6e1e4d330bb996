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


def test_nnsight_user_traces_do_not_interleave(tiny_llama_dir):
    """`hm.backend.trace()` blocks hold the model's engine lock: two threads' traces (each
    forward slowed by a hook) run one after the other, and each gets its own logits."""
    import threading
    import time

    import torch

    pytest.importorskip("nnsight")
    hm = load_model(tiny_llama_dir, backend="nnsight")
    events: list[tuple[str, str]] = []

    def pre(module, args, kwargs):
        events.append(("in", threading.current_thread().name))
        time.sleep(0.05)

    def post(module, args, kwargs, out):
        events.append(("out", threading.current_thread().name))

    ids = {n: torch.tensor([[1, 5 + n, 9, 12]]) for n in range(2)}
    with torch.no_grad():
        want = {n: hm.model(input_ids=ids[n]).logits for n in ids}
    h1 = hm.model.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = hm.model.register_forward_hook(post, with_kwargs=True)
    got = {}

    def one(n: int) -> None:
        for _ in range(2):
            with hm.backend.trace(ids[n]):
                out = hm.backend.native.output.save()
            got[n] = out.logits

    try:
        threads = [threading.Thread(target=one, args=(n,), name=f"t{n}") for n in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        h1.remove()
        h2.remove()
    assert len(events) == 8
    for a in range(0, 8, 2):  # every forward's in/out pair belongs to one thread
        assert events[a][0] == "in" and events[a + 1] == ("out", events[a][1]), events
    for n in ids:
        torch.testing.assert_close(got[n], want[n])
