"""SteeredModel.generate on tiny random models."""

import pytest
import torch

from steer import Pasta, SteeredModel

HEADS = {"0": [1], "1": [0, 3]}


def test_generate_single_and_batch_agree(tiny_llama):
    sm = SteeredModel(tiny_llama)
    prompts = ["Hi **there**, how are you?", "A much longer prompt that needs **padding** on the other row."]
    batch = sm.generate(prompts, steer=[Pasta(HEADS)], max_new_tokens=5)
    assert len(batch) == 2 and all(len(ids) >= 1 for ids in batch.token_ids)
    for i, p in enumerate(prompts):
        alone = sm.generate(p, steer=[Pasta(HEADS)], max_new_tokens=5)
        assert alone.token_ids[0] == batch.token_ids[i]
        assert alone.text == batch.texts[i]


def test_generate_uses_chat_template_and_messages(tiny_llama):
    sm = SteeredModel(tiny_llama)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say **yes**."}]
    out = sm.generate(msgs, steer=[Pasta(HEADS)], max_new_tokens=3)
    assert out.prompts[0].startswith("<|im_start|>system\nBe brief.")
    assert out.prompts[0].endswith("<|im_start|>assistant\n")
    t0, t1 = out.spans[0][0]
    ids = tiny_llama.tokenizer(out.prompts[0], add_special_tokens=False)["input_ids"]
    assert tiny_llama.tokenizer.decode(ids[t0:t1]).strip() == "yes"


def test_steering_changes_tokens_and_cache_agrees(tiny_llama):
    sm = SteeredModel(tiny_llama)
    p = "Words words words. **Focus on this bit here.** More words follow after it."
    base = sm.generate(p, max_new_tokens=8)
    steer = sm.generate(p, steer=[Pasta([0, 1, 2], alpha=1e-4)], max_new_tokens=8)
    nocache = sm.generate(p, steer=[Pasta([0, 1, 2], alpha=1e-4)], max_new_tokens=8, use_cache=False)
    assert steer.token_ids == nocache.token_ids
    assert steer.token_ids != base.token_ids


def test_sampling_is_seeded(tiny_llama):
    sm = SteeredModel(tiny_llama)
    a = sm.generate("Tell **me**", steer=[Pasta(HEADS)], max_new_tokens=6, do_sample=True, seed=5)
    b = sm.generate("Tell **me**", steer=[Pasta(HEADS)], max_new_tokens=6, do_sample=True, seed=5)
    assert a.token_ids == b.token_ids


def test_generate_bad_input_leaves_model_untouched(tiny_llama):
    sm = SteeredModel(tiny_llama)
    before = [p.detach().clone() for p in tiny_llama.model.parameters()]
    with pytest.raises(ValueError, match="empty prompt"):
        sm.generate("   ")
    with pytest.raises(ValueError, match="max_new_tokens"):
        sm.generate("hi", max_new_tokens=0)
    with pytest.raises(ValueError, match="num_return_sequences"):
        sm.generate("hi **x**", steer=[Pasta(HEADS)], num_return_sequences=2)
    with pytest.raises(ValueError, match="'zebra' not found"):
        sm.generate("hi there", steer=[Pasta(HEADS)], emphasize="zebra")
    with pytest.raises(ValueError, match="unknown head 8"):
        sm.generate("hi **x**", steer=[Pasta({"0": [8]})])
    with pytest.raises(TypeError, match="not an intervention"):
        sm.generate("hi", steer=["pasta"])
    with pytest.raises(TypeError):
        SteeredModel(tiny_llama.model)
    assert tiny_llama.model.config._attn_implementation == "sdpa"
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_llama.model.parameters(), strict=True))


def test_ablate_during_generation(tiny_llama):
    from heads import HeadScale, QueryScale, editing
    from steer import Ablate

    sm = SteeredModel(tiny_llama)
    p = "Tell me about heads and layers."
    heads = {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]}
    ua = sm.generate(p, steer=Ablate(heads), max_new_tokens=6)
    sc = sm.generate(p, steer=Ablate(heads, method="sc"), max_new_tokens=6)
    with editing(tiny_llama, [QueryScale(layer=la, factor=0.0) for la in (0, 1)]):
        want_ua = tiny_llama.model.generate(
            **_inputs(sm, p), max_new_tokens=6, do_sample=False, pad_token_id=2
        )
    with editing(tiny_llama, [HeadScale(layer=la, factor=0.0) for la in (0, 1)]):
        want_sc = tiny_llama.model.generate(
            **_inputs(sm, p), max_new_tokens=6, do_sample=False, pad_token_id=2
        )
    n = _inputs(sm, p)["input_ids"].shape[1]
    assert ua.token_ids[0] == want_ua[0, n:].tolist()[: len(ua.token_ids[0])]
    assert sc.token_ids[0] == want_sc[0, n:].tolist()[: len(sc.token_ids[0])]
    assert (
        sm.generate(p, steer=Ablate(heads, eps=1.0), max_new_tokens=6).token_ids
        == sm.generate(p, max_new_tokens=6).token_ids
    )
    with pytest.raises(ValueError, match="method"):
        Ablate(heads, method="zero")


def _inputs(sm, prompt):
    enc = sm.encode(prompt)
    return {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask}


def test_generate_returns_the_edited_attentions(tokenizer):
    """`return_dict_in_generate` + `output_attentions`: per step, every layer's edited pattern."""
    from tests.support import make_tiny

    hm = make_tiny("llama", tokenizer, attn="eager")
    alpha = 0.01
    g = SteeredModel(hm).generate(
        "Words here. **Look at this.** More words.",
        steer=[Pasta({"0": [1]}, alpha=alpha)],
        chat=False,
        max_new_tokens=3,
        output_attentions=True,
        return_dict_in_generate=True,
    )
    att = g.outputs.attentions
    assert len(att) == 3 and all(len(step) == hm.n_layers for step in att)
    enc = SteeredModel(hm).encode("Words here. **Look at this.** More words.", chat=False)
    seq = g.outputs.sequences
    with torch.no_grad():  # layer 0 sees only tokens: the plain pattern of the same sequence
        plain = hm.model(input_ids=seq, output_attentions=True).attentions[0][0]  # [H, T, T]
    w = torch.ones(seq.shape[1])
    w[: enc.length] = torch.where(enc.span_mask(0), 1.0, alpha)  # PASTA: alpha off the span
    for step in (1, 2):  # decode steps: one new row each
        pos = enc.length + step - 1
        p = plain[1, pos, : pos + 1] * w[: pos + 1]
        torch.testing.assert_close(att[step][0][0, 1, 0], p / p.sum(), atol=1e-5, rtol=0)  # steered head
        torch.testing.assert_close(att[step][0][0, 0, 0], plain[0, pos, : pos + 1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("key", ["custom_generate", "trust_remote_code"])
def test_generate_options_that_run_code_are_refused(tiny_llama, tmp_path, key):
    """`custom_generate=<folder>` made transformers import and run the folder's generate.py
    (or ask on stdin whether to); refused before anything is read (found by a breaker)."""
    code = tmp_path / "custom_generate"
    code.mkdir()
    marker = tmp_path / "RAN"
    (code / "generate.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\ndef generate(*a, **k):\n    pass\n"
    )
    value = str(tmp_path) if key == "custom_generate" else True
    with pytest.raises(ValueError, match=f"{key}= would load and run Python code"):
        SteeredModel(tiny_llama).generate("Hi", [], max_new_tokens=1, **{key: value})
    assert not marker.exists()
