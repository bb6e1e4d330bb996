"""MAPS analysis: static maps of every head, validated against inference, as one result object.

`maps_analysis` runs the whole MAPS study of docs/methods/maps.md on a model: the static relation
and suppression scores of every head (§2, §4), the dynamic scores on neutral templates and
their Pearson r against the static ones (§5), and the causal ablation check per relation
(§5), plus the top heads per relation with `describe()` and the salient operations of the
strongest head. It returns a `MapsAnalysis` of DataFrames and `HeadScores`; `viz.reports.maps`
only draws it (`headsteer report maps`).
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from heads._util.progress import offset_progress, progress_callback
from heads.engine.options import SweepOptions, sweep_options
from heads.model.adapter import HeadModel
from heads.scorers.controls import check_draws
from heads.scorers.maps.inference import (
    DYNAMIC_MAX_PAIRS,
    AblationResult,
    _prompt_counts,
    ablation_check,
    ablation_steps,
    dynamic_scores,
    dynamic_steps,
    pearson,
)
from heads.scorers.maps.static import (
    IMPLEMENTS_THRESHOLD,
    MapsScores,
    _as_relations,
    maps_scores,
    positive_int,
    salient_operations,
)

__all__ = ["MapsAnalysis", "maps_analysis", "maps_analysis_steps"]


@dataclass
class MapsAnalysis:
    """Everything the MAPS report shows, computed (`maps_analysis`).

    Attributes:
        model: the model's name.
        scores: static relation / suppression `HeadScores` `[L, H]` per relation.
        dynamic: relation -> dynamic scores `[n_templates, L, H]` in [0, 1].
        pearson_r: relation -> Pearson r of static vs dynamic over (template, layer, head).
        ablation: relation -> causal check (top heads vs random heads zeroed).
        pair_filter: one row per shipped relation: `relation, kind, pairs,
            single-token pairs, used` (empty when the relations came without filter counts).
        dropped: relation -> why it was dropped by the pair filter.
        top_heads: per relation, its top `top` heads with score > 0: `relation, layer, head,
            kv_head, relation_score, describe`.
        validation: one row per relation: Pearson r, the ablation accuracies and the counts
            they come from: `dynamic_pairs` (pairs in the dynamic scores, at most
            `DYNAMIC_MAX_PAIRS`), `n_prompts` (few-shot prompts of each accuracy pass, at most
            the `n_prompts` asked).
        salient_head: `(layer, head)` with the highest relation score over all relations.
        salient_relation: the relation it scores highest on.
        salient: its salient operations (`heads.scorers.maps.static.salient_operations`),
            targets joined by " | ".
        params: the static maps' parameters plus `top`, `draws`, `n_prompts` (as asked: at
            most, per relation), `dynamic_max_pairs`, `threshold`.
        seconds: wall time of the analysis.
    """

    model: str
    scores: MapsScores
    dynamic: dict[str, torch.Tensor]
    pearson_r: dict[str, float]
    ablation: dict[str, AblationResult]
    pair_filter: pd.DataFrame
    dropped: dict[str, str]
    top_heads: pd.DataFrame
    validation: pd.DataFrame
    salient_head: tuple[int, int]
    salient_relation: str
    salient: pd.DataFrame
    params: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def top(self) -> int:
        """Top heads listed per relation."""
        return int(self.params["top"])

    def summary(self) -> dict:
        """A JSON-able summary: relations, dropped ones, Pearson r and the ablation per relation."""
        return {
            "relations": self.scores.names(),
            "dropped": list(self.dropped),
            "pearson_r": dict(self.pearson_r),
            "ablation": {
                n: {
                    "n_heads": a.n_heads,
                    "base": a.base,
                    "ablated": a.ablated,
                    "random_mean": a.random_mean,
                    "skipped": a.skipped,
                }
                for n, a in self.ablation.items()
            },
        }

    def __repr__(self) -> str:
        rs = ", ".join(f"{n} (r={r:.2f})" for n, r in self.pearson_r.items())
        lh = self.salient_head
        return (
            f"MapsAnalysis({self.model}: {len(self.pearson_r)} relations [{rs}]; "
            f"strongest head L{lh[0]}.H{lh[1]} on {self.salient_relation}; {self.seconds:.1f} s)"
        )

    def _repr_html_(self) -> str:
        table: str = self.validation.to_html(index=False, float_format="%.3f")
        return f"<b>MAPS analysis</b> of {html.escape(self.model)}" + table


def _pair_filter(relations: object) -> tuple[pd.DataFrame, dict[str, str]]:
    """The pair-filter counts of a relation set that carries them
    (`probes.datasets.relations.RelationSet`)."""
    survived = getattr(relations, "survived", None) or {}
    kinds = getattr(relations, "kinds", None) or {}
    dropped = dict(getattr(relations, "dropped", None) or {})
    frame = pd.DataFrame(
        [
            {
                "relation": n,
                "kind": kinds.get(n, ""),
                "pairs": a,
                "single-token pairs": b,
                "used": n not in dropped,
            }
            for n, (a, b) in survived.items()
        ],
        columns=["relation", "kind", "pairs", "single-token pairs", "used"],
    )
    return frame, dropped


@torch.no_grad()
def maps_analysis_steps(model: HeadModel, relations: object, draws: int = 5) -> int:
    """The progress total of `maps_analysis(model, relations, draws=draws)`, before any work:
    one step per layer of the static maps, the `dynamic_scores` steps, `2 + draws` per
    relation's ablation check and one for the salient operations."""
    rels = _as_relations(model, relations)
    n_dyn = dynamic_steps(model.n_layers, sum(min(DYNAMIC_MAX_PAIRS, len(r.pairs)) for r in rels))
    return model.n_layers + n_dyn + len(rels) * ablation_steps(check_draws(draws)) + 1


