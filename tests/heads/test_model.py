"""HeadModel adapter: geometry and head-major weight views, read from real weights."""

import pytest
import torch

from heads import HeadModel


def test_geometry(tiny_any: HeadModel):
    hm = tiny_any
    cfg = hm.model.config
    assert hm.n_layers == cfg.num_hidden_layers
    assert hm.n_heads == cfg.num_attention_heads
    assert hm.n_kv_heads == getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    assert hm.d_model == cfg.hidden_size
    assert hm.d_vocab == cfg.vocab_size
    if cfg.model_type == "qwen2":
        assert hm.d_head == 24 and hm.d_head * hm.n_heads != hm.d_model
    assert hm.W_Q.shape == (hm.n_layers, hm.n_heads, hm.d_model, hm.d_head)
    assert hm.W_K.shape == (hm.n_layers, hm.n_kv_heads, hm.d_model, hm.d_head)
    assert hm.W_V.shape == (hm.n_layers, hm.n_kv_heads, hm.d_model, hm.d_head)
    assert hm.W_O.shape == (hm.n_layers, hm.n_heads, hm.d_head, hm.d_model)
    assert hm.W_E.shape == (hm.d_vocab, hm.d_model)
    assert hm.W_U.shape == (hm.d_model, hm.d_vocab)


def test_kv_group_map(tiny_any: HeadModel):
    hm = tiny_any
    g = hm.n_heads // hm.n_kv_heads
    assert [hm.kv_head(h) for h in range(hm.n_heads)] == [h // g for h in range(hm.n_heads)]
    assert hm.kv_group.tolist() == [h // g for h in range(hm.n_heads)]


def _projections(hm: HeadModel, layer: int, x: torch.Tensor):
    attn = hm.attentions[layer]
    if hasattr(attn, "c_attn"):
        q, k, v = attn.c_attn(x).split(hm.d_model, dim=-1)
        return (
            q - attn.c_attn.bias[: hm.d_model],
            k - attn.c_attn.bias[hm.d_model : 2 * hm.d_model],
            (v - attn.c_attn.bias[2 * hm.d_model :]),
        )
    lin = [attn.q_proj, attn.k_proj, attn.v_proj]
    return [m(x) - (m.bias if m.bias is not None else 0) for m in lin]


@torch.no_grad()
def test_weight_views_reproduce_projections(tiny_any: HeadModel):
    hm = tiny_any
    torch.manual_seed(1)
    x = torch.randn(5, hm.d_model)
    for layer in range(hm.n_layers):
        q, k, v = _projections(hm, layer, x)
        for h in range(hm.n_heads):
            sl = slice(h * hm.d_head, (h + 1) * hm.d_head)
            torch.testing.assert_close(x @ hm.W_Q[layer, h], q[:, sl], atol=1e-5, rtol=0)
        for kv in range(hm.n_kv_heads):
            sl = slice(kv * hm.d_head, (kv + 1) * hm.d_head)
            torch.testing.assert_close(x @ hm.W_K[layer, kv], k[:, sl], atol=1e-5, rtol=0)
            torch.testing.assert_close(x @ hm.W_V[layer, kv], v[:, sl], atol=1e-5, rtol=0)
        z = torch.randn(5, hm.n_heads, hm.d_head)
        o = hm.out_projs[layer]
        want = o(z.reshape(5, -1)) - (o.bias if o.bias is not None else 0)
        got = torch.einsum("bhd,hdm->bm", z, hm.W_O[layer])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_check_head_errors(tiny_llama: HeadModel):
    with pytest.raises(ValueError, match="unknown layer 3"):
        tiny_llama.check_head(3)
    with pytest.raises(ValueError, match="unknown head 4"):
        tiny_llama.check_head(0, 4)
    with pytest.raises(ValueError, match="unknown layer -1"):
        tiny_llama.check_head(-1)
    with pytest.raises(TypeError):
        tiny_llama.check_head(0, 1.5)


def test_not_a_model():
    with pytest.raises(TypeError, match=r"PreTrainedModel.*heads\.load_model\('gpt2'\)"):
        HeadModel("gpt2")
