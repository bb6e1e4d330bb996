"""Causal Head Gating study: CHG gates against activation patching and Ships on IOI.

Embedded SmolLM2-135M-Instruct (30 x 9 heads, GQA 3:1), the shipped IOI pairs (`ioi`, test split,
the `abc` corruption). On the first `--n` pairs (the "fit" pairs):

- CHG (`heads.scorers.gating.gate_heads`): task = clean prompt -> the indirect object's token,
  `--steps` updates per stage (the reference's 500 is cut down to keep the run short), lr 1.0,
  reg_weight 0.1, batch `--batch`;
- activation patching (`heads.scorers.patching`), `head_out`, noising, logit difference
  (normalised), on the same pairs;
- Ships (UA ablation, KL of the next-token distribution) on the same clean prompts, no template.

Printed (one JSON line): Spearman's rho and Kendall's tau-b between each CHG grid (G, G+, G-) and
|patching| / Ships over all 270 heads, the top-k overlap (k = 10, 20) of G- with |patching| and
with Ships, the taxonomy counts, the task NLL unsteered / with the G- heads kept (binary
`HeadGates`) / with as many random heads kept, the IOI logit difference (answer minus the
subject's token, first generated position) through `SteeredModel.generate` with `steer.HeadGates`
against the same gates applied directly (`gate_edits`, the forward CHG trains through), on the fit
pairs and on the next `--n` held-out pairs, and every method's time (CHG's also as a ratio over
patching's, measured in this run). Run:
`OMP_NUM_THREADS=1 nice -n 10 python benchmarks/head_gating.py --steps 20 --n 16`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from heads import SweepOptions, load_model  # noqa: E402
from heads.engine.context import editing  # noqa: E402
from heads.model.adapter import HeadModel  # noqa: E402
from heads.scorers.gating import gate_edits, gate_heads, gate_task, gated_nll  # noqa: E402
from heads.scorers.patching.activation import patch  # noqa: E402
from heads.scorers.patching.pairs import PromptPair, encode_pairs  # noqa: E402
from heads.scorers.safety.ships import ships  # noqa: E402
from probes.datasets.pairs import load_task_pairs  # noqa: E402
from steer import HeadGates, SteeredModel  # noqa: E402


def _clean(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = a.flatten().double(), b.flatten().double()
    keep = ~(torch.isnan(a) | torch.isnan(b))
    return a[keep], b[keep]


def _rank(x: torch.Tensor) -> torch.Tensor:
    """Ranks 0 .. n-1 of `x` `[n]`, ties given their mean rank."""
    order = x.argsort()
    r = torch.empty_like(x)
    r[order] = torch.arange(len(x), dtype=x.dtype)
    for v in x.unique():  # ties: the mean rank
        m = x == v
        r[m] = r[m].mean()
    return r


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rho of two score grids (average ranks for ties; NaN entries dropped)."""
    a, b = _clean(a, b)
    ra, rb = _rank(a), _rank(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return round(float((ra * rb).sum() / (ra.norm() * rb.norm())), 4)


def kendall(a: torch.Tensor, b: torch.Tensor) -> float:
    """Kendall's tau-b of two score grids (ties in either counted as neither; NaN entries dropped)."""
    a, b = _clean(a, b)
    da = torch.sign(a[:, None] - a[None, :])
    db = torch.sign(b[:, None] - b[None, :])
    iu = torch.triu_indices(len(a), len(a), 1)
    da, db = da[iu[0], iu[1]], db[iu[0], iu[1]]
    denom = torch.sqrt((da != 0).sum().double() * (db != 0).sum().double())
    return round(float((da * db).sum() / denom), 4)


def top_overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> int:
    """How many of the k highest heads of `a` are among the k highest of `b` (NaN last)."""
    fa = torch.nan_to_num(a.flatten().double(), nan=-float("inf"))
    fb = torch.nan_to_num(b.flatten().double(), nan=-float("inf"))
    return len(set(fa.topk(k).indices.tolist()) & set(fb.topk(k).indices.tolist()))


def logit_diff(
    hm: HeadModel,
    prompts: list[str],
    answers: list[str],
    wrongs: list[str],
    gates: torch.Tensor | None,
    *,
    steered: bool,
) -> torch.Tensor:
    """`[N]` logit(answer) - logit(wrong) at the first generated position, the heads' outputs scaled
    by `gates` `[L, H]` (None: unscaled): through `SteeredModel.generate` + `HeadGates` when
    `steered`, else one direct forward under `gate_edits` (right-padded rows, the CHG forward)."""
    tok = hm.tokenizer
    assert tok is not None, "the embedded model has a tokenizer"
    a = torch.tensor([tok(x, add_special_tokens=False).input_ids[0] for x in answers])
    w = torch.tensor([tok(x, add_special_tokens=False).input_ids[0] for x in wrongs])
    if steered:
        steer = [] if gates is None else [HeadGates(gates)]
        out = SteeredModel(hm).generate(
            list(prompts),
            steer=steer,
            max_new_tokens=1,
            chat=False,
            markup=False,
            progress=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
        logits = cast(Any, out.outputs).logits[0].float().cpu()
    else:
        t = gate_task(hm, list(prompts), list(answers))
        last = t.attention_mask.sum(-1) - 2  # the position predicting the answer token
        with editing(hm, [] if gates is None else gate_edits(hm, gates)):
            full = hm.run(input_ids=t.input_ids, attention_mask=t.attention_mask, use_cache=False).logits
        logits = full[torch.arange(len(prompts)), last].float().cpu()
    idx = torch.arange(len(prompts))
    diff: torch.Tensor = logits[idx, a] - logits[idx, w]
    return diff


def _log(msg: str) -> None:
    print(f"[head_gating {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16, help="IOI pairs for fitting (and as many held out)")
    ap.add_argument("--steps", type=int, default=20, help="CHG updates per stage")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    args = ap.parse_args()
    torch.set_num_threads(max(1, args.threads))
    hm = load_model()
    both = load_task_pairs("ioi", n=2 * args.n)
    pairs, held = both[: args.n], both[args.n :]
    opts = SweepOptions(max_rows=64, progress=False)

    def answer(p: PromptPair) -> str:  # IOI answers are single-token strings
        assert isinstance(p.answer, str), p.answer
        return p.answer

    def wrong(p: PromptPair) -> str:  # the subject's token
        assert isinstance(p.counterfactual, str), p.counterfactual
        return p.counterfactual

    t0 = time.perf_counter()
    pr = patch(hm, encode_pairs(hm, pairs), "head_out", direction="noising", options=opts)
    t_patch = time.perf_counter() - t0
    patching = pr.head_scores().scores.abs()
    _log(f"patching {t_patch:.0f} s")

    t0 = time.perf_counter()
    sh = ships(hm, [p.clean for p in pairs], template=None, options=opts).scores.scores
    t_ships = time.perf_counter() - t0
    _log(f"ships {t_ships:.0f} s")

    task = gate_task(hm, [p.clean for p in pairs], [answer(p) for p in pairs])
    t0 = time.perf_counter()
    r = gate_heads(
        hm,
        task,
        steps=args.steps,
        batch_size=args.batch,
        seed=args.seed,
        options=SweepOptions(progress=False),
    )
    t_chg = time.perf_counter() - t0
    _log(f"chg {t_chg:.0f} s")

    with torch.no_grad():
        keep = (r.remove.scores >= 0.5).float()
        g = torch.Generator().manual_seed(args.seed)
        rand = torch.zeros(hm.n_layers * hm.n_heads)
        rand[torch.randperm(rand.numel(), generator=g)[: int(keep.sum())]] = 1
        rand = rand.view_as(keep)
        nll = {
            "unsteered": float(gated_nll(hm, task, None).mean()),
            "g_minus_kept": float(gated_nll(hm, task, keep).mean()),
            "random_kept": float(gated_nll(hm, task, rand).mean()),
        }
        ld: dict[str, dict[str, float]] = {}
        ld_gap = 0.0
        for split, ps in (("fit", pairs), ("held_out", held)):
            args3 = ([p.clean for p in ps], [answer(p) for p in ps], [wrong(p) for p in ps])
            row = {}
            for name, gates in (
                ("unsteered", None),
                ("G", r.gates.scores),
                ("G_minus", r.remove.scores),
                ("G_minus_binary", keep),
                ("random_binary", rand),
            ):
                steered = logit_diff(hm, *args3, gates, steered=True)
                direct = logit_diff(hm, *args3, gates, steered=False)
                ld_gap = max(ld_gap, float((steered - direct).abs().max()))
                row[name] = round(float(steered.mean()), 3)
            ld[split] = row
    sp = {name: s.scores for name, s in (("G", r.gates), ("G+", r.retain), ("G-", r.remove))}
    out = {
        "benchmark": "head_gating",
        "model": hm.name,
        "pairs": args.n,
        "steps_per_stage": args.steps,
        "spearman": {n: {"patching": spearman(s, patching), "ships": spearman(s, sh)} for n, s in sp.items()},
        "kendall": {n: {"patching": kendall(s, patching), "ships": kendall(s, sh)} for n, s in sp.items()},
        "spearman_patching_ships": spearman(patching, sh),
        "kendall_patching_ships": kendall(patching, sh),
        "top_k_overlap_g_minus": {
            str(k): {
                "patching": top_overlap(r.remove.scores, patching, k),
                "ships": top_overlap(r.remove.scores, sh, k),
            }
            for k in (10, 20)
        },
        "top_k_overlap_patching_ships": {str(k): top_overlap(patching, sh, k) for k in (10, 20)},
        "labels": r.counts(),
        "heads_kept_by_g_minus": int(keep.sum()),
        "nll": {k: round(v, 4) for k, v in nll.items()},
        "logit_diff": ld,
        "logit_diff_steered_vs_direct_max_abs": float(f"{ld_gap:.2g}"),
        "seconds": {"patching": round(t_patch, 1), "ships": round(t_ships, 1), "chg": round(t_chg, 1)},
        "chg_over_patching_time": round(t_chg / t_patch, 2),
        "threads": args.threads,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
