"""Attribution patching on pairs equals TransformerLens' attribution patching on the same weights.

The reference is the recipe of Nanda's "Attribution patching" notebook (2023), re-implemented
here on a TransformerLens `TransformerBridge` over a second copy of a tiny Llama: forward and
backward hooks cache every `hook_z` / `hook_attn_out` / `hook_mlp_out` / `hook_resid_pre`
activation and its gradient on the corrupted run, `run_with_cache` the clean activations, and
the estimate is `M(corrupted) + sum (clean - corrupted) * grad` (denoising). Pairs of equal token
length (TransformerLens takes ids without a mask).
"""

from __future__ import annotations

import pytest
import torch

from heads import SweepOptions
from heads.scorers.patching import encode_pairs
from heads.scorers.patching.activation import patch
from tests.heads.patching.test_tl_compare import PAIRS
from tests.support import make_tiny

pytest.importorskip("transformer_lens")

HOOKS = {
    "head_out": "attn.hook_z",
    "attn_out": "hook_attn_out",
    "mlp_out": "hook_mlp_out",
    "resid_pre": "hook_resid_pre",
}


def test_every_kind_equals_transformer_lens_attribution(tokenizer):
    from transformer_lens.model_bridge import TransformerBridge

    hf = make_tiny("llama", tokenizer)
    bridge = TransformerBridge.boot_transformers(
        "tiny", hf_model=make_tiny("llama", tokenizer).model, tokenizer=tokenizer
    )
    pairs = encode_pairs(tokenizer, PAIRS)
    assert bool(pairs.attention_mask.all())
    rows, c, w = torch.arange(pairs.n), pairs.answers[:, 0], pairs.counterfactuals[:, 0]
    names = [f"blocks.{la}.{h}" for la in range(hf.n_layers) for h in HOOKS.values()]
    acts: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    bridge.reset_hooks()
    for name in names:
        bridge.add_hook(name, lambda act, hook, name=name: acts.__setitem__(name, act.detach()), "fwd")
        bridge.add_hook(name, lambda act, hook, name=name: grads.__setitem__(name, act.detach()), "bwd")
    try:
        last = bridge(pairs.corrupted_ids)[:, -1].float()
        metric = last[rows, c] - last[rows, w]
        metric.sum().backward()
    finally:
        bridge.reset_hooks()
    with torch.no_grad():
        _, clean = bridge.run_with_cache(pairs.clean_ids, names_filter=lambda n: n in set(names))
    for kind, hook in HOOKS.items():
        ours = patch(hf, pairs, kind, method="attribution", options=SweepOptions(progress=False))
        want = []
        for la in range(hf.n_layers):
            name = f"blocks.{la}.{hook}"
            prod = (clean[name] - acts[name]) * grads[name]  # [N, T, H, d] or [N, T, D]
            cell = prod.sum((1, 3)) if kind == "head_out" else prod.sum(-1)  # [N, H] / [N, T]
            want.append(metric.detach()[:, None] + cell)
        want_t = torch.stack(want).movedim(1, -1)
        scale = max(1.0, float(ours.raw.abs().max()))
        assert want_t.shape == ours.raw.shape, kind
        assert float((want_t - ours.raw).abs().max()) <= 1e-6 * scale, kind
