"""A hand-built 2-layer attention-only GPT-2 whose heads have known roles by construction."""

from __future__ import annotations

import torch

from heads import HeadModel

V, NPOS, BOS = 64, 112, 0


def make_role_model(attn: str = "sdpa") -> HeadModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    # residual layout (each feature f is a +/- pair in dims 2f, 2f+1 so LayerNorm's mean is 0):
    # features: token one-hot [0, V), position one-hot [V, V+NPOS), previous token [V+NPOS, 2V+NPOS)
    n_head, dh = 4, V + NPOS  # a head reads tokens and positions at once (176 dims)
    d = n_head * dh  # 704 = 2 x 352 features (2V + NPOS used, the rest unused)
    cfg = GPT2Config(
        vocab_size=V,
        n_positions=NPOS,
        n_embd=d,
        n_layer=2,
        n_head=n_head,
        n_inner=4,
        bos_token_id=BOS,
        eos_token_id=1,
        pad_token_id=1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-12,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = attn
    m = GPT2LMHeadModel(cfg).eval()
    tok0, pos0, prev0 = 0, V, V + NPOS

    def vec(f):  # the +/- pair of feature f, as a [d] vector
        v = torch.zeros(d)
        v[2 * f], v[2 * f + 1] = 1.0, -1.0
        return v

    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        for t in range(V):
            m.transformer.wte.weight[t] = vec(tok0 + t)
        for i in range(NPOS):
            m.transformer.wpe.weight[i] = vec(pos0 + i)
        for ln in (
            [m.transformer.ln_f] + [b.ln_1 for b in m.transformer.h] + [b.ln_2 for b in m.transformer.h]
        ):
            ln.weight.fill_(1.0)
        # LayerNorm of x = sum of k unit pairs: x * sqrt(d / (2k)); read the + dim of a pair
        s0 = (d / 4) ** 0.5  # layer 0: token + position
        s1 = (d / 6) ** 0.5  # layer 1: token + position + previous token
        big = 40.0 * dh**0.5  # logit margin 40 after the 1/sqrt(dh) scale

        def qkv(block):
            w = block.attn.c_attn.weight  # [d, 3d] (Conv1D: in x out)
            return w[:, :d], w[:, d : 2 * d], w[:, 2 * d :]

        b0, b1 = m.transformer.h
        q, k, v = qkv(b0)
        o = b0.attn.c_proj.weight  # [d (heads' outputs), d]
        # L0H0 previous token: query at position i matches key position i - 1
        for i in range(1, NPOS):
            q[2 * (pos0 + i), 0 * dh + (i - 1)] = big / s0
        for j in range(NPOS):
            k[2 * (pos0 + j), 0 * dh + j] = 1.0 / s0
        for t in range(V):  # value: the key's token; written into the previous-token feature
            v[2 * (tok0 + t), 0 * dh + t] = 1.0 / s0
            o[0 * dh + t] = vec(prev0 + t)
        # L0H1 self: query position i matches key position i
        for i in range(NPOS):
            q[2 * (pos0 + i), 1 * dh + i] = big / s0
            k[2 * (pos0 + i), 1 * dh + i] = 1.0 / s0
        # L0H2, L0H3: zero Q/K -> uniform, zero V
        q, k, v = qkv(b1)
        o = b1.attn.c_proj.weight
        # L1H0 induction: query token t matches keys whose previous token is t; copies the key's token
        for t in range(V):
            q[2 * (tok0 + t), 0 * dh + t] = big / s1
            k[2 * (prev0 + t), 0 * dh + t] = 1.0 / s1
            v[2 * (tok0 + t), 0 * dh + t] = 1.0 / s1
            o[0 * dh + t] = 3.0 * vec(tok0 + t)
        # L1H1 duplicate token: query token t matches keys holding t, minus its own position
        for t in range(V):
            q[2 * (tok0 + t), 1 * dh + t] = big / s1
            k[2 * (tok0 + t), 1 * dh + t] = 1.0 / s1
        for i in range(NPOS):  # minus twice the margin on its own position
            q[2 * (pos0 + i), 1 * dh + V + i] = -2.0 * big / s1
            k[2 * (pos0 + i), 1 * dh + V + i] = 1.0 / s1
    return HeadModel(m, None, name="hand-built-roles")
