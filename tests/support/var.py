"""Shared helpers of the VAR tests (tests/steer/test_var*.py): two prompts with a span, the planted
sink dim and threshold, and a pre-hook that writes a massive value at chosen positions."""

from __future__ import annotations

import contextlib

from heads import encode_prompts

PROMPTS = [
    "Context: **Alice lives in Rome and she teaches music to children there.** Where does Alice live?",
    "Doc: **The river is long, wide and very cold in the winter months.** The river is",
]
DIM = 5
TAU = 6.0


def _enc(model, prompts=PROMPTS):
    return encode_prompts(model.tokenizer, prompts, chat=False)


@contextlib.contextmanager
def planted(model, positions: list[list[int]], value: float = 1000.0, dim: int = DIM):
    """Pre-hook on layer 0 that writes a massive value into `dim` at absolute `positions` per row
    (prompt positions: only when the call starts at 0, i.e. prefill or an uncached re-run)."""

    def hook(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is not None and cache.get_seq_length(0) > 0:
            return None
        x = (args[0] if args else kwargs["hidden_states"]).clone()
        for b, ps in enumerate(positions):
            for p in ps:
                if p < x.shape[1]:
                    x[b, p, dim] = value
        if args:
            return (x, *args[1:]), kwargs
        kwargs["hidden_states"] = x
        return args, kwargs

    h = model.layers[0].register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    try:
        yield
    finally:
        h.remove()


def _sink_positions(enc):
    """Per row: the first real token and the first token of the span (a visual/context sink)."""
    first = enc.attention_mask.float().argmax(-1).tolist()
    return [[first[b], enc.spans[b][0][0]] for b in range(enc.batch)]
