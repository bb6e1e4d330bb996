"""The pattern-injection study (probes.studies.pattern_injection), fast case on a tiny model."""

from __future__ import annotations

import pytest

from heads.engine.context import editing
from heads.scorers.roles.detectors import repeated_tokens
from probes.studies.pattern_injection import induction_accuracy, injection_effect
from steer.pattern_injection import PatternInjection
from tests.support import make_tiny


@pytest.fixture(scope="module")
def llama(tokenizer):
    return make_tiny("llama", tokenizer, num_hidden_layers=2)


def test_induction_accuracy_by_hand(llama):
    enc = repeated_tokens(llama, n_seqs=3, length=(4, 6), seed=1)
    acc = induction_accuracy(llama, enc)
    for b in range(enc.batch):
        real = enc.attention_mask[b].bool()
        ids = enc.input_ids[b][real]
        n = (len(ids) - 1) // 2  # [BOS] + R + R
        pred = llama.model(input_ids=ids[None]).logits[0].argmax(-1)
        want = (pred[len(ids) - n : -1] == ids[len(ids) - n + 1 :]).float().mean()
        assert float(acc[b]) == pytest.approx(float(want))


def test_injection_into_a_head_that_has_the_pattern_changes_nothing(llama):
    """A head planted as an exact previous-token head is discovered, and injecting the same pattern
    there leaves the task metric unchanged (delta exactly 0); the control run is reported."""
    planted = PatternInjection({0: [1]}, "previous-token")
    ev = repeated_tokens(llama, n_seqs=4, length=(7, 7), seed=1)  # no padding: the same geometry
    with editing(llama, planted.edits(llama, ev)):  # in the study's discovery and evaluation batches
        res = injection_effect(llama, n_seqs=4, discover_seqs=4, length=(7, 7), n_clusters=3, weights=(1.0,))
    assert "0" in res["heads"] and 1 in res["heads"]["0"]
    assert res["w=1"]["delta"] == 0.0
    assert 0 <= res["none"]["accuracy"] <= 1 and "delta" in res["control"]
    with pytest.raises(ValueError, match="weight"):
        injection_effect(llama, weights=(0.0,))
    with pytest.raises(ValueError, match="unknown pattern"):
        injection_effect(llama, pattern="induction")
