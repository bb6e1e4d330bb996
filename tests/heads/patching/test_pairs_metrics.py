"""Prompt pairs and metrics: alignment, padding, single tokens, metric values, normalisation."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from heads.scorers.patching.metrics import ZeroGapWarning, get_metric, normalise, zero_gap
from heads.scorers.patching.pairs import PromptPair, encode_pairs, load_pairs, pairs_from_tokens, token_id

IOI = PromptPair(
    "When Mary and John went to the store, John gave a drink to",
    "When Mary and John went to the store, Mary gave a drink to",
    " Mary",
    " John",
)
SHORT = PromptPair(
    "Then Mary and John left. John thanked", "Then Mary and John left. Mary thanked", " Mary", " John"
)


def test_encode_left_pads_and_aligns(tokenizer):
    b = encode_pairs(tokenizer, [IOI, SHORT])
    assert b.clean_ids.shape == b.corrupted_ids.shape == b.attention_mask.shape
    lens = [len(tokenizer(p.clean)["input_ids"]) for p in (IOI, SHORT)]
    assert b.lengths.tolist() == lens
    short = b.width - lens[1]
    assert (b.attention_mask[1, :short] == 0).all() and (b.attention_mask[1, short:] == 1).all()
    assert b.clean_ids[1, short:].tolist() == tokenizer(SHORT.clean)["input_ids"]
    # the two rows differ only at the S2 name
    diff = (b.clean_ids != b.corrupted_ids).nonzero().tolist()
    assert len(diff) == 2 and all(b.attention_mask[r, c] == 1 for r, c in diff)
    assert b.answers[:, 0].tolist() == [tokenizer(" Mary")["input_ids"][0]] * 2
    assert b.position_labels(1)[:short] == [""] * short
    sub = b.select([1])
    assert sub.width == lens[1] and sub.clean_ids[0].tolist() == tokenizer(SHORT.clean)["input_ids"]


def test_unequal_lengths_name_both(tokenizer):
    bad = PromptPair("When Mary went out", "When Mary and the cat went out", " Mary", " John")
    la, lb = (len(tokenizer(t)["input_ids"]) for t in (bad.clean, bad.corrupted))
    with pytest.raises(
        ValueError, match=f"pair 1: clean prompt is {la} tokens, corrupted prompt is {lb} tokens"
    ):
        encode_pairs(tokenizer, [IOI, bad])
    with pytest.raises(ValueError, match="clean prompt is 3 tokens, corrupted prompt is 2 tokens"):
        pairs_from_tokens([[1, 2, 3]], [[1, 2]], [5])


def test_single_token_check(tokenizer):
    multi = " Maryanne-Louise"
    with pytest.raises(ValueError, match="not one; pass first_token=True") as err:
        encode_pairs(tokenizer, [PromptPair(IOI.clean, IOI.corrupted, multi, " John")])
    # the pieces are shown readable (leading space as ␣), never byte-level (Ġ)
    first = tokenizer.decode(tokenizer(multi, add_special_tokens=False)["input_ids"][:1])
    assert "Ġ" not in str(err.value) and repr(first.replace(" ", "␣")) in str(err.value)
    b = encode_pairs(tokenizer, [PromptPair(IOI.clean, IOI.corrupted, multi, " John")], first_token=True)
    assert b.answers[0, 0] == tokenizer(multi, add_special_tokens=False)["input_ids"][0]
    assert token_id(tokenizer, 7) == 7
    with pytest.raises(ValueError, match="outside the vocabulary"):
        token_id(tokenizer, 10**9)


def test_load_pairs_jsonl(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    recs = [{**IOI.to_dict(), "split": "train"}, {**SHORT.to_dict(), "split": "test"}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert [p.clean for p in load_pairs(path, "test")] == [SHORT.clean]
    assert encode_pairs(tokenizer, path).n == 2
    path.write_text('{"clean": "a"}\n')
    with pytest.raises(ValueError, match="missing key"):
        load_pairs(path)


def _batch():
    return pairs_from_tokens([[1, 2, 3], [4, 5]], [[1, 2, 6], [4, 7]], [3, [5, 6]], [[6], [7]])


def test_metrics_values():
    b = _batch()
    logits = torch.randn(2, 10)
    idx = torch.arange(2)
    ld = get_metric()(logits, b, idx)
    assert torch.allclose(
        ld, torch.stack([logits[0, 3] - logits[0, 6], (logits[1, 5] + logits[1, 6]) / 2 - logits[1, 7]])
    )
    p = torch.softmax(logits, -1)
    assert torch.allclose(get_metric("prob")(logits, b, idx), torch.stack([p[0, 3], p[1, 5] + p[1, 6]]))
    assert torch.allclose(get_metric("log_prob")(logits, b, idx).exp(), get_metric("prob")(logits, b, idx))
    clean = torch.randn(2, 10)
    kl = get_metric("kl")(logits, b, idx, clean_logits=clean)
    want = torch.nn.functional.kl_div(
        torch.log_softmax(logits, -1), torch.log_softmax(clean, -1), log_target=True, reduction="none"
    ).sum(-1)
    assert torch.allclose(kl, want, atol=1e-6)
    assert get_metric("kl")(clean, b, idx, clean_logits=clean).abs().max() < 1e-6
    user = get_metric(lambda lg, pairs, i: lg[:, 0])
    assert torch.equal(user(logits, b, idx), logits[:, 0])
    with pytest.raises(ValueError, match="unknown metric"):
        get_metric("accuracy")
    with pytest.raises(ValueError, match="one value per row"):
        get_metric(lambda lg, pairs, i: lg)(logits, b, idx)


def test_normalise_and_zero_gap():
    clean, corrupt = torch.tensor([2.0, 1.0, 3.0]), torch.tensor([0.0, 1.0, -1.0])
    patched = torch.tensor([[1.0, 5.0, 3.0], [2.0, 1.0, -1.0]])
    with pytest.warns(ZeroGapWarning, match=r"pairs \[1\]"):
        d = normalise(patched, clean, corrupt, "denoising")
    assert d[0, 0] == 0.5 and d[1, 0] == 1.0 and d[0, 2] == 1.0 and math.isnan(d[0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        n = normalise(patched, clean, corrupt, "noising", warn=False)
    assert (
        n[0, 0] == 0.5
        and n[1, 2] == 1.0
        and torch.isnan(n[:, 1]).all()
        and torch.isfinite(n[:, [0, 2]]).all()
    )
    assert zero_gap(clean, corrupt).tolist() == [False, True, False]
    with pytest.raises(ValueError, match="direction"):
        normalise(patched, clean, corrupt, "both")


def test_pairs_of_token_ids_are_labelled_with_the_models_tokens(tokenizer, tiny_llama):
    """`pairs_from_tokens` without `tokens=` labelled positions by bare ids (`"504"`) in patching
    results and DLA (whose decoding ran only for pairs that had text): now the model's tokenizer
    decodes them; an id it does not know, or no tokenizer at all, reads `"id 504"`."""
    from heads.inputs.tokens import readable_tokens
    from heads.scorers.patching.activation import patch
    from heads.scorers.patching.logit import direct_logit_attribution

    clean = tokenizer("The cat sat on the", add_special_tokens=False)["input_ids"]
    corrupt = tokenizer("The dog sat on the", add_special_tokens=False)["input_ids"]
    pairs = pairs_from_tokens([clean, clean[1:]], [corrupt, corrupt[1:]], [262, 262], [263, 263])
    want = readable_tokens(tokenizer, clean)
    assert want[1] == "\u2423cat"  # readable text, not an id
    res = patch(tiny_llama, pairs, "resid_pre", metric="logit_diff", layers=[0])
    assert res.labels == want and res.params["labels_from"].startswith("pair 0's clean token ids (")
    assert direct_logit_attribution(tiny_llama, pairs).labels == want
    assert pairs.position_labels(1, tokenizer) == ["", *want[1:]]
    assert pairs.position_labels(0) == [f"id {i}" for i in clean]  # no tokenizer at hand
    big = len(tokenizer)
    odd = pairs_from_tokens([[clean[0], big]], [[corrupt[0], big]], [262])
    assert odd.position_labels(0, tokenizer) == [want[0], f"id {big}"]
