"""VAR against the reference code's pitfalls (docs/methods/var.md section 6) on tiny random models:
skip_last, the VLM prompt and loading, GQA weights, both LLaVA checkpoint layouts."""

from __future__ import annotations

import pytest
import torch

from heads import forward
from heads.engine.context import editing
from heads.engine.edits import Recorder
from steer import SteeredModel
from steer.var import Var, VarEdit
from tests.support import make_tiny
from tests.support.var import DIM, TAU, _enc, _sink_positions, planted
from tests.support.vlm_models import image as tiny_image
from tests.support.vlm_models import make_tiny_vlm


@pytest.fixture(scope="module")
def llama(tokenizer):
    return make_tiny("llama", tokenizer, num_hidden_layers=4)


# ------------------------------------------------------- the reference code's pitfalls (docs/methods/var.md)
def test_skip_last_leaves_the_last_layer_pattern_untouched(llama):
    """§6.6: with skip_last the last layer's pattern is exactly the unedited softmax of its own
    inputs, while the layer before it is edited; without skip_last the last layer changes too."""
    enc = _enc(llama)
    pos = _sink_positions(enc)
    last = llama.n_layers - 1

    def pre_post(var, layer):
        pre, post = Recorder(layer=layer), Recorder(layer=layer)
        with planted(llama, pos), editing(llama, [pre, *var.edits(llama, enc), post]):
            forward(llama, enc)
        return pre.records[0], post.records[0]

    skip = Var(sink_dims=(DIM,), tau=TAU, layers=(last - 1, last))
    a, b = pre_post(skip, last)
    assert torch.equal(a, b)  # nothing touches layer L-1
    a, b = pre_post(skip, last - 1)
    assert not torch.equal(a, b)  # ... while layer L-2 is edited
    a, b = pre_post(Var(sink_dims=(DIM,), tau=TAU, layers=(last,), skip_last=False), last)
    assert not torch.equal(a, b)


def test_vlm_prompt_is_the_processors_own_input_and_loading_is_by_keyword(tmp_path):
    """§6.2: the encoded row is exactly the processor's output for the rendered prompt (no
    segment-wise re-tokenisation that drops BOS / special tokens). §6.3: loading options are
    keyword-only and the dtype asked for is the dtype loaded."""
    from heads import load_model
    from tests.support.vlm_models import save_tiny_vlm

    vlm = make_tiny_vlm("llava")
    enc = SteeredModel(vlm).encode(["Describe the image."], images=[tiny_image(1)])
    own = vlm.processor(text=enc.texts, images=[tiny_image(1)], return_tensors="pt")
    assert enc.input_ids[0][enc.attention_mask[0].bool()].tolist() == own["input_ids"][0].tolist()
    folder = save_tiny_vlm(vlm, tmp_path / "llava")
    with pytest.raises(TypeError):
        load_model(folder, torch.bfloat16)  # type: ignore[misc]
    for dtype in (torch.float32, torch.bfloat16):
        hm = load_model(folder, dtype=dtype)
        assert {p.dtype for la in hm.layers for p in la.parameters()} == {dtype}


def test_gqa_weights_per_query_head_values_repeated(llama):
    """§6.12: on a GQA model (4 query heads, 2 KV heads) the edited weights are per query head and
    each head's output is its edited row times its own KV head's values."""
    assert llama.n_kv_heads < llama.n_heads
    enc = _enc(llama)
    pos = _sink_positions(enc)
    layer = 1
    var = Var(sink_dims=(DIM,), tau=TAU, layers=(layer,))
    post = Recorder(layer=layer)
    got: dict[str, torch.Tensor] = {}
    attn = llama.attentions[layer]
    h1 = attn.v_proj.register_forward_hook(lambda m, a, out: got.__setitem__("v", out))
    h2 = llama.out_projs[layer].register_forward_pre_hook(lambda m, a: got.__setitem__("z", a[0]))
    try:
        edits = var.edits(llama, enc)
        with planted(llama, pos), editing(llama, [*edits, post]):
            forward(llama, enc)
    finally:
        h1.remove()
        h2.remove()
    probs = post.records[0]  # [B, H, T, T]: one (edited) pattern per query head
    assert probs.shape[1] == llama.n_heads
    b, t = enc.input_ids.shape
    v = got["v"].view(b, t, llama.n_kv_heads, llama.d_head).transpose(1, 2)  # [B, G, T, d]
    v = v.repeat_interleave(llama.n_heads // llama.n_kv_heads, dim=1)  # query head h reads KV head h // 2
    oracle = (probs @ v).transpose(1, 2).reshape(b, t, -1)
    torch.testing.assert_close(got["z"], oracle, atol=1e-5, rtol=1e-5)
    assert int(edits[0].selected.sum()) > 0  # VAR did edit rows of this layer


def test_both_llava_checkpoint_layouts_load_the_same_heads(tmp_path):
    """Module paths: a LLaVA folder in the older module layout (`language_model.model.
    layers...`, `language_model.lm_head`; what `save_pretrained` still writes) and one in the
    current layout (`model.language_model.layers...`) load to the same model, with the heads
    found at `model.model.language_model`, so VAR and VHR edit the same layers."""
    from safetensors.torch import load_file, save_file

    from heads import load_model
    from tests.support.vlm_models import save_tiny_vlm

    vlm = make_tiny_vlm("llava")
    enc = SteeredModel(vlm).encode(["Describe the image."], images=[tiny_image(1)])
    want = forward(vlm, enc)
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    save_tiny_vlm(vlm, old_dir)
    save_tiny_vlm(vlm, new_dir)
    (file,) = list(new_dir.glob("*.safetensors"))
    state = load_file(str(file))
    assert any(k.startswith("language_model.model.layers.") for k in state)  # the older layout

    def current(key: str) -> str:
        for before, now in (
            ("language_model.model.", "model.language_model."),
            ("language_model.lm_head.", "lm_head."),
            ("vision_tower.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
        ):
            if key.startswith(before):
                return now + key[len(before) :]
        return key

    save_file({current(k): v for k, v in state.items()}, str(file), metadata={"format": "pt"})
    assert any(k.startswith("model.language_model.layers.") for k in load_file(str(file)))
    var = Var(sink_dims=(DIM,), tau=1.0)
    for folder in (old_dir, new_dir):
        hm = load_model(folder)
        assert hm.layers[0] is hm.model.model.language_model.layers[0]
        torch.testing.assert_close(forward(hm, enc), want, atol=1e-6, rtol=0)
        assert [e.layer for e in var.edits(hm, enc) if isinstance(e, VarEdit)] == [0]
