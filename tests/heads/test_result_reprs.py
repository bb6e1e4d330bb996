"""Result reprs are one short line (kind, shape, metric, pairs, layers), never the tensors."""

from __future__ import annotations

import torch

from heads import SweepOptions
from heads.scorers.circuits.scores import edge_scores
from heads.scorers.image_attention import ImageAttention
from heads.scorers.patching.activation import patch
from heads.scorers.patching.logit import direct_logit_attribution, logit_lens
from heads.scorers.patching.pairs import encode_pairs
from tests.support import make_tiny
from tests.support.patching import PAIRS

LIMIT = 300  # characters: a line or two, where the default dataclass repr printed every tensor


def test_result_reprs_are_short(tokenizer):
    model = make_tiny("llama", tokenizer)
    pairs = encode_pairs(tokenizer, PAIRS[:1])
    res = patch(model, pairs, "head_out", layers=[1, 2], options=SweepOptions(progress=False))
    r = repr(res)
    assert len(r) < LIMIT and "tensor(" not in r
    assert "'head_out'" in r and "n_pairs=1" in r and "layers=[1, 2]" in r and "'logit_diff'" in r
    for out in (
        direct_logit_attribution(model, pairs),
        logit_lens(model, pairs),
        edge_scores(model, pairs, method="eap", progress=False),
        ImageAttention(torch.rand(3, 64), torch.rand(3), (1, 65), (8, 8), 70),
    ):
        r = repr(out)
        assert len(r) < LIMIT and "tensor(" not in r, r
        assert r.startswith(type(out).__name__ + "(")


def test_lens_head_logits_only_when_asked(tokenizer):
    """`logit_lens` leaves the per-head logits None (as documented); `logit_inspection` fills them
    with `head_logits`' values."""
    from heads.scorers.patching.logit import head_logits, logit_inspection

    model = make_tiny("llama", tokenizer)
    pairs = encode_pairs(tokenizer, PAIRS[:1])
    assert logit_lens(model, pairs).head_answer is None
    insp = logit_inspection(model, pairs)
    ans, cf = head_logits(model, pairs)
    assert insp.head_answer is not None and insp.head_counterfactual is not None
    torch.testing.assert_close(insp.head_answer, ans)
    torch.testing.assert_close(insp.head_counterfactual, cf)
    assert "head_logits=True" in repr(insp) and "head_logits=False" in repr(logit_lens(model, pairs))
