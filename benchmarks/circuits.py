"""Circuit discovery on IOI pairs of the embedded model: EAP-IG vs exact edge patching.

1. EAP-IG (m = `--steps`, default 5) and EAP over every edge of SmolLM2-135M's graph
   (input, 270 heads with q / k / v inputs per KV head, 30 MLPs, logits: 70,651 edges) on the
   first `--pairs` IOI test pairs (ABC corruption), timed.
2. Exact edge patching, timed on a uniform random `--sample` of *all* edges first (so a partial
   run already has the speed-up; uniform because a forward skips the layers below its first
   patched input, so an edge's cost depends on its target's layer). Exact patching of the
   whole graph is not run: its cost is extrapolated as seconds per sampled edge x all edges
   (`exact_edges_timed` says how many were timed, default 128), and `speedup_vs_exact` = that /
   the EAP-IG time (same pairs, same run); `speedup_vs_exact_extrapolation_factor` (all edges /
   timed edges) says how far the headline is extrapolated. After the curves, a *candidate set*
   is scored exactly: the union of the top `--k` edges of EAP-IG and the top `--k` of EAP
   (each edge x pair one forward row, `--batch-rows` rows per forward, edges grouped by
   downstream input), timed apart (`exact_candidates_s_per_edge`).
3. `spearman_top200`: Spearman of EAP-IG vs exact scores on EAP-IG's top `--k` edges;
   `top20_recall`: the share of the exact top 20 *of the candidate set* (by |score|) that are
   in EAP-IG's top 100 (an edge outside both top-k lists is never scored exactly).
4. Faithfulness curves (MIB sizes 0.1 ... 100 % of edges, exact, every non-circuit edge
   corrupted) of EAP-IG, EAP and `--random-draws` random circuits of the same sizes: CPR (area
   under f over the edge fraction) and CMD (area under |1 - f|), random ones averaged over draws.

`--study`: instead, the hand-off check: find the IOI circuit with EAP-IG on `--pairs` train
pairs (top `--size` % of the edges), then ablate its heads (`steer.Ablate(circuit.heads)`,
uniform attention) and, `--draws` times, the same number of random heads, and measure IOI
accuracy (logit of the indirect object > logit of the subject at the last position) on
`--test` test pairs: 95 % bootstrap intervals over pairs; for random heads, the pooled
draws' interval over pairs and a two-level bootstrap (draws resampled, then pairs), and the
interval of the circuit-minus-random gap (pairs and draws resampled).

Prints one JSON line (also written to `--out` after each stage, so a partial run keeps what it
measured): speedup_vs_exact, exact_edges_timed, spearman_top200, top20_recall, cpr_eap_ig,
cpr_eap, cpr_random, cmd_eap_ig, cmd_eap, cmd_random, plus the settings, timings and the load
average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from heads import load_model
from heads.engine.options import SweepOptions
from heads.scorers.circuits import edge_scores, exact_scores, faithfulness_curve, graph_of
from heads.scorers.patching import encode_pairs
from probes.datasets.pairs import load_task_pairs


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = torch.argsort(torch.argsort(a)).double()
    rb = torch.argsort(torch.argsort(b)).double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def _accuracy(model: Any, pairs: Any, heads: Any) -> torch.Tensor:
    """`[N]` 1.0 where the clean prompt's answer logit beats the counterfactual's, with `heads`
    ablated (`heads.evaluate_pairs` with `steer.Ablate`, the product's own evaluation)."""
    from heads import evaluate_pairs
    from steer import Ablate

    return evaluate_pairs(model, pairs, steer=[Ablate(heads)] if heads else []).correct.float()


def _boot(x: torch.Tensor, n: int = 2000, seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    means = x[torch.randint(0, len(x), (n, len(x)), generator=g)].mean(-1)
    return [round(float(means.quantile(0.025)), 3), round(float(means.quantile(0.975)), 3)]


def _boot_draws(acc: torch.Tensor, n: int = 2000, seed: int = 0) -> list[float]:
    """95 % interval of the mean accuracy of `acc [draws, N]` under a two-level bootstrap:
    draws resampled with replacement, then pairs (the same pair indices for every draw)."""
    g = torch.Generator().manual_seed(seed)
    k, m = acc.shape
    di = torch.randint(0, k, (n, k), generator=g)
    pi = torch.randint(0, m, (n, m), generator=g)
    means = torch.stack([acc[di[b]][:, pi[b]].mean() for b in range(n)])
    return [round(float(means.quantile(0.025)), 3), round(float(means.quantile(0.975)), 3)]


def study(args: argparse.Namespace) -> dict:
    from heads import HeadSet
    from heads.scorers.circuits import select

    model = load_model()
    graph = graph_of(model)
    train = encode_pairs(model, load_task_pairs("ioi", split="train", n=args.pairs))
    test = encode_pairs(model, load_task_pairs("ioi", split="test", n=args.test))
    sc = edge_scores(model, train, method="eap-ig", steps=args.steps, options=SweepOptions(progress=False))
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
    res = {
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
        "acc_random_ablated_ci_draws": _boot_draws(torch.stack(draws)),
        "acc_random_draws": [round(float(d.mean()), 3) for d in draws],
        "circuit_minus_random_ci": _boot_gap(abl, torch.stack(draws)),
        "loadavg": _load(),
    }
    return res


def _boot_gap(abl: torch.Tensor, acc: torch.Tensor, n: int = 2000, seed: int = 1) -> list[float]:
    """95 % interval of acc(circuit ablated) - acc(random heads ablated), pairs resampled jointly
    (the same test pairs in both) and random draws resampled."""
    g = torch.Generator().manual_seed(seed)
    k, m = acc.shape
    di = torch.randint(0, k, (n, k), generator=g)
    pi = torch.randint(0, m, (n, m), generator=g)
    gaps = torch.stack([abl[pi[b]].mean() - acc[di[b]][:, pi[b]].mean() for b in range(n)])
    return [round(float(gaps.quantile(0.025)), 3), round(float(gaps.quantile(0.975)), 3)]


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--k", type=int, default=200, help="top-k edges of each method scored exactly")
    ap.add_argument("--batch-rows", type=int, default=128)
    ap.add_argument("--sample", type=int, default=128, help="edges timed exactly before the curves")
    ap.add_argument("--skip-curves", action="store_true", help="no faithfulness curves (short run)")
    ap.add_argument("--random-draws", type=int, default=3, help="random circuits per size")
    ap.add_argument("--out", default="")
    ap.add_argument("--study", action="store_true", help="the circuit-ablation study instead")
    ap.add_argument("--size", type=float, default=1.0, help="study: circuit size, %% of edges")
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
        "tokens": pairs.width,
        "edges": graph.n_edges,
        "steps": args.steps,
        "k": args.k,
        "threads": torch.get_num_threads(),
        "loadavg_start": _load(),
    }

    def dump() -> None:
        line = json.dumps(res)
        if args.out:
            with open(args.out, "w") as f:
                f.write(line + "\n")

    t = time.perf_counter()
    ig = edge_scores(model, pairs, method="eap-ig", steps=args.steps, options=SweepOptions(progress=False))
    res["eap_ig_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    eap = edge_scores(model, pairs, method="eap", options=SweepOptions(progress=False))
    res["eap_s"] = round(time.perf_counter() - t, 2)
    dump()

    top_ig, top_eap = ig.ranking()[: args.k], eap.ranking()[: args.k]
    pool = torch.unique(torch.cat([top_ig, top_eap]), dim=0)
    res["exact_candidates"] = f"top-{args.k} EAP-IG | top-{args.k} EAP"
    res["exact_candidate_edges"] = len(pool)
    ex_scores = torch.full((graph.n_upstream, graph.n_downstream), float("nan"))

    def exact(edges: torch.Tensor) -> float:
        # grouped by downstream input, so a forward patches few layers (and skips the layers
        # below its first patched input)
        edges = edges[torch.argsort(edges[:, 1] * graph.n_upstream + edges[:, 0])]
        t = time.perf_counter()
        ex = exact_scores(
            model, pairs, edges=edges, options=SweepOptions(max_rows=args.batch_rows, progress=False)
        )
        ex_scores[edges[:, 0], edges[:, 1]] = ex.scores[edges[:, 0], edges[:, 1]]
        return time.perf_counter() - t

    # 1. the timing sample first (the speed-up comes early in a partial run): edges drawn
    # uniformly from the whole graph, since a forward's cost depends on the layer of its
    # first patched input
    every = torch.nonzero(graph.valid)
    sample = every[torch.randperm(len(every), generator=torch.Generator().manual_seed(1))[: args.sample]]
    s_sample = exact(sample)
    ex_scores.fill_(float("nan"))  # only the candidates' exact scores are compared below
    per_edge = s_sample / len(sample)
    res["exact_sample"] = "uniform over all edges"
    res["exact_edges_timed"] = len(sample)
    res["exact_timed_s"] = round(s_sample, 2)
    res["exact_all_edges_s_extrapolated"] = round(per_edge * graph.n_edges, 1)
    res["speedup_vs_exact"] = round(per_edge * graph.n_edges / res["eap_ig_s"], 1)
    res["speedup_vs_exact_extrapolation_factor"] = round(graph.n_edges / len(sample), 1)
    res["loadavg_exact"] = _load()
    dump()

    # 2. faithfulness curves
    t = time.perf_counter()
    for name, sc in () if args.skip_curves else (("eap_ig", ig), ("eap", eap)):
        rnd = name == "eap_ig"
        cur = faithfulness_curve(
            model,
            pairs,
            sc,
            random=rnd,
            n_random=args.random_draws,
            options=SweepOptions(max_rows=args.batch_rows, progress=False),
        )
        res[f"cpr_{name}"], res[f"cmd_{name}"] = round(cur["cpr"], 3), round(cur["cmd"], 3)
        res[f"faithfulness_{name}"] = [round(v, 3) for v in cur["faithfulness"]]
        if rnd:
            res["cpr_random"], res["cmd_random"] = round(cur["cpr_random"], 3), round(cur["cmd_random"], 3)
            res["cpr_random_draws"] = [round(v, 3) for v in cur["cpr_random_draws"]]
            res["random_draws"] = args.random_draws
            res["faithfulness_random"] = [round(v, 3) for v in cur["random"]]
        dump()
    res["curves_s"] = round(time.perf_counter() - t, 2)
    dump()

    # 3. the candidates: rank agreement and recall
    s_pool = exact(pool)
    res["exact_candidates_s"] = round(s_pool, 2)
    res["exact_candidates_s_per_edge"] = round(s_pool / len(pool), 3)
    res["exact_sample_s_per_edge"] = round(per_edge, 3)
    ex_ig = ex_scores[top_ig[:, 0], top_ig[:, 1]]
    res["spearman_top200"] = round(_spearman(ig.scores[top_ig[:, 0], top_ig[:, 1]], ex_ig), 3)
    ex_eap = ex_scores[top_eap[:, 0], top_eap[:, 1]]
    res["spearman_top200_eap"] = round(_spearman(eap.scores[top_eap[:, 0], top_eap[:, 1]], ex_eap), 3)
    ex_pool = ex_scores[pool[:, 0], pool[:, 1]]
    exact_top20 = {tuple(e) for e in pool[torch.argsort(ex_pool.abs(), descending=True)[:20]].tolist()}
    ig100 = {tuple(e) for e in ig.ranking()[:100].tolist()}
    eap100 = {tuple(e) for e in eap.ranking()[:100].tolist()}
    res["top20_recall"] = round(len(exact_top20 & ig100) / len(exact_top20), 3)
    res["top20_recall_eap"] = round(len(exact_top20 & eap100) / len(exact_top20), 3)
    res["loadavg_end"] = _load()
    dump()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
