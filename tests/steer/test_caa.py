"""CAA steering vectors against the `steering-vectors` package (the oracle), on a tiny random Llama.

steering-vectors 0.12.2 (PyPI; installed with --no-deps: it declares transformers<5, but its
hooks are plain torch forward hooks): `train_steering_vector(model, tokenizer, pairs, layers=[L])`
reads the output of decoder block L at the last token of each string and takes the mean of
positive minus negative (`mean_aggregator`); `SteeringVector.apply(model, multiplier=c,
min_token_index=k)` adds `c * v` to that block's output at token indices >= k of each forward.
"""

import pytest
import torch

from heads import editing, encode_prompts, forward
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from steer import Caa, Pasta, SteeredModel, caa_vector
from steer.noop import NoOpWarning

sv = pytest.importorskip("steering_vectors")

PAIRS = [
    ("Question: is the sky blue? Answer: yes", "Question: is the sky blue? Answer: no"),
    ("I love this film, it is great", "I hate this film, it is awful"),
    ("The answer is (A)", "The answer is (B)"),
]
PROMPT = "Tell me about the weather today"
LAYER = 1


def _oracle_vector(hm, layer=LAYER):
    return sv.train_steering_vector(hm.model, hm.tokenizer, PAIRS, layers=[layer], batch_size=1)


def test_vector_equals_steering_vectors(tiny_llama):
    want = _oracle_vector(tiny_llama).layer_activations[LAYER]
    got = caa_vector(tiny_llama, PAIRS, LAYER, batch_size=2, progress=False)  # batched, left-padded
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("from_position", [None, 3, -1])
def test_steered_logits_equal_steering_vectors(tiny_llama, from_position):
    vec = _oracle_vector(tiny_llama)
    enc = encode_prompts(tiny_llama.tokenizer, [PROMPT], chat=False, markup=False)
    k = {None: 0, 3: 3, -1: enc.length - 1}[from_position]
    ids = enc.input_ids
    with vec.apply(tiny_llama.model, multiplier=4.0, min_token_index=k):
        want = tiny_llama.model(input_ids=ids).logits
    caa = Caa(vec.layer_activations[LAYER], LAYER, 4.0, from_position=from_position)
    with editing(tiny_llama, caa.edits(tiny_llama, enc)):
        got = forward(tiny_llama, enc)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert float((got - forward(tiny_llama, enc)).abs().max()) > 1e-3


def test_composes_with_pasta_in_one_list(tiny_llama):
    """CAA + PASTA in one `steer` list equals the package's hook with PASTA's edits on top."""
    vec = _oracle_vector(tiny_llama)
    enc = encode_prompts(tiny_llama.tokenizer, ["Note: **the key is red.** The key is"], chat=False)
    pasta = Pasta({"1": [0, 2], "2": [1]}, alpha=0.01)
    caa = Caa(vec.layer_activations[LAYER], LAYER, 4.0, from_position=None)
    with vec.apply(tiny_llama.model, multiplier=4.0), editing(tiny_llama, pasta.edits(tiny_llama, enc)):
        want = forward(tiny_llama, enc)
    with editing(tiny_llama, [e for s in (caa, pasta) for e in s.edits(tiny_llama, enc)]):
        got = forward(tiny_llama, enc)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    sm = SteeredModel(tiny_llama)
    a = sm.generate(
        ["Note: **the key is red.** The key is", PROMPT + " **now**"], [caa, pasta], max_new_tokens=5
    )
    b = sm.generate(
        ["Note: **the key is red.** The key is", PROMPT + " **now**"],
        [caa, pasta],
        max_new_tokens=5,
        use_cache=False,
    )
    assert a.token_ids == b.token_ids


