"""MAPS: attention-head functionality from parameters (Elhelo & Geva, ACL 2025, arXiv:2412.11965).

Spec: docs/methods/maps.md. Head h maps source token s to target t with strength
`M^h[s, t] = (Ẽ[s] W_V^kv(h) W_O^h) · U[:, t]`, the OV circuit projected to the
vocabulary (§2). `M` is never materialised: per layer, `W_O U` (`[n_heads * d_head,
d_vocab]`) is formed once and every head's rows are `(Ẽ[src] W_V) (W_O^h U)`.
Ẽ is the raw embedding for layer-0 heads and the first MLP's output
`MLP_0(Norm_0(E))` (not E + MLP_0(E)) for heads in layers >= 1. Raw weights: no
LayerNorm folding, no biases.

A relation score is the fraction of pairs (s, t) whose target is in the top-k of
row s over the whole vocabulary; the suppression score is the same for -M. Ranks
break ties by lowest token id (pitfall 5), so scores are deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from heads._util.progress import progress_callback
from heads._util.validation import check_int, is_int, short_repr
from heads.engine.options import SweepOptions, sweep_options
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.tokens import readable_token
from heads.model.adapter import HeadModel, _module
from heads.model.families import family_of
from heads.results.maps import IMPLEMENTS_THRESHOLD as IMPLEMENTS_THRESHOLD
from heads.results.maps import SCHEMA as SCHEMA
from heads.results.maps import SCHEMA_VERSION as SCHEMA_VERSION
from heads.results.maps import MapsScores as MapsScores  # defined there; imported here as before
from heads.results.scores import HeadScores
from heads.scorers.maps.request import MapsRequest

if TYPE_CHECKING:
    import pandas as pd


__all__ = [
    "MapsScores",
    "RelationPairs",
    "first_mlp",
    "k_for",
    "positive_int",
    "maps_scores",
    "run_maps",
    "salient_operations",
    "source_representations",
    "target_ranks",
    "top_k_hits",
    "vocabulary_sources",
]


def positive_int(value: object, what: str) -> int:
    """`value` as an int >= 1, else ValueError naming it."""
    return check_int(what, value, lo=1)


def k_for(k_rule: str, d_vocab: int) -> int:
    """Top-k for a relation: copying 1 / other 10, or 3 / 25 when the vocabulary is >= 100K."""
    if k_rule not in ("copy", "default"):
        raise HeadsteerValueError(f"unknown k_rule {short_repr(k_rule)}: use 'copy' or 'default'")
    big = d_vocab >= 100_000
    if k_rule == "copy":
        return 3 if big else 1
    return 25 if big else 10


@dataclass
class RelationPairs:
    """One relation as token-id pairs `(source_id, target_id)`, scored at top-`k`.

    `texts` optionally keeps the `(source, target)` strings (needed for prompts).
    """

    name: str
    pairs: list[tuple[int, int]]
    k: int
    texts: list[tuple[str, str]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.pairs, (str, bytes)) or not isinstance(self.pairs, Sequence):
            raise HeadsteerTypeError(
                f"relation {short_repr(self.name)}: pairs must be a list of (source_id, target_id)"
            )
        if not self.pairs:
            raise HeadsteerValueError(f"relation {short_repr(self.name)} has no pairs")
        for pair in self.pairs:
            if len(pair) != 2 or any(not is_int(x) for x in pair):
                raise HeadsteerTypeError(
                    f"relation {short_repr(self.name)}: pair {short_repr(pair)} is not two int token ids"
                )
        self.pairs = [(int(a), int(b)) for a, b in self.pairs]
        self.k = positive_int(self.k, f"relation {self.name!r}: k")
        if self.texts is not None and len(self.texts) != len(self.pairs):
            raise HeadsteerValueError(
                f"relation {short_repr(self.name)}: {len(self.texts)} texts for {len(self.pairs)} pairs"
            )


def first_mlp(model: HeadModel, x: torch.Tensor) -> torch.Tensor:
    """Output of layer 0's MLP (after its pre-MLP norm) on rows `x` `[n, d_model]`.

    The pre-MLP norm comes from the family table (`Family.mlp_norm`: Llama-style
    `post_attention_layernorm`, Gemma's `pre_feedforward_layernorm`, GPT-2's `ln_2`).

    Raises:
        ValueError: a family whose MLP reads the raw residual with no input norm (post-norm
            models such as OLMo 2), where this source representation is not defined; use
            `apply_first_mlp=False` for them.
    """
    config = model.model.config  # looked up now: the family as the config names it
    kind = getattr(config, "model_type", None)
    try:
        fam = family_of(config)
    except ValueError:
        fam = None
    if fam is None or fam.mlp_norm is None or fam.mlp is None:
        raise HeadsteerValueError(
            f"the first-MLP source representation is not defined here for model_type {short_repr(kind)} (not "
            "a known family, its MLP has no input norm, or it is not one module); pass apply_first_mlp=False"
        )
    block = model.layers[0]
    h = _module(block, fam.mlp_norm)(x)
    if not fam.moe:
        y: torch.Tensor = _module(block, fam.mlp)(h)
        return y
    # a mixture-of-experts block routes a [batch, seq, d_model] input (each row to its top-k
    # experts) and may return (output, router logits): run the rows as one sequence
    out = _module(block, fam.mlp)(h[None])
    out = out[0] if isinstance(out, tuple) else out
    routed: torch.Tensor = out.reshape(x.shape)
    return routed


@torch.no_grad()
def source_representations(
    model: HeadModel, token_ids: torch.Tensor, layer: int, *, apply_first_mlp: bool = True
) -> torch.Tensor:
    """Ẽ rows `[n, d_model]` (fp32) for source tokens seen by heads of `layer` (docs/methods/maps.md)."""
    e = model.W_E[token_ids.to(model.W_E.device)].float()
    if layer == 0 or not apply_first_mlp:
        return e
    return first_mlp(model, e.to(model.dtype)).float()


def vocabulary_sources(
    model: HeadModel, layer: int, *, apply_first_mlp: bool = True, chunk: int = 8192
) -> torch.Tensor:
    """Ẽ of every vocabulary token `[V, D]` fp32 for heads of `layer`, `chunk` rows at a time
    (`source_representations` over `arange(V)`; the same for every layer above 0), to pass to
    `salient_operations(sources=...)` for many heads.

    Raises:
        ValueError: unknown layer; `chunk` not a positive int.
    """
    model.check_head(layer)
    chunk = positive_int(chunk, "chunk")
    parts = [
        source_representations(
            model, torch.arange(a, min(model.d_vocab, a + chunk)), layer, apply_first_mlp=apply_first_mlp
        )
        for a in range(0, model.d_vocab, chunk)
    ]
    return torch.cat(parts)


def target_ranks(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank of each target in its row of `logits` `[P, V]`, for M and for -M.

    Rank 0 is the top. Ties go to the lowest token id. Returns `(rank, rank_under_negation)`.
    Two passes over the row (`>` and `>=`); the id-ordered tie count runs only on rows
    that have ties.
    """
    v = logits.gather(1, targets[:, None])
    gt = (logits > v).sum(1)
    ge = (logits >= v).sum(1)
    tie_before = torch.zeros_like(gt)
    tied = torch.nonzero(ge - gt > 1).flatten()
    if len(tied):
        ids = torch.arange(logits.shape[1], device=logits.device)
        sub = logits[tied]
        tie_before[tied] = ((sub == v[tied]) & (ids[None, :] < targets[tied, None])).sum(1)
    return gt + tie_before, (logits.shape[1] - ge) + tie_before


