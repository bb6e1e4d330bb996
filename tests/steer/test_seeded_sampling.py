"""Seeded sampling is per row: `SteeredModel.generate(seed=...)` gives a prompt the same sample
alone, at any position of a batch, and from threads, and leaves torch's global generator alone."""

import threading

import pytest
import torch

from steer import Pasta, SteeredModel
from steer.serving import BatchGenerator, SamplingParams, ServeRequest

HEADS = {"0": [1], "1": [0, 3]}
PROMPT = "Tell **me** a story"
OTHERS = ["Hi", "A much longer prompt about **rivers** and the sea and boats", "Why?"]


def _sample(sm, prompts, seed=7, **kw):
    kw.setdefault("max_new_tokens", 6)
    return sm.generate(prompts, steer=[Pasta(HEADS)], do_sample=True, seed=seed, chat=False, **kw).token_ids


def test_same_sample_alone_in_a_batch_and_after_other_draws(tiny_llama):
    sm = SteeredModel(tiny_llama)
    alone = _sample(sm, PROMPT)[0]
    assert len(alone) == 6
    for at in range(len(OTHERS) + 1):  # every position, different padding each time
        batch = OTHERS[:at] + [PROMPT] + OTHERS[at:]
        assert _sample(sm, batch)[at] == alone, at
    torch.manual_seed(123)  # the global generator's state plays no part
    torch.rand(1000)
    assert _sample(sm, PROMPT)[0] == alone
    assert _sample(sm, PROMPT, seed=8)[0] != alone  # the seed does


def test_seeded_sampling_leaves_the_global_generator(tiny_llama):
    sm = SteeredModel(tiny_llama)
    _keeps_global_generator(lambda: _sample(sm, [PROMPT, "Hi"]))


def test_same_sample_from_threads(tiny_llama):
    sm = SteeredModel(tiny_llama)
    alone = _sample(sm, PROMPT)[0]
    got: list = []
    errors: list = []

    def worker(i: int) -> None:
        try:
            for r in range(3):
                batch = [PROMPT] if (i + r) % 2 else [OTHERS[i % 3], PROMPT]
                got.append(_sample(sm, batch)[-1])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert got == [alone] * 18


def test_seeded_sampling_applies_the_warpers(tiny_llama):
    """top_k=1 is greedy; output_scores gives the warped scores (top_k finite entries per row)
    with the drawn token among them."""
    sm = SteeredModel(tiny_llama)
    greedy = sm.generate([PROMPT, "Hi"], steer=[Pasta(HEADS)], max_new_tokens=5, chat=False).token_ids
    assert _sample(sm, [PROMPT, "Hi"], top_k=1, max_new_tokens=5) == greedy
    g = sm.generate(
        [PROMPT, "Hi"],
        do_sample=True,
        seed=3,
        top_k=5,
        temperature=0.7,
        max_new_tokens=4,
        chat=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    scores = g.outputs.scores
    assert len(scores) == 4
    for step, s in enumerate(scores):
        assert (torch.isfinite(s).sum(-1) == 5).all()
        for b in range(2):
            assert torch.isfinite(s[b, g.token_ids[b][step]])


def test_seeded_sampling_refuses_other_decoding_modes(tiny_llama):
    sm = SteeredModel(tiny_llama)
    with pytest.raises(ValueError, match="plain sampling only.*assisted"):
        sm.generate(PROMPT, do_sample=True, seed=1, max_new_tokens=2, prompt_lookup_num_tokens=2)


def _keeps_global_generator(run) -> None:
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    run()
    assert torch.equal(torch.rand(4), expected)


def test_server_draws_per_request_and_leaves_the_global_generator(tiny_llama):
    """The server's batcher (the same `steer.sampling` generators): an unseeded request's seed
    comes from the OS, not torch's global generator; its rerun draws the same tokens."""
    gen = BatchGenerator(tiny_llama)
    request = ServeRequest("a b c", True, [], params=SamplingParams(max_tokens=4, temperature=1.0))
    got: list = []
    _keeps_global_generator(lambda: got.append(gen.run([gen.prepare(request)])[0].token_ids))
    p = gen.prepare(request)
    assert gen.run([p])[0].token_ids == gen.run([gen.prepare(ServeRequest("hi", True, [])), p])[1].token_ids


def test_fused_warm_up_leaves_the_global_generator(monkeypatch):
    import heads.engine.kernels.fused as fused

    monkeypatch.setattr(fused, "fused_attention", lambda *a, **k: None)  # the inputs, not the compile
    _keeps_global_generator(fused.warm_up)
