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
