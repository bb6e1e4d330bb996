"""Causal Head Gating study: CHG gates against activation patching and Ships on IOI.

Embedded SmolLM2-135M-Instruct (30 x 9 heads, GQA 3:1), the shipped IOI pairs (`ioi`, test split,
the `abc` corruption). On the first `--n` pairs:

- CHG (`heads.scorers.gating.gate_heads`): task = clean prompt -> the indirect object's token,
  `--steps` updates per stage (the reference's 500 is cut down to keep the run short), lr 1.0,
  reg_weight 0.1, batch `--batch`;
- activation patching, `head_out`, noising, logit difference (normalised);
- Ships (UA ablation, KL of the next-token distribution) on the clean prompts, no template.

Printed: Spearman rank correlations between the CHG grids (G, G+, G-) and |patching| / Ships over
the 270 heads, the taxonomy counts, the task NLL unsteered / with the G- heads kept (binary
`HeadGates`) / with as many random heads kept, and every method's time, CHG's also as a ratio
over patching's (measured in this run). One JSON line. Run: `nice -n 10 python benchmarks/head_gating.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from heads import SweepOptions, load_model  # noqa: E402
from heads.scorers.gating import gate_heads, gate_task, gated_nll  # noqa: E402
from heads.scorers.patching.activation import patch  # noqa: E402
from heads.scorers.patching.pairs import encode_pairs  # noqa: E402
from heads.scorers.safety.ships import ships  # noqa: E402
from probes.datasets.pairs import load_task_pairs  # noqa: E402


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rho of two score grids (average ranks for ties; NaN entries dropped)."""
    a, b = a.flatten().double(), b.flatten().double()
    keep = ~(torch.isnan(a) | torch.isnan(b))
    a, b = a[keep], b[keep]

    def rank(x: torch.Tensor) -> torch.Tensor:
        order = x.argsort()
        r = torch.empty_like(x)
        r[order] = torch.arange(len(x), dtype=x.dtype)
        for v in x.unique():  # ties: the mean rank
            m = x == v
            r[m] = r[m].mean()
        return r

    ra, rb = rank(a), rank(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return round(float((ra * rb).sum() / (ra.norm() * rb.norm())), 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32, help="IOI pairs")
    ap.add_argument("--steps", type=int, default=40, help="CHG updates per stage")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    hm = load_model()
    pairs = load_task_pairs("ioi", n=args.n)
    opts = SweepOptions(max_rows=64, progress=False)

    t0 = time.perf_counter()
    pr = patch(hm, encode_pairs(hm, pairs), "head_out", direction="noising", options=opts)
    t_patch = time.perf_counter() - t0
    patching = pr.head_scores().scores.abs()

    t0 = time.perf_counter()
    sh = ships(hm, [p.clean for p in pairs], template=None, options=opts).scores.scores
    t_ships = time.perf_counter() - t0

    task = gate_task(
        hm,
        [p.clean for p in pairs],
        [p.answer if isinstance(p.answer, str) else str(p.answer[0]) for p in pairs],
    )
    t0 = time.perf_counter()
    r = gate_heads(hm, task, steps=args.steps, batch_size=args.batch, seed=args.seed, progress=False)
    t_chg = time.perf_counter() - t0

    with torch.no_grad():
        keep = (r.remove.scores >= 0.5).float()
        g = torch.Generator().manual_seed(args.seed)
        rand = torch.zeros(hm.n_layers * hm.n_heads)
        rand[torch.randperm(rand.numel(), generator=g)[: int(keep.sum())]] = 1
        nll = {
            "unsteered": float(gated_nll(hm, task, None).mean()),
            "g_minus_kept": float(gated_nll(hm, task, keep).mean()),
            "random_kept": float(gated_nll(hm, task, rand.view_as(keep)).mean()),
        }
    out = {
        "benchmark": "head_gating",
        "model": hm.name,
        "pairs": args.n,
        "steps_per_stage": args.steps,
        "spearman": {
            name: {"patching": spearman(s.scores, patching), "ships": spearman(s.scores, sh)}
            for name, s in (("G", r.gates), ("G+", r.retain), ("G-", r.remove))
        },
        "spearman_patching_ships": spearman(patching, sh),
        "labels": r.counts(),
        "heads_kept_by_g_minus": int(keep.sum()),
        "nll": {k: round(v, 4) for k, v in nll.items()},
        "seconds": {"patching": round(t_patch, 1), "ships": round(t_ships, 1), "chg": round(t_chg, 1)},
        "chg_over_patching_time": round(t_chg / t_patch, 2),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
