"""Attention knockout / modification equals a hand-written masked attention (the eager oracle of
`tests.support.oracle`, whose post-softmax hook zeroes or scales the chosen (query, key) pairs of
the chosen heads and layers and renormalises each row), at prefill and while generating."""

from __future__ import annotations

import pytest
import torch

from heads import editing, encode_prompts, forward
from steer import Knockout, SteeredModel
from tests.support.oracle import llama_forward

PROMPTS = ["The Eiffel Tower is located in the city of", "Where is **the key**? It is under"]


def _hook(layers, heads, qmask, kmask, factor):
    """Post-softmax oracle: pairs (q in Q_b, k in K_b) of the chosen heads x factor, rows renormalised."""

    def transform(la, p):
        if la not in layers:
            return p
        B, H, T, K = p.shape
        q = torch.zeros(B, T, dtype=torch.bool)
        q[:, : qmask.shape[1]] = qmask
        k = torch.zeros(B, K, dtype=torch.bool)
        k[:, : kmask.shape[1]] = kmask
        hm = torch.zeros(H, dtype=torch.bool)
        hm[heads if heads is not None else list(range(H))] = True
        sel = hm[None, :, None, None] & q[:, None, :, None] & k[:, None, None, :]
        out = torch.where(sel, p * factor, p)
        return out / out.sum(-1, keepdim=True).clamp(min=1e-30)

    return transform


@pytest.mark.parametrize(
    ("factor", "kernel"), [(0.0, "auto"), (0.25, "auto"), (3.0, "auto"), (0.0, "fused"), (0.25, "fused")]
)
def test_prefill_equals_masked_attention(tiny_llama, tokenizer, factor, kernel):
    """On the blocked path and on the fused kernel (a query-row x key-column bias: long prompts
    run it without any [Q, K] tensor)."""
    enc = encode_prompts(tokenizer, PROMPTS, chat=False)
    assert (enc.attention_mask == 0).any()
    P = enc.length
    ko = Knockout(
        keys=[[P - 6, P - 5], [P - 4]], queries=[-1, -2], layers=[1, 2], heads=[0, 3], factor=factor
    )
    qmask, kmask = ko.masks(enc)
    want = llama_forward(
        tiny_llama.model, enc.input_ids, enc.attention_mask, _hook({1, 2}, [0, 3], qmask, kmask, factor)
    )
    before = {k: v.clone() for k, v in tiny_llama.model.state_dict().items()}
    with torch.no_grad(), editing(tiny_llama, ko.edits(tiny_llama, enc), kernel=kernel):
        got = forward(tiny_llama, enc)
    real = enc.attention_mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
    base = forward(tiny_llama, enc)
    assert float((got[:, -1] - base[:, -1]).abs().max()) > 1e-3  # it changes the output
    assert all(torch.equal(v, before[k]) for k, v in tiny_llama.model.state_dict().items())
    assert torch.equal(forward(tiny_llama, enc), base)  # restored


def test_generate_equals_oracle_at_every_step(tiny_llama, tokenizer):
    """queries=None: every row, generated ones too; keys='span' (the emphasized tokens)."""
    sm = SteeredModel(tiny_llama)
    ko = Knockout(keys="span", layers=range(3))
    kw = dict(max_new_tokens=4, chat=False, return_dict_in_generate=True, output_scores=True)
    prompts = ["Where is **the key**? It is under", "The city of **Paris** is the capital of"]
    gen = sm.generate(prompts, [ko], **kw)
    nocache = sm.generate(prompts, [ko], use_cache=False, **kw)
    assert gen.token_ids == nocache.token_ids
    enc = sm.encode(prompts, chat=False)
    P = enc.length
    seq = gen.outputs.sequences
    mask = torch.cat([enc.attention_mask, torch.ones(seq.shape[0], seq.shape[1] - P, dtype=torch.long)], 1)
    _, kmask = ko.masks(enc)
    qmask = torch.ones(seq.shape[0], seq.shape[1], dtype=torch.bool)
    want = llama_forward(tiny_llama.model, seq, mask, _hook({0, 1, 2}, None, qmask, kmask, 0.0))
    for t, scores in enumerate(gen.outputs.scores):
        torch.testing.assert_close(scores.float(), want[:, P - 1 + t].float(), atol=1e-4, rtol=0)


def test_bad_input_before_any_forward(tiny_llama, tokenizer):
    enc = encode_prompts(tokenizer, PROMPTS, chat=False)
    P = enc.length
    calls = []
    h = tiny_llama.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        # the longest prompt's first token sees only itself
        with pytest.raises(ValueError, match="blocks every visible key of query position 0 in prompt"):
            Knockout(keys=[0], queries=[0]).edits(tiny_llama, enc)
        with pytest.raises(ValueError, match="keys position 99 is out of range"):
            Knockout(keys=[99]).edits(tiny_llama, enc)
        with pytest.raises(ValueError, match="queries position -99 is out of range"):
            Knockout(keys=[1], queries=[-99]).edits(tiny_llama, enc)
        with pytest.raises(ValueError, match="factor must be"):
            Knockout(keys=[1], factor=-1.0)
        with pytest.raises(ValueError, match="unknown layer 9"):
            Knockout(keys=[1], layers=[9]).edits(tiny_llama, enc)
        with pytest.raises(ValueError, match="per-row lists"):
            Knockout(keys=[[1]]).edits(tiny_llama, enc)
        with pytest.raises(ValueError, match="no prompt has an emphasized span"):
            Knockout(keys="span").edits(tiny_llama, encode_prompts(tokenizer, PROMPTS[:1], chat=False))
        with pytest.raises(ValueError, match="blocks every visible key"):
            SteeredModel(tiny_llama).generate(
                PROMPTS, [Knockout(keys=list(range(P)))], chat=False, max_new_tokens=1
            )
    finally:
        h.remove()
    assert not calls
    Knockout(keys=list(range(P - 1)), queries=[-1]).edits(tiny_llama, enc)  # the last row keeps itself
