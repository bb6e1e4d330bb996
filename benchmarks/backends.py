"""Per backend (hf, transformer_lens, nnsight) on the embedded model, fp32:

* `steered_over_unsteered`: PASTA-steered over unsteered greedy-generation throughput (tokens/s
  ratio; goal >= 0.9 on each backend), same prompts, KV cache on, best of `--repeats`.
* `ships_speedup`: Ships (UA ablation) over a set of heads with the variant engine
  (`heads.ships.ships`: head variants packed into batch rows, prefix reuse) over a per-head loop
  on the same backend (one full forward per head with one `QueryScale(eps)` edit; goal >= 3x).

Prints one JSON line: {"steered_over_unsteered": {backend: ratio}, "ships_speedup": {backend: ratio},
"heads", "prompts", "new_tokens"}.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from heads import QueryScale, editing, encode_prompts, forward, load_model
from heads.ships import TEMPLATE, ships
from steer import Pasta, SteeredModel

BACKENDS = ("hf", "transformer_lens", "nnsight")
PROMPTS = [
    "Answer in one word. The capital of **France** is",
    "Summarise: the **meeting moved to Friday** because the room was booked.",
    "Translate to French, **keeping it formal**: good morning",
    "List three colours, **in alphabetical order**:",
]
QUERIES = ["Paris is the capital of", "Water boils at", "The opposite of hot is", "Two plus two is"]


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


@torch.no_grad()
def loop_ships(model, heads, eps: float = 1e-5) -> torch.Tensor:
    enc = encode_prompts(
        model.tokenizer, [TEMPLATE.format(query=q) for q in QUERIES], chat=False, markup=False
    )
    base = torch.log_softmax(forward(model, enc)[:, -1].float(), -1)
    out = []
    for layer, head in heads:
        with editing(model, [QueryScale(layer=layer, heads=[head], factor=eps)]):
            lp = torch.log_softmax(forward(model, enc)[:, -1].float(), -1)
        out.append((base.exp() * (base - lp)).sum(-1).clamp(min=0.0))
    return torch.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4, help="Ships over every head of the first LAYERS layers")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    steered, speedup = {}, {}
    n_heads = 0
    for name in BACKENDS:
        hm = load_model(backend=name)
        sm = SteeredModel(hm)
        pasta = Pasta(heads={layer: list(range(hm.n_heads)) for layer in (8, 12, 16)}, alpha=0.01)

        def gen(steer, sm=sm):
            sm.generate(PROMPTS, steer=steer, max_new_tokens=args.new_tokens, chat=False, require_fired=False)

        gen([])  # warm-up
        t_plain = best(lambda gen=gen: gen([]), args.repeats)
        t_steer = best(lambda gen=gen, p=pasta: gen([p]), args.repeats)
        steered[name] = round(t_plain / t_steer, 3)
        heads = [(la, h) for la in range(args.layers) for h in range(hm.n_heads)]
        n_heads = len(heads)
        spec = {la: list(range(hm.n_heads)) for la in range(args.layers)}
        t_engine = best(lambda hm=hm, spec=spec: ships(hm, QUERIES, heads=spec, progress=False), args.repeats)
        t_loop = best(lambda hm=hm, heads=heads: loop_ships(hm, heads), 1)
        speedup[name] = round(t_loop / t_engine, 2)
        del hm, sm
    print(
        json.dumps(
            {
                "steered_over_unsteered": steered,
                "ships_speedup": speedup,
                "heads": n_heads,
                "prompts": len(PROMPTS),
                "new_tokens": args.new_tokens,
            }
        )
    )


if __name__ == "__main__":
    main()
