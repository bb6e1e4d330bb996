"""AdaptVis / ScalingVis against a re-implementation of the reference's scaled attention.

The oracle re-implements `shiqichen17/AdaptVis`, `model_zoo/llama/modeling_llama_add_attn.py`,
`LlamaAttention.forward` (the lines from `attn_weights = torch.matmul(query_states, ...)` to the
softmax): the raw logits `q k^T / sqrt(d)` of the last query row on the image keys
(`start_idx..end_idx` of `keys`) are multiplied by `weight` in every layer (`idx < 32`), before the
mask is added; only when the logits are square (the uncached prefill). The confidence switch
re-implements `model_zoo/llava15.py`, `get_out_scores_wh_batched` (`uncertainty < threshold`
-> `weight1`, else `weight2`).
"""

from __future__ import annotations

import pytest
import torch

from heads import encode_prompts, forward
from heads.engine.context import editing
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from steer import SteeredModel
from steer.adaptvis import AdaptVis, ScalingVis, first_token_confidence
from tests.support import make_tiny
from tests.support.oracle import _rms, _rope
from tests.support.vlm_models import image as tiny_image
from tests.support.vlm_models import make_tiny_vlm


@pytest.fixture(scope="module")
def vlm():
    return make_tiny_vlm("llava", attn="eager")


