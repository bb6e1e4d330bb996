"""Evidence a reviewer asks for: ranking stability, known-circuit recovery, prompting baselines.

1. Stability of the IOI head ranking on the embedded model (the first `--pairs` IOI test pairs,
   ABC corruption; they span `--pairs // 8` templates): activation patching of every head's
   output (denoising, logit difference), direct logit attribution at the last position, and
   the attribution-patching estimate (AtP: `attribute`, mean ablation, logit difference), each
   run with `stability=--resamples`. Per analysis: the mean top-10 Jaccard of the bootstrap
   resamples with the full ranking, drawing pairs (`"pairs"`) and drawing whole templates
   (`"templates"`, a cluster bootstrap), and the agreement of the per-template rankings
   (`"across_templates"`: mean pairwise top-10 Jaccard, `"kendall_tau_templates"`).
   `stability_time_ratio`: the analysis run with `stability=` over the same run minus the time
   of its bootstrap (timed again on the result): 1.0 = free; goal <= 1.1.
2. Known-circuit recovery: ROC-AUC of EAP, EAP-IG, exact edge patching and activation patching
   on the hand-built models of `probes.known_circuits` (induction; two-hop copy).
3. Prompting baselines: the rows of `benchmarks/results_table.py` (none / prompt / method /
   prompt + method, bootstrap intervals, the paired difference to the prompt) from the
   `headsteer eval` CSVs in `--results` (written by `benchmarks/eval_results.sh`); not rerun here.

Prints one JSON line (keys top10_jaccard_bootstrap, stability_time_ratio, recovery_auc_eap_ig,
recovery_auc_eap, recovery, prompt_baselines, the settings and the load average).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def _summary(st) -> dict:
    s = st.summary()
    return {"jaccard_mean": round(s["jaccard_mean"], 3), "n_stable": s["n_stable"], "stable": s["stable"]}


def stability_part(pairs_n: int, resamples: int) -> tuple[dict, dict, dict]:
    from heads import load_model
    from heads.engine.options import SweepOptions
    from heads.scorers.patching import direct_logit_attribution, encode_pairs
    from heads.scorers.patching.activation import patch
    from heads.scorers.safety.attribution import attribute, logit_diff
    from heads.scorers.stability import grid_stability, pair_templates
    from probes.datasets.pairs import load_task_pairs

    model = load_model()
    raw = load_task_pairs("ioi", n=pairs_n)
    pairs = encode_pairs(model, raw)
    tpl = pair_templates(pairs)
    answers = [int(x) for x in pairs.answers[:, 0]]
    foils = [int(x) for x in pairs.counterfactuals[:, 0]]

    def run_patch():
        return patch(model, pairs, "head_out", options=SweepOptions(progress=False), stability=resamples)

    def run_dla():
        return direct_logit_attribution(model, pairs, stability=resamples)

    def run_atp():
        return attribute(
            model, [p.clean for p in raw], ablation="mean", metric=logit_diff(answers, foils), template=None,
            stability=resamples,
        )  # fmt: skip

    jacc, ratio, detail = {}, {}, {}
    for name, fn in (("patching", run_patch), ("dla", run_dla), ("atp", run_atp)):
        t0 = time.perf_counter()
        res = fn()
        t_with = time.perf_counter() - t0
        per = (
            res.scores.movedim(-1, 0) if name == "patching" else res.heads[..., -1] if name == "dla" else None
        )
        t0 = time.perf_counter()
        if name == "atp":
            per = res.per_prompt
            st = grid_stability(per, resamples, templates=tpl)
        else:
            st = res.bootstrap(resamples, templates=tpl)
        t_boot = time.perf_counter() - t0
        several = tpl is not None and len(set(tpl)) > 1
        by_t = grid_stability(per, resamples, templates=tpl, by="templates") if several else None
        ratio[name] = round(t_with / max(t_with - t_boot, 1e-9), 4)
        jacc[name] = {
            "pairs": round(float(st.jaccard.mean()), 3),
            "templates": None if by_t is None else round(float(by_t.jaccard.mean()), 3),
            "across_templates": None if by_t is None else round(st.templates["jaccard"], 3),
            "kendall_tau_templates": None if by_t is None else round(st.templates["kendall_tau"], 3),
        }
        detail[name] = {"seconds": round(t_with, 2), "bootstrap_seconds": round(t_boot, 4), **_summary(st)}
        detail[name]["top10"] = st.to_frame().head(10)["item"].tolist()
    return jacc, ratio, detail


def recovery_part(n_pairs: int) -> dict:
    from probes.known_circuits import known_circuit, recovery

    return {kind: recovery(known_circuit(kind, n_pairs=n_pairs)) for kind in ("induction", "two_hop")}


def baseline_part(folder: str) -> list[dict]:
    import importlib.util

    if not Path(folder).is_dir():
        return []
    spec = importlib.util.spec_from_file_location(
        "results_table", Path(__file__).with_name("results_table.py")
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    table = mod.baselines(mod._runs(folder))
    if table.empty:
        return []
    rows = []
    for (task, metric, method), g in table.groupby(["task", "metric", "method"]):
        r = {row.condition: row for row in g.itertuples()}
        rows.append(
            {
                "task": task,
                "metric": metric,
                "method": method,
                "n": int(r["none"].n),
                **{key: [round(r[c].value, 3), round(r[c].low, 3), round(r[c].high, 3)]
                   for key, c in (("none", "none"), ("prompt", "prompt"), ("steered", "method"),
                                  ("prompt_plus_steered", "prompt + method"))},
                "method_minus_prompt": [round(r["method"].diff, 3), round(r["method"].diff_low, 3),
                                        round(r["method"].diff_high, 3)],
                "method_beats_prompt": bool(r["method"].beats_prompt),
                "prompt_plus_method_beats_prompt": bool(r["prompt + method"].beats_prompt),
            }
        )  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=32, help="IOI test pairs (8 per template)")
    ap.add_argument("--resamples", type=int, default=100, help="bootstrap resamples")
    ap.add_argument("--known-pairs", type=int, default=16, help="pairs of the hand-built models")
    ap.add_argument("--results", default="results", help="folder of headsteer eval CSVs")
    ap.add_argument("--skip-stability", action="store_true", help="only the recovery and baseline parts")
    args = ap.parse_args()
    torch.manual_seed(0)
    load = {"start": os.getloadavg()[0]}
    out: dict = {}
    if not args.skip_stability:
        jacc, ratio, detail = stability_part(args.pairs, args.resamples)
        out.update(top10_jaccard_bootstrap=jacc, stability_time_ratio=ratio, stability=detail)
    rec = recovery_part(args.known_pairs)
    out.update(
        recovery_auc_eap_ig={k: round(v["eap-ig"], 4) for k, v in rec.items()},
        recovery_auc_eap={k: round(v["eap"], 4) for k, v in rec.items()},
        recovery={k: {m: round(a, 4) for m, a in v.items()} for k, v in rec.items()},
        prompt_baselines=baseline_part(args.results),
        settings={"pairs": args.pairs, "resamples": args.resamples, "known_pairs": args.known_pairs},
    )
    load["end"] = os.getloadavg()[0]
    out["load_average"] = {k: round(v, 2) for k, v in load.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
