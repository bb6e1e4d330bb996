"""Every consumer of recorded patterns stitches all query blocks: a prompt longer than
`heads.engine.state.QUERY_BLOCK` (shrunk here to keep the test fast) gives the scores of one
block (issue: `sink_stats` on a prompt over 1,024 tokens read only the first block)."""

from __future__ import annotations

import pytest
import torch

import heads.engine.state as engine_state
from heads.scorers.attention_mass import head_pattern, span_attention
from heads.scorers.sinks import SinkRule, sink_stats

PROMPTS = [
    "Context: the sky is green today and the grass is blue. **Answer in one word.** What colour is the sky?",
    "Note: **the key is under the mat.** Where is the key? Think about it.",
]


def _both(monkeypatch, run):
    whole = run()
    monkeypatch.setattr(engine_state, "QUERY_BLOCK", 4)  # every prompt spans several blocks
    return whole, run()


def test_sink_stats_stitches_blocks(tiny_llama, monkeypatch):
    rule = SinkRule(rule="absolute", theta=0.05)
    whole, split = _both(monkeypatch, lambda: sink_stats(tiny_llama, PROMPTS, rule=rule, chat=False))
    for name in ("sink_mass", "first_mass", "n_sinks"):
        torch.testing.assert_close(
            getattr(split, name).scores, getattr(whole, name).scores, atol=1e-6, rtol=0
        )
    assert len(split.flagged) == len(whole.flagged) > 0


@pytest.mark.parametrize("query", ["last", "after_span"])
def test_span_attention_stitches_blocks(tiny_llama, monkeypatch, query):
    whole, split = _both(monkeypatch, lambda: span_attention(tiny_llama, PROMPTS, chat=False, query=query))
    torch.testing.assert_close(split.scores, whole.scores, atol=1e-6, rtol=0)


def test_head_pattern_stitches_blocks(tiny_llama, monkeypatch):
    whole, split = _both(monkeypatch, lambda: head_pattern(tiny_llama, PROMPTS[0], 1, 2, chat=False))
    assert split[0].shape == whole[0].shape and split[0].shape[0] == split[0].shape[1]
    torch.testing.assert_close(split[0], whole[0], atol=1e-6, rtol=0)
