"""EAP / EAP-IG edge scores as the reference code computes them, re-implemented as a test oracle.

Source: Hanna, Pezzelle & Belinkov 2024, "Have Faith in Faithfulness" (EAP-IG), reference code
https://github.com/hannamw/EAP-IG at commit 795f5607b25638935aec89aee3c1cb4bd9ed72f1 (MIT
licence, (c) 2025 Michael Hanna):

* `src/eap/graph.py`: the graph. Forward (source) nodes `input` (`hook_embed`), every head
  `a{l}.h{h}` (`blocks.{l}.attn.hook_result`: the head's output times its block of W_O) and
  every MLP `m{l}` (`hook_mlp_out`), `n_forward = 1 + L (H + 1)`, forward index
  `1 + l (H + 1) + h` and `1 + l (H + 1) + H`; backward (destination) inputs: each head's q, k
  and v input (`hook_{q,k,v}_input`, one residual copy per head: `use_split_qkv_input`, GQA
  un-grouped), each MLP's input (`hook_mlp_in`) and the logits (`blocks.{L-1}.hook_resid_post`),
  `n_backward = L (3 H + 1) + 1`, backward index `l (3 H + 1) + "qkv".index(x) H + h`,
  `l (3 H + 1) + 3 H` and `-1`; `Graph.prev_index` (the sources of an input: every forward node
  before `1 + l (H + 1)` for a head's inputs, before `1 + l (H + 1) + H` for an MLP's, all for
  the logits).
* `src/eap/utils.py`, `make_hooks_and_matrices`: `activation_difference [B, T, n_forward, D]`
  gets the corrupted run's activations added and the clean run's subtracted; the gradient hook
  on each destination adds `einsum(activation_difference[:, :, :prev_index], grads,
  "batch pos forward hidden, batch pos backward hidden -> forward backward")` to
  `scores[:prev_index, bwd_index]`.
* `src/eap/attribute.py`: `get_scores_eap` (one backward of the metric on the clean run) and
  `get_scores_eap_ig` (the input node's activation replaced by `corrupted + (k / steps)
  (clean - corrupted)` for `k in range(0, steps)`, one backward each), then `scores /=
  total_items` (and `/= total_steps`).

Here the reference's TransformerLens hooks are replaced by a hand-written forward of a
Llama-family HF model (RMSNorm, RoPE, GQA, SwiGLU; q / k / v biases when the model has them)
in the same split layout, and the hooks' gradients by `torch.autograd.grad` on the copies;
nothing goes through headsteer. The metric is summed over the batch, so `/ total_items` makes
the scores a mean over pairs. `ks` picks the interpolation points: the reference's loop runs
k = 0..steps-1; the paper's Eq. 3 (and headsteer) k = 1..steps.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE on `[B, H, T, d]` at positions 0..T-1 (rotate-half layout)."""
    t, d = x.shape[2], x.shape[3]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def _proj(x: torch.Tensor, lin: torch.nn.Linear, heads: list[int], d: int) -> torch.Tensor:
    """`[B, H, T, d]`: per-head inputs `x [B, T, H, D]` projected by the row block `heads[h]` of `lin`."""
    w = lin.weight.view(-1, d, lin.weight.shape[1])[heads]  # [H, d, D]
    out = torch.einsum("bthD,hdD->bhtd", x, w)
    if lin.bias is not None:
        out = out + lin.bias.view(-1, d)[heads][None, :, None, :]
    return out


