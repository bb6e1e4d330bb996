"""Generation throughput of VHR- and VAR-steered vs unsteered generation (text-context variants).

Embedded SmolLM2-135M-Instruct, a ~256-token prompt whose context passage is marked with
`**...**` (the "image" of VHR-text / VAR-text), 64 new tokens (forced), greedy, batch 1.
VHR runs its one batched probe prefill (with and without the passage: one extra row) and
reuses the with-passage row's KV cache for decoding; VAR edits every layer but the last
(pattern materialised in each). Variants run interleaved, `--repeats` times each; the median
wall time counts. Prints one JSON line with `var_over_unsteered` and `vhr_over_unsteered`
(tokens/s ratios; goal >= 0.8 each), and the same ratios from this process's CPU time
(`*_cpu`), which other jobs on a shared machine disturb less than the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from heads import load_model
from steer import SteeredModel, Var, Vhr

DOC = (
    "The Harbor Museum opened in 1911 in an old customs house near the docks. Its collection covers "
    "three centuries of shipbuilding, with models, tools and logbooks donated by local families. "
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    hm = load_model()
    sm = SteeredModel(hm)
    tok = hm.tokenizer
    text = DOC
    while len(tok(text)["input_ids"]) < args.prompt_tokens - 40:
        text += DOC
    question = "Question: When did the Harbor Museum open? Answer from the passage."
    prompt = f"Passage: **{text.strip()}**\n{question}"
    n_prompt = sm.encode(prompt).length
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
    variants = {"unsteered": [], "vhr": [Vhr()], "var": [Var()]}
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for steer in variants.values():  # warm-up
        sm.generate(prompt, steer, max_new_tokens=2)
    for _ in range(args.repeats):
        for name, steer in variants.items():
            t0, c0 = time.perf_counter(), time.process_time()
            out = sm.generate(prompt, steer, **gen)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            assert len(out.token_ids[0]) == args.new_tokens, out.token_ids
    tps = {k: args.new_tokens / statistics.median(v) for k, v in times.items()}
    cps = {k: args.new_tokens / statistics.median(v) for k, v in cpu.items()}
    print(
        json.dumps(
            {
                "benchmark": "vhr_overhead",
                "model": hm.name,
                "prompt_tokens": n_prompt,
                "new_tokens": args.new_tokens,
                "repeats": args.repeats,
                "tokens_per_s": {k: round(v, 2) for k, v in tps.items()},
                "vhr_over_unsteered": round(tps["vhr"] / tps["unsteered"], 3),
                "var_over_unsteered": round(tps["var"] / tps["unsteered"], 3),
                "vhr_over_unsteered_cpu": round(cps["vhr"] / cps["unsteered"], 3),
                "var_over_unsteered_cpu": round(cps["var"] / cps["unsteered"], 3),
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
