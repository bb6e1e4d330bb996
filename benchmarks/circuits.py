"""Circuit discovery on IOI pairs of the embedded model: EAP-IG vs exact edge patching.

1. EAP-IG (m = `--steps`, default 5) and EAP over every edge of SmolLM2-135M's graph
   (input, 270 heads with q / k / v inputs per KV head, 30 MLPs, logits: 70,651 edges) on the
   first `--pairs` IOI test pairs (ABC corruption), timed.
2. Exact edge patching of a pool of edges: the union of the top `--k` edges of EAP-IG and of
   EAP (each edge x pair one forward row), timed; seconds per edge x all edges = the
   extrapolated cost of exact patching over the whole graph; `speedup_vs_exact` = that / the
   EAP-IG time (same pairs).
3. `spearman_top200`: Spearman of EAP-IG vs exact scores on EAP-IG's top `--k` edges;
   `top20_recall`: the share of the exact top 20 (within the pool) that are in EAP-IG's top 100.
4. Faithfulness curves (MIB sizes 0.1 ... 100 % of edges, exact, every non-circuit edge
   corrupted) of EAP-IG, EAP and random circuits: CPR (area under f) and CMD (area under |1-f|).

`--study`: instead, the hand-off check: find the IOI circuit with EAP-IG on `--pairs` train
pairs (top `--size` % of the edges), then ablate its heads (`steer.Ablate(circuit.heads)`,
uniform attention) and, `--draws` times, the same number of random heads, and measure IOI
accuracy (logit of the indirect object > logit of the subject at the last position) on
`--test` test pairs: accuracies with 95 % bootstrap intervals over pairs (random: mean over draws
and the interval of the pooled draws).

Prints one JSON line (also written to `--out` after each stage, so a partial run keeps what it
measured): speedup_vs_exact, spearman_top200, top20_recall, cpr_eap_ig, cpr_eap, cpr_random,
cmd_eap_ig, cmd_eap, cmd_random, plus the settings and timings.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from heads import load_model
from heads.scorers.circuits import edge_scores, exact_scores, faithfulness_curve, graph_of
from heads.scorers.patching import encode_pairs
from probes.datasets.pairs import load_task_pairs


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = torch.argsort(torch.argsort(a)).double()
    rb = torch.argsort(torch.argsort(b)).double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def _accuracy(model: Any, pairs: Any, heads: Any) -> torch.Tensor:
    """`[N]` 1.0 where the clean prompt's answer logit beats the counterfactual's, with `heads` ablated."""
    from heads import editing
    from heads.inputs.prompts import position_ids
    from steer import Ablate

    edits = Ablate(heads).edits(model, None) if heads else []  # type: ignore[arg-type]
    ids, mask = pairs.clean_ids, pairs.attention_mask
    with torch.no_grad(), editing(model, edits):
        out = model.run(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids(mask),
            use_cache=False,
            logits_to_keep=1,
        )
    logits = out.logits[:, -1].float()
    idx = torch.arange(pairs.n)
    won = logits[idx, pairs.answers[:, 0]] > logits[idx, pairs.counterfactuals[:, 0]]
    return cast(torch.Tensor, won.float())


def _boot(x: torch.Tensor, n: int = 2000, seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    means = x[torch.randint(0, len(x), (n, len(x)), generator=g)].mean(-1)
    return [round(float(means.quantile(0.025)), 3), round(float(means.quantile(0.975)), 3)]


def study(args: argparse.Namespace) -> dict:
    from heads import HeadSet
    from heads.scorers.circuits import select

    model = load_model()
    graph = graph_of(model)
    train = encode_pairs(model, load_task_pairs("ioi", split="train", n=args.pairs))
    test = encode_pairs(model, load_task_pairs("ioi", split="test", n=args.test))
    sc = edge_scores(model, train, method="eap-ig", steps=args.steps, progress=False)
    circuit = select(sc, n=max(1, round(args.size / 100 * graph.n_edges)))
    heads = circuit.heads
    k = len(heads.heads)
    base = _accuracy(model, test, None)
    abl = _accuracy(model, test, heads)
    g = torch.Generator().manual_seed(0)
    draws = []
    for _ in range(args.draws):
        pick = torch.randperm(graph.n_layers * graph.n_heads, generator=g)[:k].tolist()
        draws.append(_accuracy(model, test, HeadSet((i // graph.n_heads, i % graph.n_heads) for i in pick)))
    pooled = torch.cat(draws)
    return {
        "benchmark": "circuits_ablation_study",
        "model": model.name,
        "train_pairs": train.n,
        "test_pairs": test.n,
        "circuit_edges": circuit.n_edges,
        "circuit_heads": k,
        "acc_clean": round(float(base.mean()), 3),
        "acc_clean_ci": _boot(base),
        "acc_circuit_ablated": round(float(abl.mean()), 3),
        "acc_circuit_ablated_ci": _boot(abl),
        "acc_random_ablated": round(float(pooled.mean()), 3),
        "acc_random_ablated_ci": _boot(pooled),
        "acc_random_draws": [round(float(d.mean()), 3) for d in draws],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--k", type=int, default=200, help="top-k edges of each method scored exactly")
    ap.add_argument("--batch-rows", type=int, default=64)
    ap.add_argument("--out", default="")
    ap.add_argument("--study", action="store_true", help="the circuit-ablation study instead")
    ap.add_argument("--size", type=float, default=1.0, help="study: circuit size, % of edges")
    ap.add_argument("--test", type=int, default=64, help="study: IOI test pairs")
    ap.add_argument("--draws", type=int, default=5, help="study: random-head draws")
    args = ap.parse_args()
    if args.study:
        line = json.dumps(study(args))
        if args.out:
            with open(args.out, "w") as f:
                f.write(line + "\n")
        print(line)
        return
    torch.manual_seed(0)
    model = load_model()
    pairs = encode_pairs(model, load_task_pairs("ioi", split="test", n=args.pairs))
    graph = graph_of(model)
    res: dict = {
        "benchmark": "circuits",
        "model": model.name,
        "pairs": pairs.n,
        "edges": graph.n_edges,
        "steps": args.steps,
        "k": args.k,
        "threads": torch.get_num_threads(),
    }

    def dump() -> None:
        line = json.dumps(res)
        if args.out:
            with open(args.out, "w") as f:
                f.write(line + "\n")

    t = time.perf_counter()
    ig = edge_scores(model, pairs, method="eap-ig", steps=args.steps, progress=False)
    res["eap_ig_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    eap = edge_scores(model, pairs, method="eap", progress=False)
    res["eap_s"] = round(time.perf_counter() - t, 2)
    dump()

    top_ig, top_eap = ig.ranking()[: args.k], eap.ranking()[: args.k]
    pool = torch.unique(torch.cat([top_ig, top_eap]), dim=0)
    t = time.perf_counter()
    ex = exact_scores(model, pairs, edges=pool, batch_rows=args.batch_rows, progress=False)
    t_ex = time.perf_counter() - t
    res["exact_pool_edges"] = len(pool)
    res["exact_pool_s"] = round(t_ex, 2)
    res["exact_all_edges_s_extrapolated"] = round(t_ex / len(pool) * graph.n_edges, 1)
    res["speedup_vs_exact"] = round(t_ex / len(pool) * graph.n_edges / res["eap_ig_s"], 1)
    ex_ig = ex.scores[top_ig[:, 0], top_ig[:, 1]]
    res["spearman_top200"] = round(_spearman(ig.scores[top_ig[:, 0], top_ig[:, 1]], ex_ig), 3)
    ex_pool = ex.scores[pool[:, 0], pool[:, 1]]
    exact_top20 = {tuple(e) for e in pool[torch.argsort(ex_pool.abs(), descending=True)[:20]].tolist()}
    ig100 = {tuple(e) for e in ig.ranking()[:100].tolist()}
    res["top20_recall"] = round(len(exact_top20 & ig100) / len(exact_top20), 3)
    dump()

    t = time.perf_counter()
    for name, sc in (("eap_ig", ig), ("eap", eap)):
        cur = faithfulness_curve(
            model, pairs, sc, random=name == "eap", batch_rows=args.batch_rows, progress=False
        )
        res[f"cpr_{name}"], res[f"cmd_{name}"] = round(cur["cpr"], 3), round(cur["cmd"], 3)
        res[f"faithfulness_{name}"] = [round(v, 3) for v in cur["faithfulness"]]
        if "random" in cur:
            res["cpr_random"], res["cmd_random"] = round(cur["cpr_random"], 3), round(cur["cmd_random"], 3)
            res["faithfulness_random"] = [round(v, 3) for v in cur["random"]]
        dump()
    res["curves_s"] = round(time.perf_counter() - t, 2)
    dump()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
