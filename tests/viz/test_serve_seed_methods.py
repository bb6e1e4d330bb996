"""`headsteer serve` with pattern injection and the head-specific visual modulation (text variant):
each request's answer equals `SteeredModel.generate`, alone and batched with other requests; CARVE
(which needs an image) and bad values are one-line refusals."""

from __future__ import annotations

import pytest
import torch

from heads.errors import HeadsteerValueError
from steer import PatternInjection, SteeredModel, VisualModulation
from steer.serving import BatchGenerator, SamplingParams, ServeRequest, parse_steer

PASSAGE = "Context: **the key is blue and the door is red.** The key is"


def _req(prompt: str, steer: list, n: int = 4) -> ServeRequest:
    return ServeRequest(prompt, False, steer, params=SamplingParams(max_tokens=n, temperature=0))


def _want(model, prompt: str, steer: list, n: int = 4) -> list[int]:
    out = SteeredModel(model).generate(
        prompt, steer, max_new_tokens=n, min_new_tokens=n, chat=False, progress=False
    )
    return [int(t) for t in out.token_ids[0]]


def test_served_equal_steered_model_alone_and_batched(tiny_llama):
    tpl = torch.rand(6, 6).tril().tolist()
    specs = [
        [{"method": "pattern_injection", "heads": {"1": [0, 2]}, "pattern": "same-sentence", "weight": 0.9}],
        [{"method": "modulation", "gamma": 4.0, "regions": 1}],
        [{"method": "pattern_injection", "heads": [[0, 1]], "pattern": tpl}],
        None,
    ]
    prompts = [PASSAGE, PASSAGE, "Tell me about the weather today.", "a short **one**"]
    steers = [parse_steer(s) for s in specs]
    assert isinstance(steers[0][0], PatternInjection) and isinstance(steers[1][0], VisualModulation)
    assert steers[1][0].target == "text" and steers[2][0].label == "template"
    wants = [_want(tiny_llama, p, s) for p, s in zip(prompts, steers, strict=True)]
    assert wants[0] != _want(tiny_llama, PASSAGE, [])  # the steering acts on this model and prompt
    gen = BatchGenerator(tiny_llama)
    prepared = [gen.prepare(_req(p, s)) for p, s in zip(prompts, steers, strict=True)]
    assert [gen.run([p])[0].token_ids for p in prepared] == wants
    assert [c.token_ids for c in gen.run(prepared)] == wants


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ([{"method": "carve"}], "this server takes text only"),
        ([{"method": "pattern_injection"}], "needs heads"),
        ([{"method": "pattern_injection", "heads": "auto"}], 'no "auto" heads'),
        ([{"method": "pattern_injection", "heads": [[0, 0]], "pattern": "next-token"}], "unknown pattern"),
        ([{"method": "pattern_injection", "heads": [[0, 0]], "pattern": [[1, 2]]}], "[T, T] list"),
        ([{"method": "pattern_injection", "heads": [[0, 0]], "weight": 0}], "no-op"),
        ([{"method": "modulation", "gamma": -2}], "gamma"),
        ([{"method": "modulation", "gamma": 0}], "no-op"),
        ([{"method": "modulation", "size": 3}], "unknown field"),
    ],
)
def test_bad_specs_raise_one_line(spec, needle):
    with pytest.raises(HeadsteerValueError, match=None) as err:
        parse_steer(spec)
    assert needle in str(err.value) and "\n" not in str(err.value)
