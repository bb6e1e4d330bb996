"""Test-only oracle pieces for QK attribution and composition: an attention function that
captures the query / key / value the attention receives (registered with transformers'
`AttentionInterface`), and norms with their scale frozen (the module's own gain and bias
conventions kept, only the scale replaced). Plain torch and transformers, never the product."""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

NAME = "qk_oracle_capture"


class Stop(Exception):
    """Raised by the capture to end a forward once the layer's q / k are caught."""


STATE: dict = {}
"""What `capture` caught: `q` / `k` / `v` (`[B, H or G, T, d]`), `scaling`, `softcap`; it catches
layer `STATE["layer"]` and raises `Stop` there when `STATE["stop"]`."""


def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    if getattr(module, "layer_idx", None) == STATE.get("layer"):
        STATE["q"], STATE["k"], STATE["v"] = query.detach(), key.detach(), value.detach()
        STATE["scaling"] = scaling
        STATE["softcap"] = kw.get("softcap")
        if STATE.get("stop"):
            raise Stop
    own = sys.modules[type(module).__module__].eager_attention_forward
    return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw)


AttentionInterface.register(NAME, capture)
AttentionMaskInterface.register(NAME, eager_mask)


def sigma(norm, x: torch.Tensor) -> torch.Tensor:
    """`[..., 1]` the scale `norm` divides by (RMS, or standard deviation for LayerNorm)."""
    eps = getattr(norm, "variance_epsilon", None) or norm.eps
    x = x.float()
    if isinstance(norm, torch.nn.LayerNorm):
        return (x.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
    return (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


def frozen(norm, sigma_run: torch.Tensor):
    """The norm with its scale frozen at `sigma_run` (its own gain / bias conventions kept)."""
    own = type(norm).forward

    def forward(x):
        y = own(norm, x)
        beta = getattr(norm, "bias", None)
        shift = 0.0 if beta is None else beta
        return (y - shift) * (sigma(norm, x) / sigma_run) + shift

    return forward


def switch(hm, name):
    """Run `hm`'s attention through the function registered as `name`; returns the undo."""
    old = [(c, c._attn_implementation) for c in hm.attention_configs]
    for c, _ in old:
        c._attn_implementation_internal = name
    return lambda: [setattr(c, "_attn_implementation_internal", o) for c, o in old]
