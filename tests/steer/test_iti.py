"""ITI (steer/iti.py): the shift formula, positions, KV cache, no-op, validation."""

import numpy as np
import pytest
import torch

from heads import editing, encode_prompts, forward
from probes.head_probes import fit_head_probes
from steer import Iti, SteeredModel

HEADS = [(1, 0), (1, 3), (2, 1)]


def _iti(hm, alpha=4.0, from_position=-1, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(len(HEADS), hm.d_head, generator=g)
    d = d / d.norm(dim=-1, keepdim=True)
    s = torch.rand(len(HEADS), generator=g) + 0.5
    return Iti(heads=HEADS, directions=d, sigmas=s, alpha=alpha, from_position=from_position)


def _o_proj_inputs(hm, enc, edits, layer):
    seen = []
    handle = hm.out_projs[layer].register_forward_hook(lambda m, args, out: seen.append(args[0].clone()))
    try:
        with editing(hm, edits):
            forward(hm, enc)
    finally:
        handle.remove()
    return seen[0].reshape(enc.batch, enc.length, hm.n_heads, hm.d_head)


def test_shift_equals_formula(tiny_llama):
    hm = tiny_llama
    enc = encode_prompts(hm.tokenizer, ["The quick brown fox jumps over the lazy dog"], chat=False)
    iti = _iti(hm, alpha=3.5, from_position=4)
    plain = _o_proj_inputs(hm, enc, [], 1)
    steered = _o_proj_inputs(hm, enc, iti.edits(hm, enc), 1)  # layer 1: first steered layer
    want = plain.clone()
    for (layer, head), theta, sigma in zip(HEADS, iti.directions, iti.sigmas, strict=True):
        if layer == 1:
            want[:, 4:, head] = plain[:, 4:, head] + 3.5 * float(sigma) * theta
    assert torch.equal(steered, want)  # exactly: rows < 4 and other heads untouched, the rest shifted
    assert not torch.equal(steered, plain)


def test_alpha_zero_is_bitwise_noop(tiny_llama):
    hm = tiny_llama
    enc = encode_prompts(hm.tokenizer, ["Hello there, my friend"], chat=False)
    iti = _iti(hm, alpha=0.0)
    assert iti.edits(hm, enc) == []
    before = forward(hm, enc)
    sm = SteeredModel(hm)
    a = sm.generate("Hello there, my friend", chat=False, max_new_tokens=6)
    b = sm.generate("Hello there, my friend", iti, chat=False, max_new_tokens=6)
    assert a.token_ids == b.token_ids
    assert torch.equal(forward(hm, enc), before)


def test_kv_cache_on_equals_off_and_decode_steps_steered(tiny_llama):
    hm = tiny_llama
    sm = SteeredModel(hm)
    prompts = ["The quick brown fox jumps over", "Hello"]
    plain = sm.generate(prompts, chat=False, max_new_tokens=8)
    iti = _iti(hm, alpha=40.0)
    on = sm.generate(prompts, iti, chat=False, max_new_tokens=8)
    off = sm.generate(prompts, iti, chat=False, max_new_tokens=8, use_cache=False)
    assert on.token_ids == off.token_ids
    assert on.token_ids != plain.token_ids  # the shift is strong enough to change the text
    # steering only from the third generated token: the first two tokens are the unsteered ones
    length = sm.encode(prompts, chat=False).length
    late = _iti(hm, alpha=40.0, from_position=length + 2)
    on = sm.generate(prompts, late, chat=False, max_new_tokens=8)
    off = sm.generate(prompts, late, chat=False, max_new_tokens=8, use_cache=False)
    assert on.token_ids == off.token_ids
    assert [t[:3] for t in on.token_ids] == [t[:3] for t in plain.token_ids]


def test_model_restored_after_exception(tiny_llama):
    hm = tiny_llama
    enc = encode_prompts(hm.tokenizer, ["Hello there"], chat=False)
    before = forward(hm, enc)
    with pytest.raises(RuntimeError), editing(hm, _iti(hm).edits(hm, enc)):
        forward(hm, enc)
        raise RuntimeError("boom")
    assert torch.equal(forward(hm, enc), before)


def test_from_probes_takes_top_k():
    g = np.random.default_rng(0)
    x = g.normal(size=(60, 3, 4, 8)).astype(np.float32)
    y = np.array([0, 1] * 30)
    x[:, 2, 1, 0] += 3 * (2 * y - 1)
    res = fit_head_probes(x, y)
    iti = Iti.from_probes(res, k=2, alpha=7.0)
    assert iti.heads[0] == (2, 1) and len(iti.heads) == 2
    assert torch.equal(iti.directions[0], res.mass_mean_directions[2, 1])
    assert iti.sigmas[0] == res.mass_mean_sigma[2, 1]
    probe = Iti.from_probes(res, k=1, direction="probe")
    assert torch.equal(probe.directions[0], res.probe_directions[2, 1])
    with pytest.raises(ValueError, match="direction"):
        Iti.from_probes(res, k=1, direction="pca")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(heads=[(0, 1), (0, 1)]), "duplicate"),
        (dict(directions=torch.zeros(2, 16)), "directions must be"),
        (dict(sigmas=torch.ones(2)), "sigmas must be"),
        (dict(sigmas=torch.tensor([1.0, -1.0, 1.0])), ">= 0"),
        (dict(directions=torch.full((3, 16), float("nan"))), "NaN"),
        (dict(alpha=float("inf")), "alpha"),
        (dict(from_position=1.5), "from_position"),
    ],
)
def test_bad_parameters(kwargs, match):
    args = dict(heads=HEADS, directions=torch.ones(3, 16), sigmas=torch.ones(3)) | kwargs
    with pytest.raises(ValueError, match=match):
        Iti(**args)


def test_bad_against_model(tiny_llama):
    hm = tiny_llama
    enc = encode_prompts(hm.tokenizer, ["Hello"], chat=False)
    with pytest.raises(ValueError, match="unknown layer"):
        Iti(heads=[(9, 0)], directions=torch.ones(1, hm.d_head), sigmas=torch.ones(1)).edits(hm, enc)
    with pytest.raises(ValueError, match="d_head"):
        Iti(heads=[(0, 0)], directions=torch.ones(1, hm.d_head + 1), sigmas=torch.ones(1)).edits(hm, enc)


def test_eval_harness_iti(tiny_llama):
    from probes.studies.evaluate import evaluate, method_steer

    with pytest.raises(ValueError, match="fitted"):
        method_steer(tiny_llama, "iti")
    res = evaluate(tiny_llama, "sentiment", "iti", limit=4, iti=_iti(tiny_llama))
    row = res.table.iloc[0]
    assert row.method == "iti" and row.n == 4 and 0 <= row.value <= 1
