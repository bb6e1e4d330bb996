"""Per-head probes: collecting head outputs and fitting 270 probes, against one plain forward.

Embedded SmolLM2-135M-Instruct (30 layers x 9 heads = 270 heads), 200 requests (100 harmful, 100
harmless, chat template), last token. Stages:

- `forward_seconds`: plain forwards of the same batches (same length-sorted order, same batch
  size, `logits_to_keep=1`, encoding included), no edit;
- `collect_seconds`: `collect_head_outputs` on the 200 prompts (encoding, forwards with the
  recording edit on all 30 layers, copying out `[200, 30, 9, 64]`);
- `fit_seconds`: `fit_head_probes` (logistic regression, 5-fold CV + a full fit per head).

Forward and collection run interleaved `--repeats` times; the median counts, and
`collect_over_forward` is their ratio (goal <= 1.2). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from heads import encode_prompts, forward, load_model  # noqa: E402
from probes.datasets.requests import load_requests  # noqa: E402
from probes.head_probes import collect_head_outputs, fit_head_probes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1, help="joblib workers for fitting")
    args = ap.parse_args()
    hm = load_model()
    half = args.prompts // 2
    harmful = [r["prompt"] for r in load_requests("harmful")][:half]
    harmless = [r["prompt"] for r in load_requests("harmless")][: args.prompts - half]
    prompts = [[{"role": "user", "content": p}] for p in harmful + harmless]
    labels = [1] * len(harmful) + [0] * len(harmless)
    order = sorted(range(len(prompts)), key=lambda i: len(str(prompts[i])))  # as collect_head_outputs
    batches = [
        [prompts[i] for i in order[a : a + args.batch_size]] for a in range(0, len(order), args.batch_size)
    ]

    @torch.no_grad()
    def plain() -> None:
        for batch in batches:
            forward(hm, encode_prompts(hm.tokenizer, batch, chat=True, markup=False), logits_to_keep=1)

    plain()  # warm-up
    fwd, col = [], []
    acts = None
    for _ in range(args.repeats):
        t = time.perf_counter()
        plain()
        fwd.append(time.perf_counter() - t)
        t = time.perf_counter()
        acts = collect_head_outputs(
            hm, prompts, "last", batch_size=args.batch_size, chat=True, progress=False
        )
        col.append(time.perf_counter() - t)
    t = time.perf_counter()
    res = fit_head_probes(acts, labels, cv=5, seed=0, n_jobs=args.jobs)
    fit = time.perf_counter() - t
    f, c = statistics.median(fwd), statistics.median(col)
    print(
        json.dumps(
            {
                "prompts": len(prompts),
                "heads": hm.n_layers * hm.n_heads,
                "batch_size": args.batch_size,
                "repeats": args.repeats,
                "forward_seconds": round(f, 3),
                "collect_seconds": round(c, 3),
                "fit_seconds": round(fit, 3),
                "collect_over_forward": round(c / f, 3),
                "fit_jobs": args.jobs,
                "best_probe_accuracy": round(float(res.accuracy.scores.max()), 4),
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