def maps_analysis(
    model: HeadModel,
    relations: object,
    *,
    top: int = 20,
    draws: int = 5,
    n_prompts: int = 30,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> MapsAnalysis:
    """Run the MAPS study (Elhelo & Geva, ACL 2025; docs/methods/maps.md) on every head.

    Args:
        model: the model (with a tokenizer: the dynamic scores and the ablation run prompts).
        relations: what `maps_scores` accepts; relations need their texts (load them with
            `probes.datasets.relations.load_relations`, whose `RelationSet` also gives the pair-filter
            table and the dropped relations).
        top: heads listed per relation in `top_heads` (default 20).
        draws: random-head draws in each relation's ablation check (default 5).
        n_prompts: few-shot prompts per relation in the ablation check, at most (default 30:
            a relation with fewer pairs uses every pair; the validation table's `n_prompts`
            gives the count).
        options: `heads.SweepOptions`; only `progress` applies: True (default: a tqdm bar),
            False / None (off) or `progress(done, total)`
            (`heads._util.progress`) in steps: one per layer of the static maps, then the
            steps of `dynamic_scores` (one per forward and one per layer scored), then
            those of each relation's `ablation_check` (one per accuracy pass: `2 + draws`),
            then one for the salient operations of the strongest head; the total is known
            before any work.
        **deprecated: `progress=` as a keyword (one release; a `DeprecationWarning`; refused
            together with `options.progress` set).

    Returns:
        MapsAnalysis.

    Raises:
        ValueError: as `maps_scores`, `dynamic_scores` and `ablation_check`; `top`, `draws` or
            `n_prompts` not a positive int, a relation of fewer than 4 pairs (3 shots per
            prompt; checked before any work).
    """
    progress = sweep_options(options, deprecated, "maps_analysis", takes=("progress",)).progress
    t0 = time.perf_counter()
    top, draws, n_prompts = (
        positive_int(top, "top"),
        check_draws(draws),
        positive_int(n_prompts, "n_prompts"),
    )
    pair_filter, dropped = _pair_filter(relations)
    rels = _as_relations(model, relations)
    # n_prompts is at most per relation (relations differ in size); each count checked now
    prompts = {r.name: _prompt_counts(r, min(n_prompts, len(r.pairs)), 3)[0] for r in rels}
    dyn_pairs = {r.name: min(DYNAMIC_MAX_PAIRS, len(r.pairs)) for r in rels}
    n_dyn = dynamic_steps(model.n_layers, sum(dyn_pairs.values()))
    n_abl = ablation_steps(draws)
    total = maps_analysis_steps(model, rels, draws)
    with progress_callback(progress, "MAPS analysis", "steps") as report:
        ms = maps_scores(model, rels, options=SweepOptions(progress=offset_progress(report, 0, total)))
        dyn = dynamic_scores(
            model, rels, options=SweepOptions(progress=offset_progress(report, model.n_layers, total))
        )
        corr = {n: pearson(ms.relation[n].scores.expand_as(dyn[n]), dyn[n]) for n in ms.names()}
        abl = {}
        start = model.n_layers + n_dyn
        for i, r in enumerate(rels):
            abl[r.name] = ablation_check(
                model,
                r,
                ms.relation[r.name],
                draws=draws,
                n_prompts=prompts[r.name],
                options=SweepOptions(progress=offset_progress(report, start + i * n_abl, total)),
            )
        best = max((ms.relation[n].scores.max().item(), n) for n in ms.names())[1]
        lh = ms.relation[best].ranked(1)[0]
        salient = salient_operations(model, *lh)
        if report is not None:
            report(total, total)
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
                "dynamic_pairs": dyn_pairs[n],
                "n_prompts": abl[n].n_prompts,
            }
            for n in ms.names()
        ]
    )
    salient["targets"] = salient["targets"].map(lambda ts: " | ".join(ts))
    params = {
        **ms.params,
        "top": top,
        "draws": draws,
        "n_prompts": n_prompts,
        "dynamic_max_pairs": DYNAMIC_MAX_PAIRS,
        "threshold": IMPLEMENTS_THRESHOLD,
    }
    return MapsAnalysis(
        model=model.name,
        scores=ms,
        dynamic=dyn,
        pearson_r=corr,
        ablation=abl,
        pair_filter=pair_filter,
        dropped=dropped,
        top_heads=pd.DataFrame(rows),
        validation=val,
        salient_head=lh,
        salient_relation=best,
        salient=salient,
        params=params,
        seconds=time.perf_counter() - t0,
    )
