"""Sink dims (`heads.scorers.sink_dims`, the rules of docs/methods/var.md): the sink value, the
tracker's flags, the known dims keyed by backbone config, and the embedded model's dims."""

from __future__ import annotations

import pytest
import torch

from heads import forward
from heads.engine.context import editing
from heads.scorers.sink_dims import KNOWN_SINK_DIMS, SinkTracker, default_tau, sink_dims_for, sink_value
from steer.var import Var
from tests.support import make_tiny
from tests.support.var import DIM, TAU, _enc, _sink_positions, planted


@pytest.fixture(scope="module")
def llama(tokenizer):
    return make_tiny("llama", tokenizer, num_hidden_layers=4)


# --------------------------------------------------------------------------- sink dims
def test_sink_value_bound_and_planted_flags(llama):
    x = torch.randn(3, 7, 64)
    x[..., 3] = 1e6
    phi = sink_value(x, [3])
    assert float(phi.max()) <= 8.0 + 1e-4  # <= sqrt(D)
    assert float(phi.min()) > 7.99
    enc = _enc(llama)
    pos = _sink_positions(enc)
    tr = SinkTracker([DIM], TAU, range(llama.n_layers))
    with planted(llama, pos), editing(llama, tr.edits()):
        forward(llama, enc)
    want = torch.zeros(enc.batch, enc.length, dtype=torch.bool)
    for b, ps in enumerate(pos):
        want[b, ps] = True
    assert torch.equal(tr.flags[0], want)  # exactly the planted positions
    # tau = 20 at D = 64 never fires, even with a planted massive value
    tr20 = SinkTracker([DIM], 20.0, range(llama.n_layers))
    with planted(llama, pos), editing(llama, tr20.edits()):
        forward(llama, enc)
    assert not any(bool(f.any()) for f in tr20.flags.values())
    assert tr20.observed == llama.n_layers  # one read per layer


def test_known_dims_and_unknown_backbone(llama):
    with pytest.raises(ValueError, match="no known sink dims"):
        sink_dims_for(llama)
    with pytest.raises(ValueError, match="no known sink dims"):
        Var().edits(llama, _enc(llama))
    assert sink_dims_for(llama, [1, 2]) == (1, 2)
    with pytest.raises(ValueError, match="sink dim"):
        sink_dims_for(llama, [64])
    assert KNOWN_SINK_DIMS[("llama", 4096, 32)] == (1415, 2533)
    assert default_tau(4096) == 20.0 and default_tau(576) == pytest.approx(7.5)


def test_sink_dims_keyed_by_backbone_config(tokenizer):
    """§6.5: the dims follow the backbone's config (type, width, depth), never the model's name;
    an unknown backbone raises unless dims are given. Shapes only: built on the meta device."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from heads import HeadModel

    def llava(hidden: int, layers: int, name: str) -> HeadModel:
        text = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 128,
            vocab_size=32,
        )
        vision = CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
        with torch.device("meta"):
            model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text))
        return HeadModel(model, tokenizer, name=name)

    assert sink_dims_for(llava(4096, 32, "llava-1.5-13b")) == (1415, 2533)  # 7B config, misleading name
    assert sink_dims_for(llava(5120, 40, "llava-1.5-7b")) == (2100, 4743)  # 13B config
    with pytest.raises(ValueError, match="no known sink dims"):
        sink_dims_for(llava(4096, 31, "llava-1.5-7b"))
    assert sink_dims_for(llava(4096, 31, "x"), [7]) == (7,)


@pytest.mark.real
def test_embedded_sink_dims_match_massive_activations(smol):
    from heads.scorers.sink_dims import find_sink_dims
    from heads.scorers.sinks import massive_activations

    prompts = [
        "The weather today is sunny and warm.",
        "Paris is the capital of France.",
        "Write a short poem about the sea.",
        "How do I bake bread at home?",
        "The quick brown fox jumps over the lazy dog.",
        "Explain photosynthesis in simple terms.",
        "Numbers: one, two, three.\nDone.",
        "Mountains are high. Rivers are long.",
    ]
    found = find_sink_dims(smol, prompts)
    assert found.dims == KNOWN_SINK_DIMS[("llama", 576, 30)] == sink_dims_for(smol)
    assert found.evidence["selected"].sum() == len(found.dims)
    ma = massive_activations(smol, prompts[:4], top=20)
    top_dims = ma[ma.layer >= 2]["dim"].value_counts().index[:4].tolist()
    assert set(found.dims) <= set(top_dims)
    assert found.evidence.iloc[0]["ratio_to_median_dim"] > 100
