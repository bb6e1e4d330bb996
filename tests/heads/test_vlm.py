"""Images in the inputs, end to end on tiny random-weight LLaVA, Qwen2-VL and Idefics3 models.

docs/architecture.md, "Inputs with images" (image span per family).
The models are built from configs in code (tests/vlm_models.py): no download.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from heads import Recorder, editing, encode_prompts, forward, load_model
from heads.inputs.images import encode_image_prompts, image_spans, image_token_id
from steer import Pasta, SteeredModel
from tests.support.vlm_models import IMAGE_TOKENS, KINDS, image, make_tiny_vlm, save_tiny_vlm

PROMPTS = [
    "Look at the picture. What is **this**?",
    [{"role": "user", "content": "Describe it please, in a few words."}],
]
STEER = Pasta(heads={"0": [0, 1], "1": [2]}, alpha=0.01, spans="image")
NEW = 5


@pytest.fixture(scope="module", params=KINDS)
def vlm(request):
    return make_tiny_vlm(request.param)


def kind(hm) -> str:
    return hm.model.config.model_type


def images2():
    return [image(0), image(1, size=32)]


def enc2(hm):
    return encode_image_prompts(hm, PROMPTS, images2())


# ------------------------------------------------------------------ spans


def test_image_span_matches_image_token_positions(vlm):
    enc = enc2(vlm)
    img = image_token_id(vlm.model.config)
    assert enc.input_ids.shape[0] == 2 and enc.length > 0
    for b in range(2):
        where = (enc.input_ids[b] == img).nonzero().flatten().tolist()
        (t0, t1), *rest = enc.image_spans[b]
        assert not rest  # one image per prompt, not split
        assert list(range(t0, t1)) == where  # the span is exactly the image-token positions
        assert t1 - t0 == IMAGE_TOKENS[kind(vlm)]
        assert enc.attention_mask[b, t0:t1].all()
    mask = enc.image_mask()
    assert mask.tolist() == (enc.input_ids == img).tolist()
    if kind(vlm) == "qwen2_vl":  # bounded by the vision start / end tokens
        cfg = vlm.model.config
        for b in range(2):
            (t0, t1) = enc.image_spans[b][0]
            assert enc.input_ids[b, t0 - 1] == cfg.vision_start_token_id
            assert enc.input_ids[b, t1] == cfg.vision_end_token_id


def test_text_span_mapped_through_image_expansion(vlm):
    enc = enc2(vlm)
    (t0, t1), *_ = enc.spans[0]
    assert vlm.tokenizer.decode(enc.input_ids[0, t0:t1]).strip() == "this"
    assert enc.spans[1] == []
    img0 = enc.image_spans[0][0]
    assert img0[1] <= t0  # the image comes before the question (placeholder prepended)


def test_left_padding_shifts_spans_only(vlm):
    batch = enc2(vlm)
    for b, prompt in enumerate(PROMPTS):
        one = encode_image_prompts(vlm, prompt, images2()[b])
        pad = batch.length - one.length
        assert (batch.attention_mask[b, :pad] == 0).all()
        assert batch.input_ids[b, pad:].tolist() == one.input_ids[0].tolist()
        assert batch.image_spans[b] == [(s + pad, e + pad) for s, e in one.image_spans[0]]
        assert batch.spans[b] == [(s + pad, e + pad) for s, e in one.spans[0]]


def test_chat_content_items_equal_placeholder_text(vlm):
    from heads.inputs.images import image_placeholder

    ph = image_placeholder(vlm.processor, vlm.model.config)
    items = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = [{"role": "user", "content": ph + "What is it?"}]
    a = encode_image_prompts(vlm, items, image(3))
    b = encode_image_prompts(vlm, text, image(3))
    assert a.input_ids.tolist() == b.input_ids.tolist()
    embedded = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image(3)}, {"type": "text", "text": "What is it?"}],
        }
    ]
    c = encode_image_prompts(vlm, embedded)
    assert c.input_ids.tolist() == a.input_ids.tolist()
    for key, value in a.inputs.items():
        assert torch.equal(value, c.inputs[key]), key


def test_one_span_per_image_in_a_mixed_batch(vlm):
    """Rows with one, no and two images (LLaVA's two adjacent runs are split per image);
    the batch generates like single runs."""
    prompts, ims = (
        ["What is **this**?", "no image", "compare the two"],
        [image(0), None, [image(1), image(2)]],
    )
    enc = encode_image_prompts(vlm, prompts, ims)
    n = IMAGE_TOKENS[kind(vlm)]
    assert [[e - s for s, e in row] for row in enc.image_spans] == [[n], [], [n, n]]
    union = enc.image_mask()
    assert union.tolist() == (enc.input_ids == image_token_id(vlm.model.config)).tolist()
    sm = SteeredModel(vlm)
    batch = sm.generate(prompts, images=ims, steer=STEER, max_new_tokens=3, require_fired=False)
    for b in (0, 2):
        one = sm.generate(prompts[b], images=ims[b], steer=STEER, max_new_tokens=3)
        assert one.token_ids[0] == batch.token_ids[b]


def test_image_spans_function_on_ids(vlm):
    enc = enc2(vlm)
    assert image_spans(enc.input_ids, vlm.model.config) == enc.image_spans
    text_only = encode_prompts(vlm.tokenizer, "no image here")
    assert image_spans(text_only.input_ids, vlm.model.config) == [[]]


# ------------------------------------------------------------------ forward and positions


def test_left_pad_batch_logits_equal_single_runs(vlm):
    batch = enc2(vlm)
    logits = forward(vlm, batch)
    for b, prompt in enumerate(PROMPTS):
        one = encode_image_prompts(vlm, prompt, images2()[b])
        want = forward(vlm, one)[0]
        pad = batch.length - one.length
        torch.testing.assert_close(logits[b, pad:], want, atol=1e-5, rtol=0)


def test_mrope_positions_are_3d_and_match_the_model(vlm):
    enc = enc2(vlm)
    if kind(vlm) != "qwen2_vl":
        assert enc.mrope_position_ids is None and enc.position_ids().shape == enc.input_ids.shape
        return
    pos = enc.position_ids()
    assert pos.shape == (3, 2, enc.length)
    (t0, t1) = enc.image_spans[0][0]
    # the 2x2 merged grid of a 16x16 image: height ids 0,0,1,1 and width ids 0,1,0,1 above the start
    h = pos[1, 0, t0:t1] - pos[1, 0, t0]
    w = pos[2, 0, t0:t1] - pos[2, 0, t0]
    assert h.tolist() == [0, 0, 1, 1] and w.tolist() == [0, 1, 0, 1]
    assert (pos[:, 0, t1] == pos[:, 0, t0:t1].max() + 1).all()  # text resumes after the image
    # the model computing its own positions (no position_ids) gives the same logits
    inputs = enc.model_inputs()
    del inputs["position_ids"]
    vlm.model.model.rope_deltas = None
    with torch.no_grad():
        own = vlm.model(**inputs, use_cache=False).logits
    real = enc.attention_mask.bool()
    torch.testing.assert_close(forward(vlm, enc)[real], own[real], atol=1e-5, rtol=0)


# ------------------------------------------------------------------ generation


def test_generate_with_pasta_on_image_span(vlm):
    sm = SteeredModel(vlm)
    g = sm.generate(PROMPTS, images=images2(), steer=STEER, max_new_tokens=NEW)
    assert len(g) == 2 and all(len(ids) == NEW or ids[-1] == 2 for ids in g.token_ids)
    assert g.image_spans == enc2(vlm).image_spans


def _gen_logits(hm, enc, edits, use_cache):
    with editing(hm, edits), torch.no_grad():
        out = hm.model.generate(
            **enc.inputs,
            input_ids=enc.input_ids,
            attention_mask=enc.attention_mask,
            max_new_tokens=NEW,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=2,
            eos_token_id=None,
            use_cache=use_cache,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("steered", [False, True])
def test_kv_cache_on_off_equal(vlm, steered):
    enc = enc2(vlm)
    edits = STEER.edits(vlm, enc) if steered else []
    seq_c, log_c = _gen_logits(vlm, enc, edits, True)
    seq_n, log_n = _gen_logits(vlm, enc, edits, False)
    assert seq_c.tolist() == seq_n.tolist()
    torch.testing.assert_close(log_c, log_n, atol=1e-4, rtol=0)


def test_left_padded_batch_generation_equals_single_runs(vlm):
    sm = SteeredModel(vlm)
    batch = sm.generate(PROMPTS, images=images2(), steer=STEER, max_new_tokens=NEW)
    for b, prompt in enumerate(PROMPTS):
        one = sm.generate(prompt, images=images2()[b], steer=STEER, max_new_tokens=NEW)
        assert one.token_ids[0] == batch.token_ids[b]


def test_pasta_raises_attention_mass_on_the_image(vlm):
    """At layer 0 (same inputs) a steered head's image mass m becomes m / (m + alpha (1 - m))
    (docs/methods/pasta.md with G = the image span); unsteered heads stay bitwise equal."""
    enc = enc2(vlm)
    plain, steered = Recorder(layer=0), Recorder(layer=0)
    with editing(vlm, [plain]):
        forward(vlm, enc)
    with editing(vlm, [*STEER.edits(vlm, enc), steered]):
        forward(vlm, enc)
    p0, p1 = plain.records[0], steered.records[0]  # [B, H, Q, K]
    img = enc.image_mask()[:, None, None, :]
    m0 = (p0 * img).sum(-1)[:, :, -1]  # last query row, [B, H]
    m1 = (p1 * img).sum(-1)[:, :, -1]
    a = STEER.alpha
    torch.testing.assert_close(m1[:, :2], m0[:, :2] / (m0[:, :2] + a * (1 - m0[:, :2])), atol=1e-5, rtol=0)
    assert (m1[:, :2] > m0[:, :2] + 0.05).all()
    assert torch.equal(p1[:, 2:], p0[:, 2:])


def test_pasta_changes_generation(vlm):
    sm = SteeredModel(vlm)
    plain = sm.generate(PROMPTS, images=images2(), max_new_tokens=NEW)
    strong = dataclasses.replace(STEER, heads=[0, 1], alpha=1e-4)
    steered = sm.generate(PROMPTS, images=images2(), steer=strong, max_new_tokens=NEW)
    assert steered.token_ids != plain.token_ids


def test_only_the_language_model_attention_is_switched(vlm):
    enc = enc2(vlm)
    vision = vlm.model.config.vision_config
    text = vlm.model.config.text_config
    before = vision._attn_implementation
    seen = {}

    def grab(probs, call):
        seen["text"] = text._attn_implementation
        seen["vision"] = vision._attn_implementation
        return None

    with editing(vlm, [Recorder(layer=1, fn=grab)]):
        forward(vlm, enc)
    assert seen["text"].startswith("headsteer_") and seen["vision"] == before
    assert text._attn_implementation == "sdpa"


# ------------------------------------------------------------------ loading


def test_load_model_on_a_vlm_folder(vlm, tmp_path):
    folder = save_tiny_vlm(vlm, tmp_path / kind(vlm))
    hm = load_model(folder)
    assert hm.processor is not None and type(hm.model).__name__ == type(vlm.model).__name__
    assert (hm.n_layers, hm.n_heads, hm.n_kv_heads, hm.d_head) == (
        vlm.n_layers,
        vlm.n_heads,
        vlm.n_kv_heads,
        16,
    )
    assert hm.model.config.text_config._attn_implementation == "sdpa"
    a, b = enc2(vlm), enc2(hm)
    assert a.input_ids.tolist() == b.input_ids.tolist()
    torch.testing.assert_close(forward(hm, b), forward(vlm, a), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="device_map is not supported for vision-language"):
        load_model(folder, device_map="auto")  # refused, not silently ignored


# ------------------------------------------------------------------ bad input


def test_bad_image_inputs(vlm, tiny_llama):
    with pytest.raises(ValueError, match="not a vision-language model"):
        SteeredModel(tiny_llama).generate("hi", images=image(0), max_new_tokens=1)
    with pytest.raises(ValueError, match="3 entries for 2 prompts"):
        encode_image_prompts(vlm, ["hi", "ho"], [image(0), image(1), image(2)])
    ph = vlm.processor.image_token
    with pytest.raises(ValueError, match="image placeholders"):
        encode_image_prompts(vlm, f"{ph} and {ph}", [image(0)])
    with pytest.raises(ValueError, match="needs prompts with images"):
        STEER.edits(vlm, encode_image_prompts(vlm, "no image"))
    with pytest.raises(ValueError, match="unknown spans"):
        Pasta(heads=[0], spans="picture")
    with pytest.raises(ValueError, match="images given both"):
        encode_image_prompts(
            vlm, [[{"role": "user", "content": [{"type": "image", "image": image(0)}]}]], image(1)
        )


def test_idefics3_split_image_gives_one_span_per_tile():
    hm = make_tiny_vlm("idefics3")
    improc = hm.processor.image_processor
    improc.do_image_splitting, improc.size = True, {"longest_edge": 32}
    enc = encode_image_prompts(hm, "What?", image(0, size=32))
    n = IMAGE_TOKENS["idefics3"]
    assert [e - s for s, e in enc.image_spans[0]] == [n] * 5  # 2 x 2 tiles + the global view
    assert enc.image_mask()[0].tolist() == (enc.input_ids[0] == image_token_id(hm.model.config)).tolist()
    assert enc.inputs["pixel_values"].shape[:2] == (1, 5)
    g = SteeredModel(hm).generate("What?", images=image(0, size=32), steer=STEER, max_new_tokens=2)
    assert len(g.token_ids[0]) == 2


def test_qwen2_vl_image_tokens_outside_vision_markers_are_refused():
    cfg = make_tiny_vlm("qwen2_vl").model.config
    ids = torch.tensor([[5, cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id, 6]])
    assert image_spans(ids, cfg) == [[(2, 3)]]
    with pytest.raises(ValueError, match="outside a vision start/end"):
        image_spans(torch.tensor([[5, cfg.image_token_id, 6]]), cfg)
    with pytest.raises(ValueError, match="unbalanced"):
        image_spans(torch.tensor([[cfg.vision_start_token_id, cfg.image_token_id]]), cfg)
