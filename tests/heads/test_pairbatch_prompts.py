"""`record`, `run_with_hooks` and `qk_attribution` take a `PairBatch` as their clean prompts
(`pairs.corrupted` for the other side), equal to passing the clean prompts' own encoding."""

from __future__ import annotations

import pytest
import torch

from heads import qk_attribution, record, run_with_hooks
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import encode_prompts
from heads.scorers.patching.pairs import encode_pairs
from tests.support.patching import PAIRS


def test_pairbatch_is_its_clean_prompts(tiny_llama):
    model = tiny_llama
    pairs = encode_pairs(model.tokenizer, PAIRS)  # two lengths: left padding
    clean = encode_prompts(model.tokenizer, [p.clean for p in PAIRS], chat=False, markup=False)
    assert torch.equal(clean.input_ids, pairs.clean_ids) and torch.equal(
        clean.attention_mask, pairs.attention_mask
    )
    names = ["blocks.1.hook_resid_pre", "blocks.1.attn.hook_pattern"]
    got, want = record(model, pairs, names), record(model, clean, names)
    for n in names:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    corrupted = encode_prompts(model.tokenizer, [p.corrupted for p in PAIRS], chat=False, markup=False)
    torch.testing.assert_close(
        record(model, pairs.corrupted, names).logits, record(model, corrupted, names).logits
    )
    torch.testing.assert_close(run_with_hooks(model, pairs), run_with_hooks(model, clean), rtol=0, atol=0)
    a = qk_attribution(model, pairs, (1, 0))
    b = qk_attribution(model, clean, (1, 0))
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0, equal_nan=True)  # NaN: padding
    with pytest.raises(HeadsteerValueError, match="which must be 'clean' or 'corrupted'"):
        pairs.prompts("both")