@torch.no_grad()
def _reference_llama(text_model, lm_head, embeds, image_cols, weight):
    """Logits `[1, T, V]` of the Llama text stack on `embeds` `[1, T, D]` (one unpadded row) with
    the reference's scaling: `attn_weights[:, :, mask] *= weight`, mask = (row -1, image columns)."""
    cfg = text_model.config
    T = embeds.shape[1]
    pos = torch.arange(T)[None]
    causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    h = embeds
    for layer in text_model.layers:
        att = layer.self_attn
        d = att.head_dim
        x = _rms(h, layer.input_layernorm.weight, cfg.rms_norm_eps)
        q = att.q_proj(x).view(1, T, -1, d).transpose(1, 2)
        k = att.k_proj(x).view(1, T, -1, d).transpose(1, 2)
        v = att.v_proj(x).view(1, T, -1, d).transpose(1, 2)
        q, k = (
            _rope(q, pos, cfg.rope_parameters["rope_theta"]),
            _rope(k, pos, cfg.rope_parameters["rope_theta"]),
        )
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / d**0.5
        mask = torch.zeros(T, T, dtype=torch.bool)
        mask[-1, image_cols[0] : image_cols[-1] + 1] = True  # start_idx .. end_idx
        attn_weights[:, :, mask] *= weight
        attn_weights = attn_weights + causal
        p = torch.softmax(attn_weights, dim=-1, dtype=torch.float32)
        h = h + att.o_proj((p @ v).transpose(1, 2).reshape(1, T, -1))
        x = _rms(h, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        mlp = layer.mlp
        h = h + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    return lm_head(_rms(h, text_model.norm.weight, cfg.rms_norm_eps))


def _merged_embeds(vlm, enc):
    """The model's own merged text+image embeddings entering the language model."""
    seen = {}
    lm = vlm.model.model.language_model

    def grab(module, args, kwargs):
        seen["x"] = kwargs["inputs_embeds"].detach().clone()

    handle = lm.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        base = forward(vlm, enc)
    finally:
        handle.remove()
    return seen["x"], base


@pytest.mark.parametrize("weight", [0.3, 2.5])
def test_scalingvis_equals_reference_scaled_attention(vlm, weight):
    enc = SteeredModel(vlm).encode(["Where is the red ball in the picture?"], images=[tiny_image(1)])
    (t0, t1) = enc.image_spans[0][0]
    embeds, base = _merged_embeds(vlm, enc)
    cols = list(range(t0, t1))
    ref1 = _reference_llama(vlm.model.model.language_model, vlm.model.lm_head, embeds, cols, 1.0)
    torch.testing.assert_close(ref1, base, atol=1e-5, rtol=1e-5)  # the oracle is the model
    ref = _reference_llama(vlm.model.model.language_model, vlm.model.lm_head, embeds, cols, weight)
    with editing(vlm, ScalingVis(weight=weight, target="image").edits(vlm, enc)):
        got = forward(vlm, enc)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert (got[0, -1] - base[0, -1]).abs().max() > 1e-3  # a real change on the last row
    torch.testing.assert_close(got[0, :-1], base[0, :-1], atol=0, rtol=0)  # earlier rows untouched


def test_adaptvis_switch_both_ways_and_per_row(vlm):
    sm = SteeredModel(vlm)
    prompts = ["Where is the red ball in the picture?", "Is the cup left of the plate here?"]
    enc = sm.encode(prompts, images=[tiny_image(1), tiny_image(2)])
    conf = first_token_confidence(vlm, enc)
    base = forward(vlm, enc)[:, -1]
    torch.testing.assert_close(conf, base.softmax(-1).max(-1).values)
    assert conf[0] != conf[1]

    def logits(method):
        with editing(vlm, method.edits(vlm, enc)):
            return forward(vlm, enc)[:, -1]

    scaled = {w: logits(ScalingVis(w)) for w in (0.2, 3.0)}
    low = AdaptVis(weight1=0.2, weight2=3.0, threshold=1.0)  # every confidence < 1: weight1
    torch.testing.assert_close(logits(low), scaled[0.2], atol=1e-6, rtol=1e-6)
    assert low.last["weight"].tolist() == pytest.approx([0.2, 0.2])
    high = AdaptVis(weight1=0.2, weight2=3.0, threshold=0.0)  # none below 0: weight2
    high.edits(vlm, enc)
    assert high.last["weight"].tolist() == pytest.approx([3.0, 3.0])
    mid = AdaptVis(weight1=0.2, weight2=3.0, threshold=float(conf.mean()))
    got = logits(mid)
    lo = int(conf.argmin())
    want = [3.0, 3.0]
    want[lo] = 0.2
    assert mid.last["weight"].tolist() == pytest.approx(want)
    for b in range(2):
        torch.testing.assert_close(got[b], scaled[want[b]][b], atol=1e-6, rtol=1e-6)


def test_generate_and_decode_steps_unedited(vlm):
    sm = SteeredModel(vlm)
    gen = sm.generate(["Describe it."], AdaptVis(), images=[tiny_image(3)], max_new_tokens=3)
    assert len(gen.token_ids[0]) >= 1
    # the text variant on a text-only model, with the fused / SDPA path elsewhere untouched
    tiny = make_tiny("llama", sm.model.tokenizer, num_hidden_layers=2)
    enc = encode_prompts(
        tiny.tokenizer, ["Context: **Alice lives in Rome.** Where does Alice live?"], chat=False
    )
    base = forward(tiny, enc)
    with editing(tiny, ScalingVis(2.0).edits(tiny, enc)):
        got = forward(tiny, enc)
    assert (got[0, -1] - base[0, -1]).abs().max() > 1e-4
    torch.testing.assert_close(got[0, :-1], base[0, :-1], atol=1e-5, rtol=1e-5)  # blocked vs SDPA
    out = SteeredModel(tiny).generate(
        ["Context: **Alice lives in Rome.** Where?"], ScalingVis(2.0), chat=False, max_new_tokens=2
    )
    assert len(out.token_ids[0]) >= 1


def test_bad_input():
    with pytest.raises(HeadsteerValueError, match="weight"):
        ScalingVis(weight=-1)
    with pytest.raises(HeadsteerTypeError, match="weight"):
        ScalingVis(weight="2")
    with pytest.raises(HeadsteerValueError, match="threshold"):
        AdaptVis(threshold=1.5)
    with pytest.raises(HeadsteerValueError, match="target"):
        AdaptVis(target="audio")
    with pytest.raises(HeadsteerValueError, match="layers"):
        ScalingVis(layers=[])


def test_no_span_and_bad_layer_raise_before_the_probe(vlm):
    tiny_enc = SteeredModel(vlm).encode(["No image here."])
    with pytest.raises(HeadsteerValueError, match="needs an image"):
        AdaptVis().edits(vlm, tiny_enc)
    enc = SteeredModel(vlm).encode(["Where?"], images=[tiny_image(1)])
    with pytest.raises(HeadsteerValueError, match="outside the model"):
        AdaptVis(layers=[7]).edits(vlm, enc)


def test_same_logits_on_the_three_backends(tokenizer):
    from tests.heads.test_backends import PROMPTS, _same, _three

    models = _three(tokenizer)
    out = {}
    for name, m in models.items():
        enc = encode_prompts(m.tokenizer, PROMPTS, chat=False)
        with editing(m, AdaptVis(weight1=2.5, weight2=2.5).edits(m, enc)):
            out[name] = forward(m, enc)[:, -1]
        base = forward(m, enc)[:, -1]
        assert (out[name] - base).abs().max() > 1e-4, name
    _same(out)
