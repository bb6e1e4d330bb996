"""Attribution patching vs the exact Ships sweep on the embedded model (every head x 16 prompts).

The exact sweep (`heads.scorers.safety.ships.ships`, UA ablation, eps = 1e-5) reruns the model once per head
variant (batched, layer-prefix reuse); the estimate (`heads.scorers.safety.attribution.attribute`) takes one
forward with gradients, one backward and one delta pass per layer. Both run in this process on
the same 16 harmful train prompts (`probes.datasets.requests`), so the ratio is measured on the same load.

Figures (one JSON line):
* `speedup_vs_exact`: exact sweep seconds / estimate seconds (default estimate: saturation fix
  on, GradDrop off, KL from the top-4 tokens, the default).
* `spearman`: rank correlation of estimate and exact Ships over all heads (mean over prompts);
  `spearman_by_layers`: the same inside layer groups 0-9, 10-19, 20-29.
* `top10_recall_confirmed`: share of the exact top 10 among the estimate's top 30, i.e. what
  confirming those 30 exactly (`ships(method="attribution", confirm=30)`) recovers;
  `top30_recall`: share of the exact top 30 in the estimate's top 30.
* `confirm_seconds` and `speedup_confirmed`: the whole estimate + confirm-30 (+10 controls)
  pipeline, and `confirm_max_abs_diff` of its exact scores against the full sweep.
* Variants: `spearman_kl_tokens1` (the top token only, 3 fewer backward passes),
  `spearman_no_saturation_fix` (softmax linearised), and, on the first 4 prompts only (cost),
  `spearman_graddrop4` vs `spearman_plain4`, and the SC ablation (`spearman_sc4`).
* `worst_heads`: the 3 heads of the exact top 30 that the estimate ranks lowest.

Usage: `OMP_NUM_THREADS=1 python benchmarks/attribution.py` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from heads import load_model
from heads.scorers.safety.attribution import attribute
from heads.scorers.safety.ships import ships
from probes.datasets.requests import load_requests


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two flat tensors (scipy if present, else average-free ranks)."""
    a, b = a.flatten().double(), b.flatten().double()
    try:
        from scipy.stats import spearmanr

        return float(spearmanr(a.numpy(), b.numpy()).statistic)
    except ImportError:  # pragma: no cover
        ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
        return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--small", type=int, default=4, help="prompts for the costly variants (GradDrop, SC)")
    ap.add_argument("--confirm", type=int, default=30)
    args = ap.parse_args()

    hm = load_model(args.model)
    prompts = [r["prompt"] for r in load_requests("harmful", "train")[: args.prompts]]
    small = prompts[: args.small]
    n_l, n_h = hm.n_layers, hm.n_heads

    attribute(hm, prompts[:2])  # warm-ups (first-call allocations)
    ships(hm, prompts[:2], heads=[(0, 0), (5, 1)])

    exact, exact_s = timed(lambda: ships(hm, prompts))
    est, est_s = timed(lambda: attribute(hm, prompts))
    ex, es = exact.scores.scores, est.scores.scores

    top10, top30 = exact.scores.ranked(10), exact.scores.ranked(30)
    est30 = est.scores.ranked(30)
    conf, conf_s = timed(lambda: ships(hm, prompts, method="attribution", confirm=args.confirm, controls=10))
    chosen = [tuple(h) for h in conf.scores.params["confirmed"] + conf.scores.params["controls"]]
    conf_diff = max(
        float((conf.per_prompt[:, a, h] - exact.per_prompt[:, a, h]).abs().max()) for a, h in chosen
    )

    k1, k1_s = timed(lambda: attribute(hm, prompts, kl_tokens=1))
    naive = attribute(hm, prompts, saturation_fix=False)

    ex_small = exact.per_prompt[: len(small)].mean(0)
    plain4 = attribute(hm, small)
    gd4, gd4_s = timed(lambda: attribute(hm, small, graddrop=True))
    sc_exact = ships(hm, small, ablation="sc")
    sc_est = attribute(hm, small, ablation="sc")

    est_rank = {h: i for i, h in enumerate(est.scores.ranked())}
    worst = sorted(top30, key=lambda h: -est_rank[h])[:3]

    def recall10(exact_scores, estimate) -> float:
        return len(set(exact_scores.ranked(10)) & set(estimate.scores.ranked(30))) / 10

    groups = {f"{a}-{min(a + 9, n_l - 1)}": (a, min(a + 10, n_l)) for a in range(0, n_l, 10)}
    print(
        json.dumps(
            {
                "speedup_vs_exact": round(exact_s / est_s, 1),
                "spearman": round(spearman(ex, es), 3),
                "top10_recall_confirmed": len(set(top10) & set(est30)) / 10,
                "top30_recall": round(len(set(top30) & set(est30)) / 30, 3),
                "spearman_by_layers": {
                    k: round(spearman(ex[a:b], es[a:b]), 3) for k, (a, b) in groups.items()
                },
                "heads": n_l * n_h,
                "prompts": len(prompts),
                "exact_seconds": round(exact_s, 1),
                "estimate_seconds": round(est_s, 1),
                "confirm_seconds": round(conf_s, 1),
                "speedup_confirmed": round(exact_s / conf_s, 1),
                "confirm_max_abs_diff": conf_diff,
                "spearman_kl_tokens1": round(spearman(ex, k1.scores.scores), 3),
                "top10_recall_confirmed_kl_tokens1": recall10(exact.scores, k1),
                "speedup_kl_tokens1": round(exact_s / k1_s, 1),
                "spearman_no_saturation_fix": round(spearman(ex, naive.scores.scores), 3),
                "top10_recall_confirmed_no_saturation_fix": recall10(exact.scores, naive),
                "small_prompts": len(small),
                "spearman_plain4": round(spearman(ex_small, plain4.scores.scores), 3),
                "spearman_graddrop4": round(spearman(ex_small, gd4.scores.scores), 3),
                "graddrop4_seconds": round(gd4_s, 1),
                "spearman_sc4": round(spearman(sc_exact.scores.scores, sc_est.scores.scores), 3),
                "top10_recall_confirmed_sc4": recall10(sc_exact.scores, sc_est),
                "worst_heads": [[la, h, est_rank[(la, h)]] for la, h in worst],
                "top10_exact": [list(h) for h in top10],
            }
        )
    )


if __name__ == "__main__":
    main()
