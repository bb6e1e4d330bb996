"""Attention knockout on prompt pairs: does the answer need the attention from one position to
another in these layers / heads?

Knockout (Geva et al. 2023, "Dissecting Recall of Factual Associations in Auto-Regressive
Language Models", EMNLP, arXiv:2304.14767, Sec. 3): block attention from the query positions to
the key positions (their logits set to -inf before the softmax, each row renormalised over its
other keys) in chosen layers and heads, and measure how the prediction changes. Geva et al.
block the last position's attention to the subject (or relation) tokens in a window of layers
and report the change in the answer's probability; here the measure is the logit difference
(mean answer logit - mean counterfactual logit, Wang et al. 2022, Sec. 3), per pair, with
Student-t intervals. A `factor` > 0 multiplies those attention probabilities instead (Ortu et
al. 2024, arXiv:2402.11655, Sec. 6).

    res = knockout(model, pairs, keys={"IO": "IO", "S": ["S1", "S2"]}, layers=range(6, 12))
    res.to_frame()          # per condition: logit diff, effect vs the unedited run, intervals
    knockout(model, pairs, keys="IO", per="head").head_scores()   # each head alone, [L, H]

The edit is the engine's `heads.engine.knockout.KnockoutBias` (also behind `steer.Knockout`);
the cells (a layer window, each layer, each head) are packed into batch rows, one cell per row
(`row_heads`), `options.max_rows` rows per forward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from heads._util.progress import progress_callback
from heads.engine.context import editing
from heads.engine.forward import forward
from heads.engine.knockout import KnockoutBias, dead_rows
from heads.engine.options import SweepOptions, sweep_options
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.results.knockout import KnockoutResult
from heads.scorers.patching.metrics import logit_diff
from heads.scorers.patching.pairs import PairBatch, check_vocab
from heads.scorers.patching.request import KnockoutRequest

__all__ = ["knockout", "run_knockout"]


def _columns(pairs: PairBatch, spec: Sequence[int | str], what: str) -> torch.Tensor:
    """`[N, T]` bool: the padded columns `spec` names in every pair (names via
    `PairBatch.position`, ints as padded columns, negative from the end)."""
    T = pairs.width
    out = torch.zeros(pairs.n, T, dtype=torch.bool)
    rows = torch.arange(pairs.n)
    for p in spec:
        if isinstance(p, str):
            out[rows, pairs.position(p)] = True
            continue
        q = p + T if p < 0 else p
        if not 0 <= q < T:
            raise HeadsteerValueError(
                f"{what} position {p} is out of range for padded length {T} (0..{T - 1})"
            )
        out[:, q] = True
    return out


def _cells(model: HeadModel, req: KnockoutRequest) -> list[tuple[tuple[int, ...], tuple[int, ...] | None]]:
    layers = tuple(range(model.n_layers)) if req.layers is None else tuple(req.layers)
    heads = None if req.heads is None else tuple(req.heads)
    if req.per == "all":
        return [(layers, heads)]
    if req.per == "layer":
        return [((la,), heads) for la in layers]
    return [((la,), (h,)) for la in layers for h in (range(model.n_heads) if heads is None else heads)]


def _logit_diffs(
    model: HeadModel,
    pairs: PairBatch,
    which: str,
    rows: list[tuple[int, int]],
    edits_for: Any,
    options: SweepOptions,
    report: Any,
    done: int,
    total: int,
) -> torch.Tensor:
    """`[R]` logit difference of `rows` = (cell, pair), `options.max_rows` per forward; `edits_for(cell
    index [r], pair index [r])` gives the engine edits of one chunk."""
    out = torch.empty(len(rows))
    ids, mask = pairs.ids(which), pairs.attention_mask
    for a in range(0, len(rows), options.max_rows):
        chunk = rows[a : a + options.max_rows]
        cell = torch.tensor([c for c, _ in chunk])
        pair = torch.tensor([i for _, i in chunk])
        n = len(chunk)
        enc = EncodedPrompts(ids[pair], mask[pair], [[] for _ in range(n)], [""] * n, [[] for _ in range(n)])
        with editing(model, edits_for(cell, pair)):
            logits = forward(model, enc, logits_to_keep=1).logits[:, -1].float().cpu()
        out[a : a + n] = logit_diff(logits, pairs, pair)
        done += n
        if report is not None:
            report(done, total)
    return out


@torch.no_grad()
def run_knockout(
    model: HeadModel, pairs: PairBatch, request: KnockoutRequest, options: SweepOptions | None = None
) -> KnockoutResult:
    """Run a `KnockoutRequest` on `pairs` (see `knockout` for the arguments and errors)."""
    if not isinstance(request, KnockoutRequest):
        raise HeadsteerTypeError(f"request must be a KnockoutRequest, got {type(request).__name__}")
    if not isinstance(pairs, PairBatch):
        raise HeadsteerTypeError(f"pairs must be a PairBatch (encode_pairs), got {type(pairs).__name__}")
    opts = sweep_options(options, {}, "knockout", takes=("max_rows", "progress", "max_memory"))
    request.check_config(model)
    if pairs.has_images:
        raise HeadsteerValueError("knockout takes text pairs; vision pairs are not supported")
    check_vocab(pairs, model.d_vocab)
    if not pairs.has_counterfactual:
        raise HeadsteerValueError(
            "knockout measures the logit difference: every pair needs counterfactual tokens"
        )
    model.check_length(pairs.width)
    opts = opts.within(model, pairs.width, "knockout")  # max_memory: rows per forward within it
    conds = request.conditions()
    queries = _columns(pairs, cast("tuple[int | str, ...]", request.queries), "queries")
    keys = {label: _columns(pairs, spec, f"keys[{label!r}]") for label, spec in conds.items()}
    if request.factor == 0:
        for label, k in keys.items():
            dead = dead_rows(queries, k, pairs.attention_mask)
            if bool(dead.any()):
                i, q = (int(x) for x in torch.nonzero(dead)[0])
                raise HeadsteerValueError(
                    f"knockout {label!r} blocks every visible key of query position {q} in pair {i} (its own "
                    "position included); keep at least one key per row"
                )
    cells = _cells(model, request)
    H = model.n_heads
    logf = -math.inf if request.factor == 0 else math.log(request.factor)
    layer_heads = torch.zeros(len(cells), model.n_layers, H, dtype=torch.bool)  # [S, L, H]
    for s, (layers, heads) in enumerate(cells):
        for la in layers:
            layer_heads[s, la, list(range(H)) if heads is None else list(heads)] = True
    used = sorted({la for layers, _ in cells for la in layers})

    N = pairs.n
    rows = [(s, i) for s in range(len(cells)) for i in range(N)]
    total = N * (1 + len(conds) * len(cells))
    knocked = torch.empty(len(conds), len(cells), N)
    with progress_callback(opts.progress, "knockout", "rows") as report:
        base = _logit_diffs(
            model, pairs, request.which, [(0, i) for i in range(N)], lambda c, p: [], opts, report, 0, total
        )
        done = N
        for c, label in enumerate(conds):

            def edits_for(cell: torch.Tensor, pair: torch.Tensor, k: torch.Tensor = keys[label]) -> list:
                return [
                    KnockoutBias(
                        layer=la,
                        row_heads=layer_heads[cell, la],
                        queries=queries[pair],
                        keys=k[pair],
                        log_factor=logf,
                    )
                    for la in used
                    if bool(layer_heads[cell, la].any())
                ]

            knocked[c] = _logit_diffs(
                model, pairs, request.which, rows, edits_for, opts, report, done, total
            ).view(len(cells), N)
            done += len(rows)
    return KnockoutResult(
        conditions=list(conds),
        keys={k: list(v) for k, v in conds.items()},
        queries=list(cast("tuple[int | str, ...]", request.queries)),
        cells=cells,
        per=request.per,
        baseline=base,
        knocked=knocked,
        which=request.which,
        factor=request.factor,
        level=request.level,
        model=model.name,
        n_layers=model.n_layers,
        n_heads=H,
        n_kv_heads=model.n_kv_heads,
        params={"n_pairs": N, "request": request.to_dict()},
    )


def knockout(
    model: HeadModel,
    pairs: PairBatch,
    keys: str | int | Sequence[int | str] | Mapping[str, Any],
    *,
    queries: str | int | Sequence[int | str] = "END",
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    per: str = "all",
    factor: float = 0.0,
    which: str = "clean",
    level: float = 0.95,
    options: SweepOptions | None = None,
) -> KnockoutResult:
    """Attention knockout on prompt pairs: block attention from `queries` to `keys` in `layers`
    (and `heads`) and measure the logit difference, per pair, against the unedited run.

    Args:
        model: the `HeadModel`.
        pairs: an encoded `PairBatch` (`encode_pairs`) with counterfactual tokens, N pairs of
            padded width T.
        keys: the key positions to block: a position name the pairs carry (`"IO"`, `"S1"`; see
            `PairBatch.position_names`: columns of the clean prompt), a padded column (negative
            from the end), or a list of them blocked together; or `{label: positions}` for one
            condition per label (e.g. `{"IO": "IO", "S": ["S1", "S2"]}`).
        queries: the query positions whose attention is cut (default `"END"`: the last token).
        layers: the layers cut (default None: all).
        heads: the query heads cut in each of those layers (default None: all).
        per: `"all"` (default: one cell, the layers and heads together — Geva et al.'s window),
            `"layer"` (each layer alone) or `"head"` (each head alone).
        factor: 0 (default) blocks; a factor > 0 multiplies those attention probabilities and
            renormalises (modification).
        which: `"clean"` (default) or `"corrupted"`: the prompts run.
        level: confidence level of the intervals (default 0.95).
        options: `SweepOptions` (`max_rows` batch rows per forward, `progress`, `max_memory`:
            fewer rows where the `"knockout"` plan needs it, refused before any forward when
            one row does not fit).

    Returns:
        a `KnockoutResult`: the unedited `baseline [N]` and `knocked [C, S, N]` logit differences
        (logits) per condition and cell, `effect()`, `to_frame()` (means with Student-t
        intervals), `head_scores(condition)` (`[L, H]` mean effect of each head's cell).

    Raises:
        HeadsteerTypeError: pairs not a `PairBatch`, options not a `SweepOptions`.
        HeadsteerValueError: no keys; a position name the pairs lack or a column out of range;
            layers / heads out of range; an unknown `per` / `which`; a negative or non-finite
            factor; a knockout that leaves a query row no visible key; pairs without
            counterfactual tokens or with ids outside the vocabulary — all before any forward.

    Source: Geva et al., EMNLP 2023 (arXiv:2304.14767), Sec. 3; Ortu et al., ACL 2024
    (arXiv:2402.11655), Sec. 6.
    """
    req = KnockoutRequest(
        keys=keys,
        queries=queries,
        layers=layers,
        heads=heads,
        per=per,
        factor=factor,
        which=which,
        level=level,
    )
    return run_knockout(model, pairs, req, options)