def test_bad_input(tiny_llama):
    v = torch.ones(tiny_llama.d_model)
    enc = encode_prompts(tiny_llama.tokenizer, [PROMPT], chat=False, markup=False)
    with pytest.raises(HeadsteerValueError, match="outside 0..1"):
        caa_vector(tiny_llama, PAIRS, 2)
    with pytest.raises(HeadsteerValueError, match="non-empty list"):
        caa_vector(tiny_llama, [], 0)
    with pytest.raises(HeadsteerValueError, match=r"pairs\[0\]"):
        caa_vector(tiny_llama, [("a", "")], 0)
    with pytest.raises(HeadsteerValueError, match="d_model"):
        Caa(torch.ones(3), 0).edits(tiny_llama, enc)
    with pytest.raises(HeadsteerValueError, match="NaN"):
        Caa(torch.full((4,), float("nan")), 0)
    with pytest.raises(HeadsteerValueError, match="coefficient"):
        Caa(v, 0, float("inf"))
    with pytest.raises(HeadsteerTypeError, match="layer"):
        Caa(v, 0.5)  # type: ignore[arg-type]
    with pytest.raises(HeadsteerValueError, match="before the prompt"):
        Caa(v, 0, from_position=-100).edits(tiny_llama, enc)
    with pytest.warns(NoOpWarning):
        assert Caa(v, 0, 0.0).edits(tiny_llama, enc) == []


def test_same_vector_and_logits_on_three_backends(tokenizer):
    """HF, TransformerLens bridge and nnsight (built as in tests/heads/test_backends.py)."""
    pytest.importorskip("transformer_lens")
    pytest.importorskip("nnsight")
    from tests.heads.test_backends import _three

    models = _three(tokenizer)
    enc = encode_prompts(tokenizer, ["Tell me about **the weather**", "Hi **there** friend"], chat=False)
    vecs, logits = {}, {}
    for name, hm in models.items():
        vecs[name] = caa_vector(hm, PAIRS, LAYER, progress=False)
        caa = Caa(vecs[name], LAYER, 4.0)
        with editing(hm, [e for s in (caa, Pasta({"2": [1]})) for e in s.edits(hm, enc)]):
            logits[name] = forward(hm, enc)
    real = enc.attention_mask.bool()
    for name in ("transformer_lens", "nnsight"):
        torch.testing.assert_close(vecs[name], vecs["hf"], atol=1e-5, rtol=0)
        torch.testing.assert_close(logits[name][real], logits["hf"][real], atol=1e-5, rtol=0)


def test_overflowing_vector_or_product_is_refused_before_any_forward(tiny_llama, tiny_llama_dir):
    """A vector whose `coefficient * vector` would overflow is refused with one line: past
    `MAX_ENTRY` (the next norm squares it past float32: the output collapses, generation is
    empty), past float32 itself (a float64 vector), or past the model dtype's largest value."""
    from steer.caa import MAX_ENTRY

    d = tiny_llama.d_model
    enc = encode_prompts(tiny_llama.tokenizer, [PROMPT], chat=False, markup=False)
    assert 1.8e19 < MAX_ENTRY < 1.9e19
    for vector, c, needle in [
        (torch.full((d,), 1e38), 1.0, "reaches 1e\\+38"),  # finite in float32, still refused
        (torch.full((d,), 1e18), 100.0, "reaches 1e\\+20"),  # the product, not the vector
        (torch.full((d,), 1e39, dtype=torch.float64), 1.0, "beyond float32's range"),
        (torch.full((d,), float("inf")), 1.0, "NaN or inf"),
    ]:
        with pytest.raises(HeadsteerValueError, match=needle):
            Caa(vector, 0, c)
    assert Caa(torch.full((d,), MAX_ENTRY * 0.99), 0, 1.0).check(tiny_llama) == 0  # within: kept
    with pytest.raises(HeadsteerValueError, match="coefficient"):
        Caa(torch.ones(d), 0, float("nan"))
    half = Caa(torch.full((d,), 1e4), 0, 10.0)  # 1e5: fine in float32, beyond float16's 65504
    assert half.check(tiny_llama) == 0
    from heads import load_model

    fp16 = load_model(tiny_llama_dir, dtype=torch.float16)
    calls = []
    fp16.model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(HeadsteerValueError, match="reaches 1e\\+05, more than 6.55e\\+04 .*float16"):
        SteeredModel(fp16).generate(PROMPT, [half], max_new_tokens=2, progress=False)
    assert calls == []  # refused before any forward
    with pytest.raises(HeadsteerValueError, match="float16"):
        half.edits(fp16, enc)
