"""Full Ships sweep (every head x 16 harmful prompts): the batched engine vs two per-head loops.

The loops are what a practitioner writes today, one forward of all prompts per head with the
head's query multiplied by eps (UA ablation), then KL(p_base || p_ablated) at the last position
from fp32 log-softmax:

* TransformerLens: a `TransformerBridge` over the same weights, a hook on
  `blocks.{l}.attn.hook_q`. The bridge re-implements attention eagerly so that its hooks fire
  (TransformerLens 4.3 has no SDPA path there: switching the wrapped model to SDPA changes
  nothing), so this is TransformerLens' fast path.
* The fastest plain loop: the `transformers` model on SDPA with a torch forward hook on the
  layer's `q_proj` scaling the head's slice (RoPE is linear, so this is the query scaled), and
  only the last position unembedded (`logits_to_keep=1`).

`speedup_vs_loop` is the engine against the faster of the two (the headline);
`speedup_vs_transformer_lens` and `speedup_vs_sdpa_hook_loop` give each.

The engine (`heads.scorers.safety.ships.ships`) packs head variants into batch rows, starts each chunk at
its head's layer from the clean residual stream, and unembeds only the last position.
All score the same prompts (left-padded, positions counted from the first real token, token
tensors passed to the bridge so it adds no second BOS). The bridge switches its model to
eager attention in place, so it gets its own copy of the weights.

The bridge computes attention eagerly and the engine with SDPA, and the two fp32 kernels
differ by ~1e-5 nats on these scores; `max_abs_diff_same_kernel` compares the engine with the
SDPA hook loop, which isolates what batching, prefix reuse and trimming change.

Prints one JSON line: {"speedup_vs_loop", "max_abs_diff", "heads", "prompts", ...}, with the
1-minute load average. On a loaded machine the full sweep takes over an hour; `--prompts 2
--heads 27` (every 10th head) is a short run whose ratio is still measured within the run
(fewer heads per layer leave the engine less to share, so it understates the full sweep's
speed-up). Needs `transformer-lens` (`make bench` installs it with the pinned constraints).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from heads import SweepOptions, encode_prompts, load_model
from heads.scorers.safety.ships import TEMPLATE, ships
from probes.datasets.requests import load_requests


@torch.no_grad()
def loop_ships(bridge, enc, heads: list[tuple[int, int]], eps: float) -> torch.Tensor:
    """`[len(heads), N]` Ships from one hooked bridge forward per head."""
    ids, mask, pos = enc.input_ids, enc.attention_mask, enc.position_ids()

    def last_logp(hooks):
        logits = bridge.run_with_hooks(ids, fwd_hooks=hooks, attention_mask=mask, position_ids=pos)
        return torch.log_softmax(logits[:, -1].float(), dim=-1)

    base = last_logp([])
    out = []
    for layer, head in heads:

        def scale_query(q, hook, head=head):  # q: [batch, pos, n_heads, d_head]
            q = q.clone()
            q[:, :, head] *= eps
            return q

        lp = last_logp([(f"blocks.{layer}.attn.hook_q", scale_query)])
        out.append((base.exp() * (base - lp)).sum(-1).clamp(min=0.0))
    return torch.stack(out)


@torch.no_grad()
def hook_loop_ships(hm, enc, heads: list[tuple[int, int]], eps: float) -> torch.Tensor:
    """`[len(heads), N]` Ships from one plain SDPA `transformers` forward per head, the head's
    query slice scaled by a torch hook on `q_proj`, last position only."""
    ids, mask, pos = enc.input_ids, enc.attention_mask, enc.position_ids()
    d = hm.d_head

    def last_logp() -> torch.Tensor:
        out = hm.model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1)
        return torch.log_softmax(out.logits[:, -1].float(), -1)

    base = last_logp()
    out = []
    for layer, head in heads:

        def scale(module, args, q, head=head):
            q = q.clone()
            q[..., head * d : (head + 1) * d] *= eps
            return q

        handle = hm.layers[layer].self_attn.q_proj.register_forward_hook(scale)
        try:
            lp = last_logp()
        finally:
            handle.remove()
        out.append((base.exp() * (base - lp)).sum(-1).clamp(min=0.0))
    return torch.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument(
        "--heads", type=int, default=0, help="score this many heads, evenly spread (default 0: every head)"
    )
    args = ap.parse_args()
    from transformer_lens.model_bridge import TransformerBridge

    torch.manual_seed(0)
    hm = load_model()
    prompts = [r["prompt"] for r in load_requests("harmful", "train")[: args.prompts]]
    heads = [(la, h) for la in range(hm.n_layers) for h in range(hm.n_heads)]
    if args.heads:  # a shorter run: every k-th head, so that every layer depth is sampled
        heads = heads[:: max(1, len(heads) // args.heads)][: args.heads]

    ships(hm, prompts[:2], heads=heads[:2], eps=args.eps)  # warm-up (first-call allocations)
    t0 = time.perf_counter()
    res = ships(hm, prompts, heads=heads, eps=args.eps, options=SweepOptions(max_rows=args.max_rows))
    engine_s = time.perf_counter() - t0

    loop_model = load_model()
    bridge = TransformerBridge.boot_transformers(
        loop_model.name, hf_model=loop_model.model, tokenizer=loop_model.tokenizer
    )
    enc = encode_prompts(hm.tokenizer, [TEMPLATE.format(query=p) for p in prompts], chat=False, markup=False)
    loop_ships(bridge, enc, heads[:1], args.eps)  # warm-up
    t0 = time.perf_counter()
    loop = loop_ships(bridge, enc, heads, args.eps)  # [K, N]
    loop_s = time.perf_counter() - t0

    hook_loop_ships(hm, enc, heads[:1], args.eps)  # warm-up
    t0 = time.perf_counter()
    fast = hook_loop_ships(hm, enc, heads, args.eps)  # [K, N]
    fast_s = time.perf_counter() - t0

    engine = torch.stack([res.per_prompt[:, la, h] for la, h in heads])
    top_engine = [heads[i] for i in torch.argsort(-engine.mean(1), stable=True)[:10].tolist()]
    top_loop = [heads[i] for i in torch.argsort(-loop.mean(1), stable=True)[:10].tolist()]
    print(
        json.dumps(
            {
                "speedup_vs_loop": round(min(loop_s, fast_s) / engine_s, 2),
                "speedup_vs_transformer_lens": round(loop_s / engine_s, 2),
                "speedup_vs_sdpa_hook_loop": round(fast_s / engine_s, 2),
                "max_abs_diff": float((engine - loop).abs().max()),
                "max_abs_diff_same_kernel": float((engine - fast).abs().max()),
                "heads": len(heads),
                "prompts": len(prompts),
                "engine_seconds": round(engine_s, 1),
                "transformer_lens_seconds": round(loop_s, 1),
                "sdpa_hook_loop_seconds": round(fast_s, 1),
                "same_top10": top_engine == top_loop,
                "max_ships": round(float(engine.max()), 4),
                "load_average_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
