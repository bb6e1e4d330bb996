"""The engine and PASTA on every tiny architecture: Llama (GQA), Qwen2, Mistral (MQA), GPT-2."""

import pytest
import torch

from heads import HeadScale, Recorder, editing, encode_prompts, forward
from steer import Pasta, SteeredModel
from tests.support import Identity, ZeroRow, make_tiny
from tests.support.oracle import llama_forward, pasta_eq2

PROMPTS = ["Some context words. **Answer in JSON.** What next?", "Short **one** here."]


@pytest.fixture()
def enc(tokenizer):
    return encode_prompts(tokenizer, PROMPTS, chat=False)


def test_edited_path_equals_backend(tiny_any, enc):
    base = forward(tiny_any, enc)
    with editing(tiny_any, [Identity(layer=la) for la in range(tiny_any.n_layers)]):
        got = forward(tiny_any, enc)
    real = enc.attention_mask.bool()
    torch.testing.assert_close(got[real], base[real], atol=1e-5, rtol=0)


def test_output_edit_equals_pattern_edit(tiny_any, enc):
    with editing(tiny_any, [HeadScale(layer=1, heads=[3], factor=0.0)]):
        a = forward(tiny_any, enc)
    with editing(tiny_any, [ZeroRow(layer=1, heads=[3])]):
        b = forward(tiny_any, enc)
    real = enc.attention_mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=0)


def test_pasta_span_share_formula(tiny_any, enc):
    g = enc.span_mask()
    base, after = Recorder(layer=0), Recorder(layer=0)
    with editing(tiny_any, [base]):
        forward(tiny_any, enc)
    with editing(tiny_any, Pasta({"0": [1, 2]}, alpha=0.01).edits(tiny_any, enc) + [after]):
        forward(tiny_any, enc)
    for b in range(2):
        s = base.records[0][b, [1, 2], -1][:, g[b]].sum(-1)
        s2 = after.records[0][b, [1, 2], -1][:, g[b]].sum(-1)
        torch.testing.assert_close(s2, s / (s + 0.01 * (1 - s)), atol=1e-6, rtol=0)
    assert torch.equal(base.records[0][:, [0, 3]], after.records[0][:, [0, 3]])


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_pasta_against_eager_oracle(kind, tokenizer, enc):
    hm = make_tiny(kind, tokenizer)
    heads = {"0": [0, 3], "1": [1]}
    want = llama_forward(
        hm.model,
        enc.input_ids,
        enc.attention_mask,
        lambda la, p: pasta_eq2(p, {0: [0, 3], 1: [1]}.get(la, []), enc.span_mask(), 0.01, enc.length),
    )
    with editing(hm, Pasta(heads).edits(hm, enc)):
        got = forward(hm, enc)
    real = enc.attention_mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)


def test_generate_cache_and_batch(tiny_any):
    sm = SteeredModel(tiny_any)
    steer = [Pasta({"0": [0, 1], "1": [2]})]
    batch = sm.generate(PROMPTS, steer=steer, max_new_tokens=4, chat=False)
    nocache = sm.generate(PROMPTS, steer=steer, max_new_tokens=4, chat=False, use_cache=False)
    assert batch.token_ids == nocache.token_ids
    alone = sm.generate(PROMPTS[1], steer=steer, max_new_tokens=4, chat=False)
    assert alone.token_ids[0] == batch.token_ids[1]


def test_query_scale_exact_gives_uniform_pattern(tiny_any, enc):
    from heads import QueryScale

    rec = Recorder(layer=1)
    with editing(tiny_any, [QueryScale(layer=1, heads=[3], factor=0.0), rec]):
        forward(tiny_any, enc)
    p = rec.records[0][:, 3]
    real = enc.attention_mask.bool()
    for b in range(2):
        idx = torch.nonzero(real[b]).flatten()
        n = len(idx)
        want = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]
        torch.testing.assert_close(p[b][idx][:, idx], want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["phi3", "gemma2", "gemma3_text", "qwen3", "olmo2", "llava", "qwen2_vl"])
def test_pasta_generation_on_more_families(kind, tokenizer):
    """PASTA through `SteeredModel` on the families of the family table: KV cache on and off
    and a left-padded batch give the same tokens as single runs, and steering acts."""
    from tests.support.families import tiny_family_model

    hm = tiny_family_model(kind, "eager", vocab_size=tokenizer.vocab_size, sliding_window=512)
    hm.tokenizer = tokenizer
    sm = SteeredModel(hm)
    steer = [Pasta({"0": [0, 1], "1": [2]}, alpha=0.01)]
    batch = sm.generate(PROMPTS, steer=steer, max_new_tokens=4, chat=False)
    nocache = sm.generate(PROMPTS, steer=steer, max_new_tokens=4, chat=False, use_cache=False)
    assert batch.token_ids == nocache.token_ids
    alone = sm.generate(PROMPTS[1], steer=steer, max_new_tokens=4, chat=False)
    assert alone.token_ids[0] == batch.token_ids[1]
    enc = encode_prompts(tokenizer, PROMPTS, chat=False)
    with editing(hm, Pasta({"0": [0, 1]}, alpha=0.01).edits(hm, enc)):
        steered = forward(hm, enc)
    assert (steered - forward(hm, enc))[enc.attention_mask.bool()].abs().max() > 1e-5
