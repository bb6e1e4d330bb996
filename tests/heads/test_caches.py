"""Edits see real positions with every KV-cache class transformers offers (dynamic, static,
offloaded); the same edit object is never applied twice; spans need a fast tokenizer."""

from __future__ import annotations

import copy

import pytest
import torch

from heads import HeadScale, Recorder, editing, encode_prompts, forward
from heads.errors import EditNeverFired
from steer import Pasta
from steer.spotlight import Spotlight

PROMPT = "Note: **the key is under the mat.** Where is the key?"


@pytest.fixture(scope="module")
def enc(tokenizer):
    return encode_prompts(tokenizer, [PROMPT], chat=False)


def _generate(hm, enc, edits, cache: str | None):
    kw = {} if cache is None else {"cache_implementation": cache}
    with editing(hm, edits):
        out = hm.model.generate(
            enc.input_ids,
            attention_mask=enc.attention_mask,
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=2,
            **kw,
        )
    return out[:, enc.input_ids.shape[1] :]


CACHES = [
    "static",
    pytest.param("offloaded", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.mark.parametrize("cache", CACHES)
def test_cache_classes_give_real_positions(tiny_llama, enc, cache):
    rec = Recorder(layer=1, fn=lambda probs, call: (call.q_offset, call.q_len))
    _generate(tiny_llama, enc, [rec], cache)
    n = enc.input_ids.shape[1]
    assert rec.records[0] == (0, n)  # the prefill starts at 0, whatever the cache's slots
    assert [r[0] for r in rec.records[1:]] == list(range(n, n + len(rec.records) - 1))


CACHES = [
    "static",
    pytest.param("offloaded", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.mark.parametrize("cache", CACHES)
def test_steered_generation_is_the_same_with_every_cache(tiny_llama, enc, cache):
    def steer():
        return [
            *Pasta({"1": [0, 3]}, alpha=0.01).edits(tiny_llama, enc),
            *Spotlight(tau=0.5, granularity="layer").edits(tiny_llama, enc),
            HeadScale(layer=2, heads=[1], factor=0.0, positions=[3]),
        ]

    dynamic = _generate(tiny_llama, enc, steer(), None)
    assert torch.equal(_generate(tiny_llama, enc, steer(), cache), dynamic)


def test_the_same_edit_twice_is_refused(tiny_llama, enc):
    e = HeadScale(layer=1, heads=[0], factor=0.5)
    with pytest.raises(ValueError, match="listed twice"):
        with editing(tiny_llama, [e, e]):
            pass
    with editing(tiny_llama, e):
        with pytest.raises(ValueError, match="already active in an outer editing"):
            with editing(tiny_llama, e):
                pass
        forward(tiny_llama, enc)
    twin = HeadScale(layer=1, heads=[0], factor=0.5)  # an equal but distinct edit composes
    with editing(tiny_llama, [e, twin]):
        got = forward(tiny_llama, enc)
    with editing(tiny_llama, HeadScale(layer=1, heads=[0], factor=0.25)):
        assert torch.allclose(got, forward(tiny_llama, enc), atol=1e-5)


def test_never_fired_puts_the_hint_first(tiny_llama, monkeypatch):
    monkeypatch.setattr(type(tiny_llama.backend), "never_fired_hint", "HINT; ")
    edits = [HeadScale(layer=1, heads=[h % 4], factor=0.5, positions=[10_000 + h]) for h in range(8)]
    with pytest.raises(EditNeverFired) as info:
        with editing(tiny_llama, edits):
            pass
    msg = str(info.value)
    assert msg.startswith("HINT; 8 edit(s) never ran") and "(3 more)" in msg


def test_spans_with_a_slow_tokenizer_are_one_clear_error(tokenizer):
    slow = copy.copy(tokenizer)
    slow.__class__ = type("SlowTok", (type(tokenizer),), {"is_fast": property(lambda self: False)})
    with pytest.raises(ValueError, match="needs a fast tokenizer.*use_fast=True"):
        encode_prompts(slow, [PROMPT], chat=False)
    plain = encode_prompts(slow, ["no span here"], chat=False)  # no span: no offsets needed
    assert plain.input_ids.shape[0] == 1
