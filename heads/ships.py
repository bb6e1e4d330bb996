"""Safety-head attribution: Ships, dataset-level Ships and Sahara (Zhou et al., ICLR 2025).

Spec: methods/safety_heads.md. Source: *On the Role of Attention Heads in Large Language
Model Safety*, arXiv:2410.13708, §3 (Ships, Eq. 4-5), §4 (Sahara), App. D (prompt format).

All scorers evaluate many head *variants* (sets of ablated heads) in one forward pass:
K variants x N prompts are packed into batch rows in memory-bounded chunks, each row
carrying its own per-layer head mask (`row_heads`). Ablations:

* `"ua"` (default): the head's query slice times eps (`QueryScale`), so its pattern
  tends to uniform over the causal prefix; `exact=True` uses eps = 0 (exactly uniform).
* `"sc"`: the head's output (o_proj-input slice) times eps (`HeadScale`); eps = 0 is
  zero ablation. Under GQA both act on one query head, never on the shared K/V.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from .edits import Edit, HeadScale, QueryScale
from .engine import editing
from .model import HeadModel
from .prompts import EncodedPrompts, encode_prompts, normalize_prompts
from .scores import HeadScores

__all__ = [
    "TEMPLATE",
    "SaharaResult",
    "ShipsResult",
    "ablation_edits",
    "dataset_ships",
    "merge_scores",
    "principal_angles",
    "sahara",
    "ships",
]

TEMPLATE = "Query: {query}\nAnswer:"
"""The one prompt template (no chat template, no system prompt: safety_heads.md §4)."""

Ablation = Literal["ua", "sc"]
Head = tuple[int, int]


def ablation_edits(
    model: HeadModel,
    variants: Sequence[Sequence[Head]],
    n_prompts: int,
    *,
    ablation: Ablation = "ua",
    eps: float = 1e-5,
) -> list[Edit]:
    """Edits that ablate head set `variants[v]` in batch rows `v * n_prompts ... (v + 1) * n_prompts - 1`.

    Raises:
        ValueError: unknown ablation, unknown layer/head, or a non-finite eps.
    """
    if ablation not in ("ua", "sc"):
        raise ValueError(f"unknown ablation {ablation!r}: use 'ua' or 'sc'")
    rows = len(variants) * n_prompts
    masks: dict[int, torch.Tensor] = {}
    for v, heads in enumerate(variants):
        for layer, head in heads:
            model.check_head(layer, head)
            mask = masks.setdefault(layer, torch.zeros(rows, model.n_heads, dtype=torch.bool))
            mask[v * n_prompts : (v + 1) * n_prompts, head] = True
    kind = QueryScale if ablation == "ua" else HeadScale
    return [kind(layer=layer, row_heads=m, factor=eps) for layer, m in sorted(masks.items())]


def _encode(model: HeadModel, prompts, template: str | None) -> EncodedPrompts:
    items, _ = normalize_prompts(prompts)
    if not all(isinstance(p, str) for p in items):
        raise TypeError("safety-head scoring takes plain string prompts")
    texts = [template.format(query=p) if template else p for p in items]
    return encode_prompts(model.tokenizer, texts, chat=False, markup=False)


def _repeat(enc: EncodedPrompts, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return enc.input_ids.repeat(k, 1), enc.attention_mask.repeat(k, 1)


@torch.no_grad()
def _run(model: HeadModel, input_ids: torch.Tensor, mask: torch.Tensor, edits: list[Edit]):
    """Last-position log-probs `[rows, V]` (fp32) and final normed states `[rows, D]`."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    dev = model.device
    with editing(model, edits):
        out = model.model(
            input_ids=input_ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=pos.to(dev),
            use_cache=False,
            output_hidden_states=True,
            logits_to_keep=1,
        )
    return torch.log_softmax(out.logits[:, -1].float(), dim=-1).cpu(), out.hidden_states[-1][
        :, -1
    ].float().cpu()


