"""`headsteer report maps`: MAPS static maps, their validation against inference, as HTML."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

from heads import HeadModel
from heads.maps import IMPLEMENTS_THRESHOLD, maps_scores, salient_operations
from heads.maps_inference import ablation_check, dynamic_scores, pearson
from probes.relations import load_relations

from .figures import head_heatmap
from .report import Report

__all__ = ["maps_report"]


def maps_report(
    model: HeadModel,
    out: str | Path,
    *,
    relations: str | list[str] | None = "all",
    top: int = 20,
    draws: int = 5,
    n_prompts: int = 30,
    overwrite: bool = False,
    progress=None,
) -> tuple[Path, dict]:
    """Write the MAPS report to `out` (HTML) and return it with a JSON-able summary.

    Sections: pair-filter counts (and dropped relations), a relation-score heatmap per
    relation, the top heads with `describe()`, the static-vs-dynamic Pearson r per
    relation, and the causal ablation (top heads vs `draws` random draws). `out` is
    written atomically; an existing file is refused unless `overwrite`.
    """
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    rs = load_relations(model.tokenizer, relations, d_vocab=model.d_vocab)
    say(f"static maps: {len(rs.relations)} relations x {model.n_layers * model.n_heads} heads")
    ms = maps_scores(model, rs.relations)
    say("dynamic scores on neutral templates")
    dyn = dynamic_scores(model, rs.relations)
    corr = {n: pearson(ms.relation[n].scores.expand_as(dyn[n]), dyn[n]) for n in ms.names()}
    abl = {}
    for r in rs.relations:
        say(f"ablation check: {r.name}")
        abl[r.name] = ablation_check(model, r, ms.relation[r.name], draws=draws, n_prompts=n_prompts)

    filt = pd.DataFrame(
        [
            {
                "relation": n,
                "kind": rs.kinds[n],
                "pairs": a,
                "single-token pairs": b,
                "used": n not in rs.dropped,
            }
            for n, (a, b) in rs.survived.items()
        ]
    )
    rows = []
    for n in ms.names():
        for layer, head in [h for h in ms.relation[n].ranked(top) if ms.relation[n].scores[h] > 0]:
            rows.append(
                {
                    "relation": n,
                    "layer": layer,
                    "head": head,
                    "kv_head": model.kv_head(head),
                    "relation_score": ms.relation[n].scores[layer, head].item(),
                    "describe": ms.describe(layer, head),
                }
            )
    top_table = pd.DataFrame(rows)
    val = pd.DataFrame(
        [
            {
                "relation": n,
                "pearson_r_static_vs_dynamic": corr[n],
                "ablated_heads": abl[n].n_heads,
                "base_acc": abl[n].base,
                "acc_top_heads_ablated": abl[n].ablated,
                "acc_random_heads_mean": abl[n].random_mean,
                "acc_random_min": min(abl[n].random) if abl[n].random else float("nan"),
                "acc_random_max": max(abl[n].random) if abl[n].random else float("nan"),
                "skipped": abl[n].skipped or "",
            }
            for n in ms.names()
        ]
    )
    best = max((ms.relation[n].scores.max().item(), n) for n in ms.names())[1]
    lh = ms.relation[best].ranked(1)[0]
    salient = salient_operations(model, *lh)
    salient["targets"] = salient["targets"].map(lambda ts: " | ".join(ts))

    rep = Report(
        "MAPS: attention-head functionality from parameters",
        model.name,
        {**ms.params, "top": top, "draws": draws, "n_prompts": n_prompts, "threshold": IMPLEMENTS_THRESHOLD},
    )
    rep.text(
        "Method",
        "Each head's OV circuit projected to the vocabulary (Elhelo & Geva, ACL 2025). Relation score = "
        "share of a relation's pairs whose target is in the top-k of the source's row (k = 1 for copying, "
        "10 otherwise). Validation: Pearson r between static and dynamic scores over (template, layer, head) "
        "points, and accuracy on few-shot prompts with the relation's top heads (score > 0, at most 30) "
        "zeroed at the last position versus the same number of random other heads.",
    )
    rep.table("Relations and the single-token pair filter", filt)
    for msg in rs.dropped.values():
        rep.text("Dropped relation", msg)
    rep.table("Validation: static-dynamic correlation and causal ablation", val)
    for n in ms.names():
        rep.figure(
            f"{n} — relation score per head",
            head_heatmap(ms.relation[n], top_k=min(top, 10), title=f"MAPS relation score: {n}"),
        )
    rep.table(f"Top {top} heads per relation", top_table, max_rows=top * len(ms.names()))
    rep.table(f"Salient operations of L{lh[0]}.H{lh[1]} (top head of {best})", salient)
    rep.seconds = time.perf_counter() - t0
    path = rep.save(out, overwrite=overwrite)
    summary = {
        "relations": ms.names(),
        "dropped": list(rs.dropped),
        "pearson_r": corr,
        "ablation": {
            n: {
                "n_heads": a.n_heads,
                "base": a.base,
                "ablated": a.ablated,
                "random_mean": a.random_mean,
                "skipped": a.skipped,
            }
            for n, a in abl.items()
        },
    }
    return path, summary
