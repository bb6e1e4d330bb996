"""The organism's tokenizer: the embedded SmolLM2 tokenizer cut to its first `vocab_size` ids.

SmolLM2's byte-level BPE numbers its tokens in merge order: ids 0-16 are the special tokens,
then the byte alphabet, then one id per merge (merge `i` makes id `252 + i`). Keeping the ids
below `vocab_size` and the merges that make them gives a consistent smaller BPE over the same
bytes: every text still encodes (rarer words split into more pieces), and the common English
sub-words of the shipped corpus keep their ids. Nothing is trained, so the cut is the same on
every machine.
"""

from __future__ import annotations

import json
from typing import Any

from heads._util.validation import check_int
from heads.errors import HeadsteerValueError

__all__ = ["MIN_VOCAB", "truncated_tokenizer"]

MIN_VOCAB = 256
"""The smallest cut: the special tokens and the whole byte alphabet (ids below 252) fit."""
_SPECIALS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}


def truncated_tokenizer(vocab_size: int, base: Any = None) -> Any:
    """The embedded tokenizer (or `base`) cut to its first `vocab_size` ids.

    Args:
        vocab_size: ids kept, `MIN_VOCAB` .. the base vocabulary (an int).
        base: a `PreTrainedTokenizerFast` with a byte-level BPE whose merge `i` makes id
            `first_merge + i` (SmolLM2's, GPT-2's); None (default): the embedded model's
            (`heads.load_tokenizer()`).

    Returns:
        a `PreTrainedTokenizerFast` of `vocab_size` ids: bos `<|im_start|>`, eos = pad
        `<|im_end|>` (the embedded model's), its chat template kept.

    Raises:
        HeadsteerValueError: `vocab_size` not an int in range; a base tokenizer that is not a
            BPE numbered in merge order.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from heads.model.loading import load_tokenizer

    tok = load_tokenizer() if base is None else base
    data = json.loads(tok.backend_tokenizer.to_str())
    model = data["model"]
    if model.get("type") != "BPE":
        raise HeadsteerValueError(f"truncated_tokenizer needs a BPE tokenizer, got {model.get('type')!r}")
    vocab: dict[str, int] = model["vocab"]
    vocab_size = check_int("vocab_size", vocab_size, lo=MIN_VOCAB, hi=len(vocab))
    merges = [m if isinstance(m, list) else m.split(" ") for m in model["merges"]]
    made = [vocab.get("".join(m), -1) for m in merges]
    first = made[0] if made else len(vocab)
    if any(i != first + k for k, i in enumerate(made)) or first > MIN_VOCAB:
        raise HeadsteerValueError("truncated_tokenizer needs a BPE whose merge i makes id first_merge + i")
    model["vocab"] = {s: i for s, i in vocab.items() if i < vocab_size}
    model["merges"] = merges[: max(0, vocab_size - first)]
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < vocab_size]
    cut = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), **_SPECIALS)
    cut.chat_template = getattr(tok, "chat_template", None)
    cut.model_max_length = getattr(tok, "model_max_length", cut.model_max_length)
    return cut
