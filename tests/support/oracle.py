"""An independent, plain eager re-computation of a Llama-family forward pass.

Written from the architecture's definition (RMSNorm, RoPE, GQA attention, SwiGLU
MLP), not from headsteer's engine: tests compare headsteer against it. A
`transform(layer, probs)` hook may rewrite the post-softmax attention
`[B, H, T, T]` of each layer, which is how the paper form of PASTA (Eq. 2) is
applied here.
"""

from __future__ import annotations

import torch


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos[..., None].float() * inv  # [B, T, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@torch.no_grad()
def llama_forward(model, input_ids, attention_mask, transform=None) -> torch.Tensor:
    """Logits `[B, T, V]` of a HF Llama/Mistral/Qwen2 model, recomputed by hand."""
    cfg = model.config
    inner = model.model
    mask = attention_mask.bool()
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    B, T = input_ids.shape
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    allowed = causal[None, None] & mask[:, None, None, :]
    theta = cfg.rope_parameters["rope_theta"]
    h = inner.embed_tokens(input_ids)
    for li, layer in enumerate(inner.layers):
        att = layer.self_attn
        d = att.head_dim
        x = _rms(h, layer.input_layernorm.weight, cfg.rms_norm_eps)
        q = att.q_proj(x).view(B, T, -1, d).transpose(1, 2)
        k = att.k_proj(x).view(B, T, -1, d).transpose(1, 2)
        v = att.v_proj(x).view(B, T, -1, d).transpose(1, 2)
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = (q @ k.transpose(-1, -2)) * d**-0.5
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        p = s.softmax(-1)
        if transform is not None:
            p = transform(li, p)
        z = (p @ v).transpose(1, 2).reshape(B, T, -1)
        h = h + att.o_proj(z)
        x = _rms(h, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        mlp = layer.mlp
        h = h + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    h = _rms(h, inner.norm.weight, cfg.rms_norm_eps)
    return model.lm_head(h)


def pasta_eq2(probs, heads, g_mask, alpha, n_prompt):
    """Eq. 2 of PASTA applied to post-softmax probs on `heads` (generated columns as G).

    probs: [B, H, T, K]; g_mask: [B, n_prompt] bool (the emphasized set G).
    """
    K = probs.shape[-1]
    in_g = torch.ones(probs.shape[0], K, dtype=torch.bool)
    in_g[:, : min(K, n_prompt)] = g_mask[:, : min(K, n_prompt)]
    scale = torch.where(in_g, 1.0, alpha)[:, None, None, :]
    out = probs.clone()
    sel = list(heads)
    a = probs[:, sel] * scale
    out[:, sel] = a / a.sum(-1, keepdim=True)
    return out
