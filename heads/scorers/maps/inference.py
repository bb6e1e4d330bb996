"""MAPS validated against inference (docs/methods/maps.md): dynamic scores and causal ablation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from heads._util.progress import progress_callback
from heads._util.validation import check_int, check_seed, short_repr
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, HeadOutputEdit, HeadScale
from heads.engine.forward import forward
from heads.engine.options import SweepOptions, sweep_options, sweep_rows
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import encode_prompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores
from heads.scorers.controls import check_draws, other_heads, random_head_draws
from heads.scorers.maps.static import RelationPairs, positive_int, top_k_hits

__all__ = [
    "ACCURACY_PROMPTS",
    "DYNAMIC_MAX_PAIRS",
    "TEMPLATES",
    "AblationResult",
    "ablation_check",
    "ablation_steps",
    "dynamic_scores",
    "dynamic_steps",
    "max_ablated_heads",
    "pearson",
    "relation_accuracy",
]

TEMPLATES = (
    "No {x} means no",
    "The story of {x} contains",
    "This is a document about {x}",
    "When I think about {x} I think about",
)
"""Neutral templates carrying the source <X> (docs/methods/maps.md, Experiment 1)."""

DYNAMIC_MAX_PAIRS = 12
"""Pairs per relation that `dynamic_scores` fills into the templates by default (at most)."""

ACCURACY_PROMPTS = 40
"""Few-shot prompts per relation in `relation_accuracy` / `ablation_check` by default (or one
per pair of a relation with fewer pairs)."""


class _LastZ(HeadOutputEdit):
    """Records every head's output `z` at the last position (returns z unchanged)."""

    def __init__(self, layer: int):
        super().__init__(layer=layer)
        self.z: list[torch.Tensor] = []

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        self.z.append(z[:, -1].detach().float())
        return z


def _texts(relation: RelationPairs) -> list[tuple[str, str]]:
    if relation.texts is None:
        raise HeadsteerValueError(
            f"relation {short_repr(relation.name)} has no texts; load it with probes.load_relations"
        )
    return relation.texts


