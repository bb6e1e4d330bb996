"""MAPS static map of all heads x all relations: the chunked engine vs a per-head loop.

The loop is what a practitioner writes today: for each head, materialise W_VO = W_V W_O
(d_model x d_model), project every relation's sources through it and the unembedding,
and rank targets with a full sort of each row. It is timed on `--loop-heads` heads and
extrapolated to all heads; its scores are checked against the engine's on those heads.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from heads import load_model
from heads.scorers.maps.static import maps_scores, source_representations
from probes.datasets.relations import load_relations


@torch.no_grad()
def loop_head(model, relations, layer: int, head: int) -> dict[str, float]:
    w = model.layer_weights(layer)
    w_vo = w["W_V"][model.kv_head(head)] @ w["W_O"][head]
    out = {}
    for r in relations:
        src = torch.tensor([s for s, _ in r.pairs])
        logits = source_representations(model, src, layer) @ w_vo @ model.W_U
        order = torch.sort(logits, dim=1, descending=True, stable=True).indices[:, : r.k]
        hits = [t in order[i].tolist() for i, (_, t) in enumerate(r.pairs)]
        out[r.name] = sum(hits) / len(hits)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loop-heads", type=int, default=18)
    args = ap.parse_args()
    hm = load_model()
    rs = load_relations(hm.tokenizer)
    t0 = time.perf_counter()
    ms = maps_scores(hm, rs.relations)
    engine_s = time.perf_counter() - t0
    n_heads = hm.n_layers * hm.n_heads
    step = max(1, n_heads // args.loop_heads)
    sample = [divmod(i, hm.n_heads) for i in range(0, n_heads, step)][: args.loop_heads]
    t0 = time.perf_counter()
    diffs = []
    for layer, head in sample:
        got = loop_head(hm, rs.relations, layer, head)
        diffs += [abs(got[n] - ms.relation[n].scores[layer, head].item()) for n in got]
    loop_s = (time.perf_counter() - t0) / len(sample) * n_heads
    print(
        json.dumps(
            {
                "seconds": round(engine_s, 1),
                "speedup_vs_loop": round(loop_s / engine_s, 2),
                "loop_seconds_extrapolated": round(loop_s, 1),
                "loop_heads_timed": len(sample),
                "max_abs_diff_vs_loop": max(diffs),
                "heads": n_heads,
                "relations": len(rs.relations),
                "pairs": sum(len(r.pairs) for r in rs.relations),
            }
        )
    )


if __name__ == "__main__":
    main()