def split_forward(model, emb: torch.Tensor):
    """The forward from the input node's output `emb [B, T, D]` (no padding).

    Returns `(logits [B, T, V], fwd, bwd)`: `fwd` the forward nodes' outputs in forward-index
    order (`[B, T, D]` each), `bwd` the destination inputs in backward-index order (each head's
    q / k / v input `[B, T, D]`, each MLP input, the logits input), all in one autograd graph.
    """
    cfg = model.config
    inner = model.model
    n_heads, eps = cfg.num_attention_heads, cfg.rms_norm_eps
    theta = cfg.rope_parameters["rope_theta"]
    b, t, dm = emb.shape
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    fwd, bwd = [emb], []
    resid = emb
    for layer in inner.layers:
        att = layer.self_attn
        d = att.head_dim
        group = n_heads // (att.k_proj.weight.shape[0] // d)
        kv_of = [h // group for h in range(n_heads)]  # un-grouped GQA
        ins = []
        for _ in "qkv":  # split qkv input: one residual copy per head and input
            copies = [resid.clone() for _ in range(n_heads)]
            bwd += copies
            ins.append(torch.stack(copies, 2))  # [B, T, H, D]
        normed = [_rms(x, layer.input_layernorm.weight, eps) for x in ins]
        q = _rope(_proj(normed[0], att.q_proj, list(range(n_heads)), d), theta)
        k = _rope(_proj(normed[1], att.k_proj, kv_of, d), theta)
        v = _proj(normed[2], att.v_proj, kv_of, d)
        s = (q @ k.transpose(-1, -2)) * d**-0.5
        z = s.masked_fill(~causal, float("-inf")).softmax(-1) @ v  # [B, H, T, d]
        w_o = att.o_proj.weight.view(dm, n_heads, d)
        result = torch.einsum("bhtd,Dhd->bthD", z, w_o)  # hook_result
        fwd += list(result.unbind(2))
        resid = resid + result.sum(2)
        if att.o_proj.bias is not None:
            resid = resid + att.o_proj.bias
        mlp_in = resid.clone()
        bwd.append(mlp_in)
        x = _rms(mlp_in, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        out = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        fwd.append(out)
        resid = resid + out
    logits_in = resid.clone()
    bwd.append(logits_in)
    return model.lm_head(_rms(logits_in, inner.norm.weight, eps)), fwd, bwd


def _prev_index(n_layers: int, n_heads: int) -> list[int]:
    """`Graph.prev_index` of every destination, in backward-index order."""
    out = []
    for la in range(n_layers):
        out += [1 + la * (n_heads + 1)] * (3 * n_heads) + [1 + la * (n_heads + 1) + n_heads]
    return [*out, 1 + n_layers * (n_heads + 1)]


def reference_scores(
    model,
    clean: torch.Tensor,
    corrupted: torch.Tensor,
    answers: torch.Tensor,
    counterfactuals: torch.Tensor,
    *,
    method: str = "eap",
    steps: int = 5,
    ks: Iterable[int] | None = None,
) -> torch.Tensor:
    """`[n_forward, n_backward]` EAP (`method="eap"`) or EAP-IG-inputs (`"eap-ig"`) scores of
    the logit difference `logit[answer] - logit[counterfactual]` at the last position, on
    clean / corrupted token ids `[N, T]` of one length. `ks`: the EAP-IG points `k / steps`
    (default `range(0, steps)`, the reference's loop)."""
    cfg = model.config
    n_layers, n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    embed = model.model.embed_tokens
    rows = torch.arange(clean.shape[0])

    def metric(logits: torch.Tensor) -> torch.Tensor:  # summed over the batch
        last = logits[:, -1]
        return (last[rows, answers] - last[rows, counterfactuals]).sum()

    with torch.no_grad():
        e_corr, e_clean = embed(corrupted), embed(clean)
        _, f_corr, _ = split_forward(model, e_corr)
        _, f_clean, _ = split_forward(model, e_clean)
        diff = torch.stack(f_corr, 2) - torch.stack(f_clean, 2)  # activation_difference [B, T, F, D]
    prev = _prev_index(n_layers, n_heads)
    scores = torch.zeros(diff.shape[2], len(prev))
    points = [None] if method == "eap" else list(range(0, steps) if ks is None else ks)
    for k in points:
        x = e_clean if k is None else e_corr + (k / steps) * (e_clean - e_corr)
        logits, _, bwd = split_forward(model, x.detach().requires_grad_())
        grads = torch.autograd.grad(metric(logits), bwd)
        for j, g in enumerate(grads):  # the gradient hook of destination j
            scores[: prev[j], j] += torch.einsum("btfd,btd->f", diff[:, :, : prev[j]], g)
    return scores / clean.shape[0] / len(points)


def fold_to_kv_heads(scores: torch.Tensor, n_layers: int, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """Reference scores `[n_forward, L (3 H + 1) + 1]` in headsteer's layout `[U, L (H + 2 G + 1) + 1]`:
    an edge into KV head g's k (v) input is the sum of the un-grouped edges into the k (v)
    inputs of its query heads (the KV head's input feeds all of them)."""
    group = n_heads // n_kv_heads
    cols = []
    for la in range(n_layers):
        base = la * (3 * n_heads + 1)
        cols.append(scores[:, base : base + n_heads])
        for x in (1, 2):
            per_head = scores[:, base + x * n_heads : base + (x + 1) * n_heads]
            cols.append(per_head.view(-1, n_kv_heads, group).sum(-1))
        cols.append(scores[:, base + 3 * n_heads : base + 3 * n_heads + 1])
    return torch.cat([*cols, scores[:, -1:]], 1)