def dynamic_steps(
    n_layers: int, n_rows: int, *, n_templates: int = len(TEMPLATES), batch_size: int = 48
) -> int:
    """Progress steps of `dynamic_scores`: one per forward (template x batch), one per layer scored."""
    return n_templates * -(-n_rows // batch_size) + n_layers


@torch.no_grad()
def dynamic_scores(
    model: HeadModel,
    relations: RelationPairs | Sequence[RelationPairs],
    *,
    templates: Sequence[str] = TEMPLATES,
    max_pairs: int = DYNAMIC_MAX_PAIRS,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> dict[str, torch.Tensor]:
    """Dynamic relation score per (template, layer, head), `[n_templates, n_layers, n_heads]` each.

    For each pair, the template is filled with the source word; the head's real output at
    the last position, `z_h W_O^h` (no bias), is projected with U (no final norm) and scores
    1 when the target is in its top-k (ties: lowest id). Averaged over the first
    `max_pairs` pairs of each relation (the "with context" variant of docs/methods/maps.md).
    `max_pairs` is at most (default `DYNAMIC_MAX_PAIRS` = 12): a relation with fewer pairs uses
    every pair, `min(max_pairs, len(relation.pairs))` of them.

    `options`: `heads.SweepOptions`: `max_rows` prompts per forward (48 where it is left at its
    default; fewer where `max_memory` needs it, planned as `"logits"`: every position's logits
    come back; refused before any forward when one prompt does not fit); `progress`: True
    (default: a tqdm bar), False / None (off) or
    `progress(done, total)` (`heads._util.progress`) in steps: one per forward (template x batch
    of `max_rows` prompts), then one per layer scored (`dynamic_steps`). The loose `progress=` and
    `batch_size=` (now `max_rows`) keywords still work one release (a `DeprecationWarning`;
    refused together with the same options field set).

    Returns:
        relation name -> tensor in [0, 1].
    """
    takes = ("max_rows", "progress", "max_memory")
    opts = sweep_rows(options, deprecated, "dynamic_scores", default=48, takes=takes)
    progress, batch_size = opts.progress, opts.max_rows
    rels = [relations] if isinstance(relations, RelationPairs) else list(relations)
    if not rels or not all(isinstance(r, RelationPairs) for r in rels):
        raise HeadsteerValueError("dynamic_scores needs one or more RelationPairs")
    max_pairs = positive_int(max_pairs, "max_pairs")
    templates = list(templates)
    if not templates or any(not isinstance(t, str) or "{x}" not in t for t in templates):
        raise HeadsteerValueError(f"templates must be strings containing {{x}}, got {short_repr(templates)}")
    rows = [(r, i, src) for r in rels for i, (src, _) in enumerate(_texts(r)[:max_pairs])]
    if opts.max_memory is not None:  # every position's logits come back: the "logits" plan bounds it
        texts = [t.format(x=src) for t in templates for _, _, src in rows]
        longest = encode_prompts(model.tokenizer, texts, chat=False, markup=False).length
        batch_size = opts.within(model, longest, "logits").max_rows
    U = model.W_U.float()
    tgts = torch.tensor([r.pairs[i][1] for r, i, _ in rows], device=U.device)
    ks = torch.tensor([r.k for r, _, _ in rows], device=U.device)
    total = dynamic_steps(model.n_layers, len(rows), n_templates=len(templates), batch_size=batch_size)
    done = 0
    zs = []  # per template: [n_layers, n_rows, n_heads, d_head]
    hits = torch.zeros(len(templates), model.n_layers, model.n_heads, len(rows))
    with progress_callback(progress, "MAPS dynamic scores", "steps") as report:
        for tpl in templates:
            prompts = [tpl.format(x=src) for _, _, src in rows]
            per_layer: list[list[torch.Tensor]] = [[] for _ in range(model.n_layers)]
            for a in range(0, len(prompts), batch_size):
                enc = encode_prompts(model.tokenizer, prompts[a : a + batch_size], chat=False, markup=False)
                recs = [_LastZ(layer) for layer in range(model.n_layers)]
                with editing(model, recs):
                    forward(model, enc)
                for layer, rec in enumerate(recs):
                    per_layer[layer].append(rec.z[0])
                done += 1
                if report:
                    report(done, total)
            zs.append(torch.stack([torch.cat(z) for z in per_layer]))
        for layer in range(model.n_layers):
            ou = (model.layer_weights(layer)["W_O"].float().reshape(-1, model.d_model) @ U).view(
                model.n_heads, model.d_head, -1
            )
            for ti in range(len(templates)):
                for head in range(model.n_heads):
                    hit, _ = top_k_hits(zs[ti][layer][:, head] @ ou[head], tgts, ks)
                    hits[ti, layer, head] = hit.float().cpu()
            done += 1
            if report:
                report(done, total)
    out, start = {}, 0
    for r in rels:
        n = min(max_pairs, len(r.pairs))
        out[r.name] = hits[..., start : start + n].mean(-1)
        start += n
    return out


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson r of two equally sized arrays (NaN when either is constant)."""
    x = np.asarray(a, dtype=np.float64).ravel()
    y = np.asarray(b, dtype=np.float64).ravel()
    if x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def max_ablated_heads(n_heads_total: int) -> int:
    """Cap on heads ablated in the causal check: 30 below 300 heads, 50/100/150/250 above (§5)."""
    for limit, n in ((300, 30), (500, 50), (1000, 100), (1500, 150)):
        if n_heads_total < limit:
            return n
    return 250


def _prompt_counts(relation: RelationPairs, n_prompts: int | None, n_shots: int) -> tuple[int, int]:
    """`(n_prompts, n_shots)` checked against the relation's pairs (one prompt per pair, each
    with `n_shots` other pairs as its shots): a count beyond them is refused, naming it; None
    prompts: `ACCURACY_PROMPTS`, or every pair of a smaller relation."""
    n = len(_texts(relation))
    name = short_repr(relation.name)
    if n_prompts is None:
        n_prompts = min(ACCURACY_PROMPTS, n)
    else:  # a larger count was cut to the relation's pairs silently
        n_prompts = check_int(
            "n_prompts", n_prompts, lo=1, hi=n, what=f"an int in 1..{n} (relation {name}'s pairs) or None"
        )
    n_shots = check_int(  # shots beyond the other pairs were cut silently
        "n_shots", n_shots, lo=0, hi=n - 1, what=f"an int in 0..{n - 1} (relation {name}'s other pairs)"
    )
    return n_prompts, n_shots


def _few_shot_prompts(
    relation: RelationPairs, n_prompts: int, n_shots: int, seed: int
) -> list[tuple[str, int]]:
    texts = _texts(relation)
    g = torch.Generator().manual_seed(check_seed("seed", seed))
    out = []
    for i in range(n_prompts):
        others = [j for j in range(len(texts)) if j != i]
        shots = [others[j] for j in torch.randperm(len(others), generator=g)[:n_shots].tolist()]
        lines = [f"{texts[j][0]} -> {texts[j][1]}" for j in shots]
        out.append(("\n".join([*lines, f"{texts[i][0]} ->"]), relation.pairs[i][1]))
    return out


@torch.no_grad()
def relation_accuracy(
    model: HeadModel,
    relation: RelationPairs,
    heads: Sequence[tuple[int, int]] = (),
    *,
    n_prompts: int | None = None,
    n_shots: int = 3,
    seed: int = 0,
    batch_size: int = 40,
) -> float:
    """Few-shot accuracy on the relation (`src -> tgt` lines; argmax next token == target).

    `heads` are zero-ablated at the last position only (docs/methods/maps.md, Experiment 2).
    Prompt i asks for pair i's target after `n_shots` other pairs (drawn with `seed`), for the
    first `n_prompts` pairs (default None: `ACCURACY_PROMPTS` = 40, or every pair of a relation
    with fewer).

    Raises:
        ValueError: `n_prompts` beyond the relation's pairs or below 1, `n_shots` beyond its
            other pairs (`len(pairs) - 1`) or negative, `batch_size` below 1 (the value named,
            before any forward); a relation without texts.
    """
    batch_size = positive_int(batch_size, "batch_size")
    n_prompts, n_shots = _prompt_counts(relation, n_prompts, n_shots)
    prompts = _few_shot_prompts(relation, n_prompts, n_shots, seed)
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)
    correct = 0
    for a in range(0, len(prompts), batch_size):
        chunk = prompts[a : a + batch_size]
        enc = encode_prompts(model.tokenizer, [p for p, _ in chunk], chat=False, markup=False)
        edits = [HeadScale(layer=la, heads=hs, factor=0.0, positions=[-1]) for la, hs in by_layer.items()]
        with editing(model, edits):
            pred = forward(model, enc)[:, -1].argmax(-1)
        correct += int((pred.cpu() == torch.tensor([t for _, t in chunk])).sum())
    return correct / len(prompts)


@dataclass
class AblationResult:
    """Causal check of one relation: accuracy with its top heads vs random heads ablated."""

    relation: str
    n_heads: int
    base: float
    ablated: float
    random: list[float] = field(default_factory=list)
    skipped: str | None = None
    heads: list[tuple[int, int]] = field(default_factory=list)
    n_prompts: int = 0
    """Few-shot prompts each accuracy pass ran (one per pair: `n_prompts` or the default)."""

    @property
    def random_mean(self) -> float:
        return float(np.mean(self.random)) if self.random else float("nan")


def ablation_steps(draws: int) -> int:
    """Progress steps of `ablation_check`: the base pass, the top-heads pass and one per draw."""
    return 2 + draws


def ablation_check(
    model: HeadModel,
    relation: RelationPairs,
    scores: HeadScores,
    *,
    n_heads: int | None = None,
    draws: int = 5,
    seed: int = 0,
    n_prompts: int | None = None,
    min_base: float = 0.1,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> AblationResult:
    """Zero the relation's top-n heads (score > 0) vs n random other heads, several draws.

    n is at most `n_heads` (1..half of all heads, so that as many other heads remain for the
    random draws; default None: by model size, docs/methods/maps.md: 30 below 300 heads, at
    most half of all heads), and only heads scored above 0 are taken.
    Relations whose base accuracy is below `min_base` are skipped. Each accuracy pass runs
    `relation_accuracy` on the first `n_prompts` pairs (default None: 40, or every pair of a
    smaller relation; `AblationResult.n_prompts` says how many).

    `options`: `heads.SweepOptions`; only `progress` applies: True (default: a tqdm bar), False /
    None (off) or `progress(done, total)` (`heads._util.progress`) in accuracy passes over the
    `n_prompts` few-shot prompts: `total = ablation_steps(draws)`; a skipped relation jumps to
    the end. The loose `progress=` keyword still works one release (a `DeprecationWarning`).

    Raises:
        ValueError: scores of another shape than the model's heads, `n_heads` not an int in
            1..half the heads (HeadsteerValueError, the value named), `draws` not in 1..10,000,
            `n_prompts` beyond the relation's pairs, a relation of fewer than 4 pairs (3 shots
            each; all before any forward).
    """
    progress = sweep_options(options, deprecated, "ablation_check", takes=("progress",)).progress
    if (scores.n_layers, scores.n_heads) != (model.n_layers, model.n_heads):
        raise HeadsteerValueError(
            f"scores are [{scores.n_layers}, {scores.n_heads}], "
            f"the model has [{model.n_layers}, {model.n_heads}]"
        )
    draws = check_draws(draws)
    # keep as many other heads as ablated ones, so the random baseline has the same size
    half = model.n_layers * model.n_heads // 2
    if n_heads is None:
        cap = min(max_ablated_heads(model.n_layers * model.n_heads), half)
    else:  # a larger count was cut to half the heads silently
        cap = check_int("n_heads", n_heads, lo=1, hi=half, what=f"an int in 1..{half} (half the heads)")
    n_prompts = _prompt_counts(relation, n_prompts, 3)[0]
    positive = [h for h in scores.ranked() if scores.scores[h].item() > 0]  # by descending score
    ranked = positive[:cap]
    total = ablation_steps(draws)
    with progress_callback(progress, f"ablation check ({relation.name})", "passes") as report:
        say = report or (lambda done, total: None)
        base = relation_accuracy(model, relation, n_prompts=n_prompts, seed=seed)
        say(1, total)
        res = AblationResult(
            relation.name, len(ranked), base, float("nan"), heads=ranked, n_prompts=n_prompts
        )
        if base < min_base:
            res.skipped = f"base accuracy {base:.2f} < {min_base}"
        elif not ranked:
            res.skipped = "no head scores above 0"
        if res.skipped:
            say(total, total)
            return res
        res.ablated = relation_accuracy(model, relation, ranked, n_prompts=n_prompts, seed=seed)
        say(2, total)
        pool = other_heads(model.n_layers, model.n_heads, ranked)
        for i, pick in enumerate(random_head_draws(pool, len(ranked), draws, seed)):
            res.random.append(relation_accuracy(model, relation, pick, n_prompts=n_prompts, seed=seed))
            say(3 + i, total)
    return res
