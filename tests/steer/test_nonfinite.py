"""A steered generation whose logits overflow the model's precision raises one clear error
naming the step and the edit (issue: fp16 `Ablate(eps=1e4)` answered an empty string)."""

from __future__ import annotations

import pytest
import torch

from heads import HeadOutputEdit
from steer import SteeredModel
from tests.support import make_tiny


class _Overflow(HeadOutputEdit):
    def apply(self, z, call):
        return z * 1e30  # inf in fp16 (and NaN once the norm sees it)


class _Steer:
    def edits(self, hm, enc):
        return [_Overflow(layer=1, heads=[0])]


def test_non_finite_steered_logits_are_an_error(tokenizer):
    hm = make_tiny("llama", tokenizer)
    hm.model.to(torch.float16)
    sm = SteeredModel(hm)
    with pytest.raises(
        ValueError, match=r"generation step 0: the logits became non-finite.*_Overflow\(layer=1"
    ):
        sm.generate(["Where is the key?"], _Steer(), max_new_tokens=3, chat=False, progress=False)
    ok = sm.generate(["Where is the key?"], max_new_tokens=3, chat=False, progress=False)  # unsteered: fine
    assert len(ok.token_ids[0]) >= 1


def test_ablate_eps_bound_follows_the_model_dtype(tokenizer):
    """`Ablate(eps=...)` is bounded by the dtype it is applied in: sqrt of the largest finite
    value (255 in float16), 1e4 in bfloat16 / float32; above it one error naming value and dtype."""
    from heads.engine.edits import MAX_FACTOR, max_factor
    from steer import Ablate

    assert max_factor(torch.float16) == int(torch.finfo(torch.float16).max ** 0.5) == 255
    assert max_factor(torch.bfloat16) == max_factor(torch.float32) == MAX_FACTOR
    hm = make_tiny("llama", tokenizer)
    sm = SteeredModel(hm)
    kw = dict(max_new_tokens=2, chat=False, progress=False)
    sm.generate(["Where is the key?"], Ablate({1: [0]}, eps=1e4), **kw)  # float32: accepted
    hm.model.to(torch.bfloat16)
    sm.generate(["Where is the key?"], Ablate({1: [0]}, eps=1e4), **kw)  # bfloat16: same range
    hm.model.to(torch.float16)
    with pytest.raises(ValueError, match=r"Ablate eps=10000 overflows float16: \|eps\| must be <= 255"):
        sm.generate(["Where is the key?"], Ablate({1: [0]}, eps=1e4), **kw)
    with pytest.raises(ValueError, match="eps=-300 overflows float16"):
        sm.generate(["Where is the key?"], Ablate({1: [0]}, method="sc", eps=-300.0), **kw)
    out = sm.generate(["Where is the key?"], Ablate({1: [0]}, eps=255.0), **kw)  # at the bound: runs
    assert len(out.token_ids[0]) >= 1