def _variant_chunks(n_variants: int, n_prompts: int, max_rows: int) -> list[range]:
    per = max(1, max_rows // n_prompts)
    return [range(a, min(n_variants, a + per)) for a in range(0, n_variants, per)]


def _evaluate(
    model: HeadModel,
    enc: EncodedPrompts,
    variants: Sequence[Sequence[Head]],
    *,
    ablation: Ablation,
    eps: float,
    max_rows: int,
    progress: Callable[[str], None] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs `[K, N, V]` and final states `[K, N, D]` of every variant on every prompt."""
    n = enc.batch
    logps, states = [], []
    for chunk in _variant_chunks(len(variants), n, max_rows):
        group = [variants[v] for v in chunk]
        ids, mask = _repeat(enc, len(group))
        lp, st = _run(model, ids, mask, ablation_edits(model, group, n, ablation=ablation, eps=eps))
        logps.append(lp.view(len(group), n, -1))
        states.append(st.view(len(group), n, -1))
        if progress:
            progress(f"{chunk.stop}/{len(variants)} head variants")
    return torch.cat(logps), torch.cat(states)


def _shard(heads: list[Head], shard: tuple[int, int] | None) -> list[Head]:
    """Heads of shard i of n (every n-th head from i), for splitting a sweep across machines."""
    if shard is None:
        return heads
    if (
        not isinstance(shard, tuple)
        or len(shard) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in shard)
        or not 0 <= shard[0] < shard[1]
    ):
        raise ValueError(f"shard must be (i, n) with 0 <= i < n, got {shard!r}")
    return heads[shard[0] :: shard[1]]


def merge_scores(parts: Sequence[HeadScores]) -> HeadScores:
    """Merge the HeadScores of shards (NaN = not scored in that shard).

    Raises:
        ValueError: no parts, different shapes or methods, or a head scored twice.
    """
    if not parts:
        raise ValueError("no shards to merge")
    first = parts[0]
    out = torch.full_like(first.scores, math.nan)
    for p in parts:
        if p.scores.shape != first.scores.shape or p.method != first.method:
            raise ValueError("shards differ in shape or method")
        seen = ~torch.isnan(p.scores)
        if (seen & ~torch.isnan(out)).any():
            raise ValueError("a head is scored in two shards")
        out[seen] = p.scores[seen]
    return HeadScores(out, first.method, dict(first.params), first.model, first.n_kv_heads, first.seed)


def _head_table(model: HeadModel, heads: Sequence[Head], values: torch.Tensor) -> torch.Tensor:
    """`[n_layers, n_heads, *rest]` table with `values[..., k]` at `heads[k]`, NaN elsewhere.

    `values` is `[*rest, len(heads)]`.
    """
    out = torch.full((model.n_layers, model.n_heads, *values.shape[:-1]), math.nan)
    for k, (layer, head) in enumerate(heads):
        out[layer, head] = values[..., k]
    return out


def _check(model: HeadModel, eps: float, exact: bool, max_rows: int, heads) -> tuple[float, list[Head]]:
    if model.tokenizer is None:
        raise ValueError("safety-head scoring needs a HeadModel with a tokenizer")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps):
        raise ValueError(f"eps must be a finite number, got {eps!r}")
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
    if heads is None:
        heads = [(la, h) for la in range(model.n_layers) for h in range(model.n_heads)]
    heads = [tuple(x) for x in heads]
    if not heads:
        raise ValueError("no heads to score")
    for layer, head in heads:
        model.check_head(layer, head)
    return (0.0 if exact else float(eps)), heads


@dataclass
class ShipsResult:
    """Per-prompt Ships `[N, n_layers, n_heads]` (nats; NaN = head not scored) and their mean."""

    per_prompt: torch.Tensor
    scores: HeadScores

    def top(self, prompt: int, k: int = 10) -> list[Head]:
        """The `k` heads with the largest Ships on prompt `prompt` (the paper keeps 10)."""
        s = HeadScores(self.per_prompt[prompt], "ships")
        return s.ranked(k)


def ships(
    model: HeadModel,
    prompts: str | Sequence[str],
    *,
    heads: Sequence[Head] | None = None,
    ablation: Ablation = "ua",
    eps: float = 1e-5,
    exact: bool = False,
    template: str | None = TEMPLATE,
    max_rows: int = 64,
    shard: tuple[int, int] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ShipsResult:
    """Ships: KL(p_base || p_ablated) of the next-token distribution at the last prompt position.

    Args:
        model: the model; prompts are plain strings put into `template` (no chat template).
        heads: heads to score (default all `n_layers x n_heads`), each ablated alone.
        ablation: `"ua"` (query x eps, default) or `"sc"` (output x eps).
        eps: the ablation scale (default 1e-5); `exact=True` uses 0.
        max_rows: batch rows per forward (memory bound); variants x prompts are chunked.
        shard: `(i, n)` scores only every n-th head from i; merge shards with `merge_scores`.
        progress: called with a short message after each chunk of variants.

    Returns:
        ShipsResult: per-prompt KL `[N, L, H]` (natural log, fp32 from log-softmax) and
        HeadScores of the mean over prompts (method `"ships"`).

    Raises:
        ValueError: empty prompts, unknown heads, bad eps/ablation/max_rows.
    """
    eps, heads = _check(model, eps, exact, max_rows, heads)
    heads = _shard(heads, shard)
    enc = _encode(model, prompts, template)
    base_lp, _ = _run(model, enc.input_ids, enc.attention_mask, [])
    lp, _ = _evaluate(
        model, enc, [[h] for h in heads], ablation=ablation, eps=eps, max_rows=max_rows, progress=progress
    )
    # KL >= 0; batch-size-dependent float rounding can leave about -1e-9, clamped to 0
    kl = (base_lp.exp()[None] * (base_lp[None] - lp)).sum(-1).clamp(min=0.0)  # [K, N]
    per_prompt = _head_table(model, heads, kl.T).permute(2, 0, 1)  # [N, L, H]
    params = {"ablation": ablation, "eps": eps, "template": template, "n_prompts": enc.batch}
    mean = HeadScores(per_prompt.mean(0), "ships", params, model.name, model.n_kv_heads)
    return ShipsResult(per_prompt, mean)


def principal_angles(a: torch.Tensor, b: torch.Tensor, r_main: int = 1) -> torch.Tensor:
    """Sum of the first `r_main` principal angles (radians) between the spans of the top-`r_main`
    left singular vectors of `a` and `b` (`[N, D]` each, not centred). Sign-invariant.
    """
    ua = torch.linalg.svd(a.double(), full_matrices=False).U[:, :r_main]
    ub = torch.linalg.svd(b.double(), full_matrices=False).U[:, :r_main]
    cos = torch.linalg.svdvals(ua.T @ ub).clamp(-1.0, 1.0)
    return torch.arccos(cos).sum()


def _angles(base: torch.Tensor, states: torch.Tensor, r_main: int) -> torch.Tensor:
    return torch.stack([principal_angles(base, s, r_main) for s in states]).float()


def dataset_ships(
    model: HeadModel,
    prompts: Sequence[str],
    *,
    heads: Sequence[Head] | None = None,
    ablation: Ablation = "ua",
    eps: float = 1e-5,
    exact: bool = False,
    r_main: int = 1,
    degrees: bool = False,
    template: str | None = TEMPLATE,
    max_rows: int = 64,
    shard: tuple[int, int] | None = None,
    progress: Callable[[str], None] | None = None,
) -> HeadScores:
    """Dataset-level Ships: principal angle between base and ablated final-state matrices.

    M is the `[N, D]` matrix of last-token states after the final norm (fp32, not centred);
    the score of a head is the sum of the first `r_main` principal angles between the top
    left singular vectors of M_base and M_ablated (safety_heads.md §3). Radians unless
    `degrees=True` (ranking is the same).

    Raises:
        ValueError: as `ships`, and `r_main` outside 1..N.
    """
    eps, heads = _check(model, eps, exact, max_rows, heads)
    heads = _shard(heads, shard)
    enc = _encode(model, prompts, template)
    if isinstance(r_main, bool) or not isinstance(r_main, int) or not 1 <= r_main <= enc.batch:
        raise ValueError(f"r_main must be an int in 1..{enc.batch}, got {r_main!r}")
    _, base = _run(model, enc.input_ids, enc.attention_mask, [])
    _, states = _evaluate(
        model, enc, [[h] for h in heads], ablation=ablation, eps=eps, max_rows=max_rows, progress=progress
    )
    ang = _angles(base, states, r_main)
    if degrees:
        ang = torch.rad2deg(ang)
    out = _head_table(model, heads, ang)
    params = {
        "ablation": ablation,
        "eps": eps,
        "r_main": r_main,
        "degrees": degrees,
        "template": template,
        "n_prompts": enc.batch,
    }
    return HeadScores(out, "dataset_ships", params, model.name, model.n_kv_heads)


@dataclass
class SaharaResult:
    """Sahara's chosen heads in order, and every step's full score table."""

    heads: list[Head]
    steps: list[HeadScores] = field(default_factory=list)


def sahara(
    model: HeadModel,
    prompts: Sequence[str],
    *,
    steps: int = 3,
    heads: Sequence[Head] | None = None,
    ablation: Ablation = "ua",
    eps: float = 1e-5,
    exact: bool = False,
    r_main: int = 1,
    template: str | None = TEMPLATE,
    max_rows: int = 64,
    progress: Callable[[str], None] | None = None,
) -> SaharaResult:
    """Sahara: greedy head-group search by dataset-level Ships (safety_heads.md §3).

    At each of `steps` steps, every head not yet chosen is scored by the angle between the
    base model and the model with the chosen group plus that head ablated (always against
    the unablated base); the argmax joins the group. Ties go to the lowest (layer, head).
    No threshold and no early stop.

    Raises:
        ValueError: `steps` < 1 or more steps than candidate heads, and as `dataset_ships`.
    """
    eps, heads = _check(model, eps, exact, max_rows, heads)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= len(heads):
        raise ValueError(f"steps must be an int in 1..{len(heads)}, got {steps!r}")
    enc = _encode(model, prompts, template)
    _, base = _run(model, enc.input_ids, enc.attention_mask, [])
    chosen: list[Head] = []
    tables = []
    for step in range(steps):
        cands = [h for h in heads if h not in chosen]
        _, states = _evaluate(
            model,
            enc,
            [[*chosen, h] for h in cands],
            ablation=ablation,
            eps=eps,
            max_rows=max_rows,
            progress=progress,
        )
        ang = _angles(base, states, r_main)
        table = _head_table(model, cands, ang)
        params = {
            "step": step + 1,
            "group": [list(h) for h in chosen],
            "ablation": ablation,
            "eps": eps,
            "r_main": r_main,
        }
        scores = HeadScores(table, "sahara_step", params, model.name, model.n_kv_heads)
        tables.append(scores)
        chosen.append(scores.ranked(1)[0])
    return SaharaResult(chosen, tables)
