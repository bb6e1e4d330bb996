"""MAPS static map of all heads x all relations: the chunked engine vs a per-head loop.

The loop is what a careful practitioner writes: the source representations Ẽ of every
relation computed once (raw embeddings for layer 0, MLP_0(norm(E)) shared by every later
layer), then for each head W_VO = W_V W_O (d_model x d_model), the sources projected through it
and the unembedding, and the top-k of each row (`torch.topk`, not a full sort). Its per-head
part is timed on `--loop-heads` heads spread over the layers and extrapolated to all heads, and
its Ẽ computation is timed once and counted once (as the loop would); its scores are checked
against the engine's on those heads. Prints one JSON line (with the 1-minute load average).
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
def loop_sources(model, relations) -> dict[tuple[bool, str], torch.Tensor]:
    """Ẽ of each relation's sources, for layer 0 (key True) and for every later layer (False)."""
    out = {}
    for first in (True, False):
        for r in relations:
            src = torch.tensor([s for s, _ in r.pairs])
            out[first, r.name] = source_representations(model, src, 0 if first else 1)
    return out


@torch.no_grad()
def loop_head(model, relations, sources, layer: int, head: int) -> dict[str, float]:
    w = model.layer_weights(layer)
    w_vo = w["W_V"][model.kv_head(head)] @ w["W_O"][head]
    out = {}
    for r in relations:
        logits = sources[layer == 0, r.name] @ w_vo @ model.W_U
        top = torch.topk(logits, r.k, dim=1).indices
        targets = torch.tensor([t for _, t in r.pairs])
        out[r.name] = float((top == targets[:, None]).any(-1).float().mean())
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
    sources = loop_sources(hm, rs.relations)
    sources_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    diffs = []
    for layer, head in sample:
        got = loop_head(hm, rs.relations, sources, layer, head)
        diffs += [abs(got[n] - ms.relation[n].scores[layer, head].item()) for n in got]
    loop_s = sources_s + (time.perf_counter() - t0) / len(sample) * n_heads
    print(
        json.dumps(
            {
                "seconds": round(engine_s, 1),
                "speedup_vs_loop": round(loop_s / engine_s, 2),
                "loop_seconds_extrapolated": round(loop_s, 1),
                "loop_heads_timed": len(sample),
                "loop_sources_seconds": round(sources_s, 2),
                "loop": "sources once per layer kind, topk per row",
                "load_average_1m": round(os.getloadavg()[0], 2),
                "max_abs_diff_vs_loop": max(diffs),
                "heads": n_heads,
                "relations": len(rs.relations),
                "pairs": sum(len(r.pairs) for r in rs.relations),
            }
        )
    )


if __name__ == "__main__":
    main()
