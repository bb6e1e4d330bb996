"""Tokens shown as readable text (heads.inputs.tokens), and prompt scorers encoding like `generate`."""

import pytest

from heads import head_pattern
from heads.inputs.tokens import MARKERS, readable_token, readable_tokens, visible
from heads.scorers.maps.static import salient_operations
from heads.scorers.sinks import SinkRule, massive_activations, sink_stats
from steer.steered_model import SteeredModel

PROMPT = "Ana is a pilot.\nShe collects maps. **Answer in one word.** What is Ana's job?"


def _unmark(pieces):
    text = "".join(pieces)
    for ch, mark in MARKERS.items():
        text = text.replace(mark, ch)
    return text


def test_visible_markers():
    assert visible(" the\n\tx\r") == "␣the⏎⇥x␍"
    assert visible("a\x00b") == "a\\x00b"
    assert visible("plain") == "plain"
    with pytest.raises(TypeError):
        visible(3)


def test_readable_tokens_of_the_embedded_tokenizer(tokenizer):
    ids = tokenizer("Hello world\n\n the end", add_special_tokens=False)["input_ids"]
    pieces = readable_tokens(tokenizer, ids)
    assert pieces[:2] == ["Hello", "␣world"]
    assert not any(c in "".join(pieces) for c in "ĠĊ \n")  # no raw BPE marks, no bare whitespace
    assert _unmark(pieces) == tokenizer.decode(ids)  # markers back -> the decoded text
    assert readable_token(tokenizer, tokenizer.convert_tokens_to_ids("<|im_start|>")) == "<|im_start|>"
    # a character split over byte tokens: each piece shows its own bytes, not the same "�"
    ids = tokenizer(" 日", add_special_tokens=False)["input_ids"]
    assert len(ids) == 3  # the UTF-8 bytes e6 97 a5, one token each
    assert readable_tokens(tokenizer, ids) == ["␣\\xe6", "\\x97", "\\xa5"]
    with pytest.raises(TypeError):
        readable_token(tokenizer, "5")


def test_sentencepiece_word_start_is_a_space():
    class SP:  # a SentencePiece-like tokenizer: decode([id]) drops the word-start space
        def decode(self, ids, **kw):
            return {0: "the", 1: "<0x0A>"}[ids[0]].replace("<0x0A>", "\n")

        def convert_ids_to_tokens(self, i):
            return {0: "\u2581the", 1: "<0x0A>"}[i]

    assert readable_tokens(SP(), [0, 1]) == ["␣the", "⏎"]


def test_prompt_scorers_encode_like_generate(tiny_llama):
    enc = SteeredModel(tiny_llama).encode(PROMPT)  # what generate steers: chat template, no **
    assert "**" not in enc.texts[0] and "<|im_start|>" in enc.texts[0]
    tokens = readable_tokens(tiny_llama.tokenizer, enc.input_ids[0])
    df = massive_activations(tiny_llama, PROMPT, top=5)
    assert not df.token.str.contains(r"\*\*", regex=True).any()
    for row in df.itertuples():
        assert row.token == tokens[row.position]  # the same token sequence, as readable text
    stats = sink_stats(tiny_llama, PROMPT, rule=SinkRule(rule="absolute", theta=0.05))
    assert len(stats.flagged)
    for row in stats.flagged.itertuples():
        assert row.token == tokens[row.position]
    explicit = sink_stats(
        tiny_llama, PROMPT, rule=SinkRule(rule="absolute", theta=0.05), chat=None, markup=True
    )
    assert (stats.first_mass.scores == explicit.first_mass.scores).all()
    raw = sink_stats(tiny_llama, PROMPT, rule=SinkRule(rule="absolute", theta=0.05), chat=False, markup=False)
    assert not (raw.first_mass.scores == stats.first_mass.scores).all()  # a different sequence


def test_head_pattern_and_salient_operations_show_text(tiny_llama):
    _, tokens, _ = head_pattern(tiny_llama, "Read **this** now\nplease", 1, 2, chat=False)
    assert tokens == ["Read", "␣this", "␣now", "⏎", "please"]
    df = salient_operations(tiny_llama, 1, 2, k_s=4, k_m=2)
    tok = tiny_llama.tokenizer
    assert list(df.source) == [readable_token(tok, i) for i in df.source_id]
    assert [list(t) for t in df.targets] == [[readable_token(tok, i) for i in ids] for ids in df.target_ids]