def top_k_hits(
    logits: torch.Tensor, targets: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether each target is in the top-k of its row of `logits` `[P, V]`, for M and for -M.

    Same answer as `target_ranks(...) < k` (ties to the lowest id), but from the k-th
    largest / smallest values: only rows whose target ties the k-th value are ranked exactly.
    """
    v = logits.gather(1, targets[:, None]).squeeze(1)
    k_max = int(k.max())
    idx = (k - 1)[:, None]
    kth_hi = torch.topk(logits, k_max, dim=1).values.gather(1, idx).squeeze(1)
    kth_lo = torch.topk(logits, k_max, dim=1, largest=False).values.gather(1, idx).squeeze(1)
    hit, supp = v > kth_hi, v < kth_lo
    border = torch.nonzero((v == kth_hi) | (v == kth_lo)).flatten()
    if len(border):
        rank, rank_neg = target_ranks(logits[border], targets[border])
        hit[border] = rank < k[border]
        supp[border] = rank_neg < k[border]
    return hit, supp


def _as_relations(model: HeadModel, relations: object) -> list[RelationPairs]:
    """A checked list of relations (one `RelationPairs`, a list, or a `probes` RelationSet)."""
    given: object = [relations] if isinstance(relations, RelationPairs) else relations
    given = getattr(given, "relations", given)
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise HeadsteerTypeError(
            f"relations must be RelationPairs or a list of them, got {type(given).__name__}"
        )
    items = list(given)
    if not items:
        raise HeadsteerValueError("no relations to score")
    names = set()
    checked: list[RelationPairs] = []
    for r in items:
        if not isinstance(r, RelationPairs):
            raise HeadsteerTypeError(f"expected RelationPairs, got {short_repr(r)}")
        checked.append(r)
        if r.name in names:
            raise HeadsteerValueError(f"relation name {short_repr(r.name)} appears twice")
        names.add(r.name)
        if r.k > model.d_vocab:
            raise HeadsteerValueError(
                f"relation {short_repr(r.name)}: k={r.k} exceeds the vocabulary ({model.d_vocab})"
            )
        for s, t in r.pairs:
            if not (0 <= s < model.d_vocab and 0 <= t < model.d_vocab):
                raise HeadsteerValueError(
                    f"relation {short_repr(r.name)}: token id pair {(s, t)} outside the vocabulary"
                )
    return checked


@torch.no_grad()
def maps_scores(
    model: HeadModel,
    relations: Sequence[RelationPairs],
    *,
    apply_first_mlp: bool = True,
    pair_chunk: int = 1024,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> MapsScores:
    """Static MAPS relation and suppression scores of every head (docs/methods/maps.md).

    Builds the `MapsRequest` (its checks) and runs it (`run_maps`, as `heads.run` does).

    Args:
        model: the model (weights only; no forward pass over prompts).
        relations: relations as token-id pairs with their k.
        apply_first_mlp: Ẽ = MLP_0(Norm_0(E)) for heads in layers >= 1 (default True).
        pair_chunk: pairs ranked at once (memory `pair_chunk x d_vocab` floats).
        options: `heads.SweepOptions`; only `progress` applies: True (default: a tqdm bar),
            False / None (off) or `progress(done, total)` after each layer, in layers
            (`total` is `n_layers`).
        **deprecated: `progress=` as a keyword (one release; a `DeprecationWarning`).

    Returns:
        MapsScores: per relation, `HeadScores` `[n_layers, n_heads]` in [0, 1] with
        method `"maps_relation"` / `"maps_suppression"`.

    Raises:
        ValueError: no relations, empty or duplicate relations, k above the vocabulary size,
            token ids outside the vocabulary, or a non-positive `pair_chunk`.
        TypeError: a relation that is not `RelationPairs`.
    """
    opts = sweep_options(options, deprecated, "maps_scores", takes=("progress",))
    request = MapsRequest(apply_first_mlp=apply_first_mlp)
    return run_maps(model, relations, request, opts, pair_chunk=pair_chunk)


@torch.no_grad()
def run_maps(
    model: HeadModel,
    relations: Sequence[RelationPairs],
    request: MapsRequest,
    options: SweepOptions | None = None,
    *,
    pair_chunk: int = 1024,
) -> MapsScores:
    """Run a `MapsRequest` on `relations` (what `maps_scores` does once it has built the request,
    whose values are checked there; `options` takes `progress` only; see `maps_scores` for the
    arguments, the result and the errors)."""
    if not isinstance(request, MapsRequest):
        raise HeadsteerTypeError(f"request must be a MapsRequest, got {type(request).__name__}")
    opts = sweep_options(options, {}, "maps_scores", takes=("progress",))
    relations = _as_relations(model, relations)
    pair_chunk = positive_int(pair_chunk, "pair_chunk")
    apply_first_mlp = request.apply_first_mlp
    sources = sorted({s for r in relations for s, _ in r.pairs})
    row = {s: i for i, s in enumerate(sources)}
    src_ids = torch.tensor(sources)
    p_rows = torch.tensor([row[s] for r in relations for s, _ in r.pairs])
    U = model.W_U.float()
    p_tgts = torch.tensor([t for r in relations for _, t in r.pairs], device=U.device)
    p_k = torch.tensor([r.k for r in relations for _ in r.pairs], device=U.device)
    sizes = [len(r.pairs) for r in relations]
    n_pairs = len(p_tgts)
    hits = torch.zeros(model.n_layers, model.n_heads, n_pairs, dtype=torch.bool)
    supp = torch.zeros_like(hits)
    reps = {}
    with progress_callback(opts.progress, "MAPS static scores", "layers") as report:
        for layer in range(model.n_layers):
            key = layer == 0 or not apply_first_mlp
            if key not in reps:
                reps[key] = source_representations(model, src_ids, layer, apply_first_mlp=apply_first_mlp)
            x = reps[key]
            xv = torch.einsum(
                "nd,kde->kne", x, model.layer_weights(layer)["W_V"].float()
            )  # [n_kv, n_src, d_head]
            ou = (
                model.layer_weights(layer)["W_O"].float().reshape(model.n_heads * model.d_head, model.d_model)
                @ U
            )
            ou = ou.view(model.n_heads, model.d_head, -1)  # [n_heads, d_head, d_vocab]
            for head in range(model.n_heads):
                xv_h = xv[model.kv_head(head)]
                for a in range(0, n_pairs, pair_chunk):
                    b = min(n_pairs, a + pair_chunk)
                    logits = xv_h[p_rows[a:b]] @ ou[head]  # [pairs, d_vocab]: only the rows scored
                    hit, sup = top_k_hits(logits, p_tgts[a:b], p_k[a:b])
                    hits[layer, head, a:b], supp[layer, head, a:b] = hit.cpu(), sup.cpu()
            if report is not None:
                report(layer + 1, model.n_layers)
    params = {"apply_first_mlp": apply_first_mlp, "ln_folded": False, "biases": "ignored"}
    out = MapsScores({}, {}, params)
    start = 0
    for r, n in zip(relations, sizes, strict=True):
        sl = slice(start, start + n)
        start += n
        p = {**params, "relation": r.name, "k": r.k, "n_pairs": n}
        rel, sup = hits[..., sl].float().mean(-1), supp[..., sl].float().mean(-1)
        out.relation[r.name] = HeadScores(
            rel, "maps_relation", p, model=model.name, n_kv_heads=model.n_kv_heads
        )
        out.suppression[r.name] = HeadScores(
            sup, "maps_suppression", p, model=model.name, n_kv_heads=model.n_kv_heads
        )
    return out


@torch.no_grad()
def salient_operations(
    model: HeadModel,
    layer: int,
    head: int,
    *,
    k_s: int = 15,
    k_m: int = 5,
    apply_first_mlp: bool = True,
    chunk: int = 8192,
    sources: torch.Tensor | None = None,
) -> pd.DataFrame:
    """The head's most amplified source tokens and their top mapped targets (docs/methods/maps.md).

    sigma_t = ||ẽ_t W_V W_O^h|| / ||ẽ_t|| over the whole vocabulary (computed through
    the Gram matrix of W_O^h, never forming |V| x d_model products); for the top `k_s`
    tokens, the top `k_m` targets of their row of M^h.

    Args:
        sources: Ẽ of the whole vocabulary `[V, D]` fp32, `vocabulary_sources(model, layer)`,
            to share across heads (it is the same for every layer above 0 and is most of the
            cost: the first MLP over |V| tokens); default None: computed here, `chunk` rows at
            a time.

    Returns:
        pandas DataFrame with columns `source, source_id, sigma, targets, target_ids`
        (`source` and `targets` as readable text, `heads.inputs.tokens`: `␣cat`, `⏎`).

    Raises:
        ValueError: unknown layer/head; `sources` not `[V, D]`.
    """
    import pandas as pd

    model.check_head(layer, head)
    k_s, k_m, chunk = positive_int(k_s, "k_s"), positive_int(k_m, "k_m"), positive_int(chunk, "chunk")
    if k_s > model.d_vocab or k_m > model.d_vocab:
        raise HeadsteerValueError(f"k_s={k_s} and k_m={k_m} must not exceed the vocabulary ({model.d_vocab})")
    tok = model.tokenizer
    w_v = model.layer_weights(layer)["W_V"][model.kv_head(head)].float()  # [d_model, d_head]
    w_o = model.layer_weights(layer)["W_O"][head].float()  # [d_head, d_model]
    gram = w_o @ w_o.T
    sigma = torch.empty(model.d_vocab)
    if sources is not None and tuple(sources.shape) != (model.d_vocab, model.d_model):
        raise HeadsteerValueError(
            f"sources must be [d_vocab, d_model] = [{model.d_vocab}, {model.d_model}], "
            f"got {list(sources.shape)}"
        )
    for a in range(0, model.d_vocab, chunk):
        ids = torch.arange(a, min(model.d_vocab, a + chunk))
        if sources is None:
            x = source_representations(model, ids, layer, apply_first_mlp=apply_first_mlp)
        else:
            x = sources[a : a + len(ids)].float()
        xv = x @ w_v
        num = ((xv @ gram) * xv).sum(1).clamp(min=0).sqrt()
        sigma[a : a + len(ids)] = num / x.norm(dim=1).clamp(min=1e-12)
    order = _topk_lowest_id(sigma, k_s)
    src = torch.tensor(order)
    if sources is None:
        x = source_representations(model, src, layer, apply_first_mlp=apply_first_mlp)
    else:
        x = sources[src].float()
    rows = (x @ w_v @ w_o) @ model.W_U.float()
    rows_list = []
    for i, sid in enumerate(order):
        r = rows[i]
        tgt = _topk_lowest_id(r, k_m)
        rows_list.append(
            {
                "source": readable_token(tok, sid) if tok is not None else str(sid),
                "source_id": sid,
                "sigma": sigma[sid].item(),
                "targets": [readable_token(tok, t) if tok is not None else str(t) for t in tgt],
                "target_ids": tgt,
            }
        )
    return pd.DataFrame(rows_list)


def _topk_lowest_id(row: torch.Tensor, k: int) -> list[int]:
    """Top-k indices of `row`, ties broken by lowest index."""
    cand = torch.topk(row, min(row.numel(), k)).values[-1]  # k-th largest value
    ids = torch.nonzero(row >= cand).flatten().tolist()
    return sorted(ids, key=lambda j: (-row[j].item(), j))[:k]
