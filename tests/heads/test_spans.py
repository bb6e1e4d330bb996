"""Span mapping: markup, substrings, char -> token ranges (docs/methods/pasta.md: half-open offsets,
never BOS or pad)."""

import random

import pytest

from heads import Span, char_to_token_range, encode_prompts, find_span, parse_markup


def test_parse_markup():
    clean, spans = parse_markup("Read this. **Answer in JSON.** Then stop, **now**.")
    assert clean == "Read this. Answer in JSON. Then stop, now."
    assert [clean[a:b] for a, b in spans] == ["Answer in JSON.", "now"]


@pytest.mark.parametrize("bad", ["open **but never closed", "empty ****", "a ** ** b"])
def test_bad_markup(bad):
    with pytest.raises(ValueError):
        parse_markup(bad)


def test_find_span_occurrences_and_regions():
    text = "cat dog cat dog cat"
    assert find_span(text, "cat") == (0, 3)
    assert find_span(text, Span("cat", occurrence=2)) == (16, 19)
    assert find_span(text, "cat", regions=[(4, 19)]) == (8, 11)
    with pytest.raises(ValueError, match="'bird' not found"):
        find_span(text, "bird")
    with pytest.raises(ValueError, match="occurrence 3"):
        find_span(text, Span("cat", occurrence=3))


def test_span_validation():
    with pytest.raises(ValueError):
        Span("")
    with pytest.raises(ValueError):
        Span("x", occurrence=-1)


def _decoded(tok, enc, row=0, which=0):
    t0, t1 = enc.spans[row][which]
    return tok.decode(enc.input_ids[row, t0:t1])


def test_adjacent_punctuation_excluded(tokenizer):
    enc = encode_prompts(tokenizer, 'He said:"**JSON**". Done', chat=False)
    t0, t1 = enc.spans[0][0]
    assert _decoded(tokenizer, enc).strip() == "JSON"
    ids = enc.input_ids[0].tolist()
    assert '"' in tokenizer.decode(ids[t0 - 1 : t0]) and '"' in tokenizer.decode(ids[t1 : t1 + 1])


def test_span_at_character_zero_and_bos_excluded(tokenizer):
    enc = encode_prompts(tokenizer, "**Paris** is big.", chat=False)
    assert enc.spans[0][0][0] == 0 and _decoded(tokenizer, enc) == "Paris"
    # With the chat template the BOS-like <|im_start|> precedes it but is never included.
    enc = encode_prompts(tokenizer, "**Paris** is big.", chat=True)
    t0, t1 = enc.spans[0][0]
    assert _decoded(tokenizer, enc) == "Paris"
    special = set(tokenizer.all_special_ids)
    assert not any(t in special for t in enc.input_ids[0, t0:t1].tolist())


@pytest.mark.parametrize("word", ["café", "naïve", "😀", "東京", "Zürich 😀 東京"])
def test_non_ascii_spans(tokenizer, word):
    enc = encode_prompts(tokenizer, f"Say **{word}** please.", chat=False)
    assert _decoded(tokenizer, enc).strip() == word


def test_repeated_substring_picks_occurrence(tokenizer):
    text = "The key is red. The key is blue."
    enc = encode_prompts(tokenizer, text, emphasize=Span("The key", occurrence=1), chat=False)
    t0, _ = enc.spans[0][0]
    assert "red" in tokenizer.decode(enc.input_ids[0, :t0])
    assert _decoded(tokenizer, enc).strip() == "The key"


def test_emphasize_never_matches_template_text(tokenizer):
    # "assistant" is in the rendered template but not in the user's message
    with pytest.raises(ValueError, match="'assistant' not found"):
        encode_prompts(tokenizer, "Hello there", emphasize="assistant", chat=True)


def test_left_padding_shifts_spans(tokenizer):
    prompts = ["A much longer prompt that has **many** words in it.", "Short **one**."]
    enc = encode_prompts(tokenizer, prompts, chat=False)
    alone = encode_prompts(tokenizer, prompts[1], chat=False)
    pad = enc.length - alone.length
    assert enc.spans[1][0] == (alone.spans[0][0][0] + pad, alone.spans[0][0][1] + pad)
    assert _decoded(tokenizer, enc, row=1) == _decoded(tokenizer, alone)
    assert enc.attention_mask[1, :pad].sum() == 0


def test_several_spans_and_batch_major_emphasize(tokenizer):
    enc = encode_prompts(
        tokenizer,
        ["alpha beta gamma", "delta epsilon"],
        emphasize=[["alpha", "gamma"], ["epsilon"]],
        chat=False,
    )
    assert [len(s) for s in enc.spans] == [2, 1]
    assert _decoded(tokenizer, enc, 0, 1).strip() == "gamma"
    with pytest.raises(ValueError, match="3 rows for 2 prompts"):
        encode_prompts(tokenizer, ["a b", "c d"], emphasize=[["a"], ["c"], ["d"]], chat=False)


def test_missing_span_names_it(tokenizer):
    with pytest.raises(ValueError, match="'nowhere' not found"):
        encode_prompts(tokenizer, "some text", emphasize="nowhere", chat=False)


def test_char_to_token_range_edge_cases():
    offsets = [(0, 0), (0, 3), (3, 4), (4, 9), (9, 10)]  # BOS, "Hi,", " ", "world", "!"
    skip = [True, False, False, False, False]
    assert char_to_token_range(offsets, (4, 9), skip) == (3, 4)
    assert char_to_token_range(offsets, (0, 3), skip) == (1, 2)  # BOS at char 0 excluded
    with pytest.raises(ValueError):
        char_to_token_range(offsets, (5, 5), skip)
    with pytest.raises(ValueError):
        char_to_token_range([(0, 0), (0, 0)], (0, 1), [True, True])


ALPHABET = list("abcXYZ .,;:!?'\"-") + ["é", "ü", "ß", "😀", "東", "京", "\n"]


def test_span_property_random_strings(tokenizer):
    rng = random.Random(0)
    for _ in range(150):
        words = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 6))) for _ in range(6)]
        text = "".join(words)
        c0 = rng.randrange(0, len(text) - 1)
        c1 = rng.randrange(c0 + 1, len(text) + 1)
        if not text[c0:c1].strip():
            continue
        enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        offs = enc["offset_mapping"]
        t0, t1 = char_to_token_range(offs, (c0, c1))
        assert t0 < t1
        # every token in range overlaps the span; neighbours do not
        assert all(offs[i][0] < c1 and offs[i][1] > c0 for i in range(t0, t1))
        if t0 > 0:
            assert offs[t0 - 1][1] <= c0 or offs[t0 - 1][0] == offs[t0 - 1][1]
        if t1 < len(offs):
            assert offs[t1][0] >= c1
        # the range's characters cover the span
        assert offs[t0][0] <= c0 and offs[t1 - 1][1] >= c1
