"""`needle_pairs` rebuilds the task `k` tokens shorter when the codes share a start (SmolLM2: one
bare space); its refusals name the length the caller gave and a minimum that works (the rebuilt
task's own error once leaked: a length never given, a minimum equal to the length just given)."""

from __future__ import annotations

import string

import pytest

from heads.errors import HeadsteerValueError
from probes.datasets.needle import MIN_LENGTH
from probes.datasets.needle_pairs import needle_pairs


def test_min_length_is_accepted_or_refused_naming_the_given_length(tokenizer):
    """Docstring: length MIN_LENGTH..MAX_LENGTH. Observed with SmolLM2's tokenizer:
    HeadsteerValueError 'length must be an int in 64..1048576, got 63' for length=64."""
    try:
        pairs = needle_pairs(tokenizer, MIN_LENGTH)
    except HeadsteerValueError as e:
        assert f"got {MIN_LENGTH}" in str(e), str(e)
    else:
        assert pairs.width == MIN_LENGTH


def _char_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(set(string.printable)))}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[])))


def test_too_short_error_does_not_ask_for_the_length_just_given():
    """A character-level tokenizer (no BOS; ' 7311' -> 5 tokens, shared start ' '): length 149
    is refused with 'length 148 leaves no room for a haystack: give at least 149'."""
    tok = _char_tokenizer()
    with pytest.raises(HeadsteerValueError) as info:
        needle_pairs(tok, 148)
    msg = str(info.value)
    assert "length 148" in msg  # fine here: the caller gave 148
    try:
        needle_pairs(tok, 149)
    except HeadsteerValueError as e:
        assert "length 149" in str(e) and "at least 149" not in str(e), str(e)
