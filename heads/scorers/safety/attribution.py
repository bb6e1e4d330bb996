"""Head attribution in one pass: attribution patching (AtP / AtP*) over the Ships ablations.

Sources: Nanda 2023, *Attribution patching*; Syed, Rager & Conmy 2023, *Attribution Patching
Outperforms Automated Circuit Discovery*; Kramár, Lieberum, Shah & Nanda 2024, *AtP\\*: An
efficient and scalable method for localizing LLM behaviour to components* (arXiv:2403.00745),
§3.1 (AtP), §3.1.1 (attention saturation), §3.1.2 (GradDrop). Exact counterpart:
`heads.scorers.safety.ships.ships` (docs/methods/safety.md).

For every head `(l, h)` and prompt `b`, the effect of an ablation on a metric `m` of the
last-position log-probs is estimated to first order in the head's output `z` (the input of
`o_proj`, per-head slice `[T, d_head]`)::

    delta_m(b, l, h) ~= sum_t  dm/dz[b, t, l, h] . (z_ablated - z)[b, t, l, h]

One forward with gradients and one backward per metric scalar give `dm/dz` for every head at
once (per prompt: batch rows do not interact). The change `z_ablated - z` is:

* `"sc"` (head output x eps), `"zero"` (eps = 0): `(eps - 1) z`, exact.
* `"mean"`: `mean_z - z`, with `mean_z` the head's output averaged over every real position of
  every prompt (exact counterpart: `HeadReplace`).
* `"ua"` (query x eps) and any custom attention edit (e.g. a PASTA-style `LogitBias`): with the
  AtP* **saturation fix** (`saturation_fix=True`, default) the pattern change is exact: one
  *delta pass* per layer reruns that layer alone from the clean residual stream with the edit
  on all its heads (heads of one layer do not interact before `o_proj`), through the same
  engine as the exact sweep, and stops at `o_proj`; only the effect downstream of `z` is
  linearised. Without the fix the softmax is linearised too (plain AtP on the attention
  logits): `dA = (eps - 1) A * (log A - sum_k A log A)` (the derivative of
  `softmax(alpha * s)` at alpha = 1, with `s = log A` up to a row constant), `dz = dA V`.

**KL (Ships) needs second order.** KL(p_clean || p) is minimal at the clean point, so its
gradient there is exactly 0 and first order estimates 0 for every head. We linearise the
log-probs instead and evaluate the KL of a coarse-grained distribution exactly: the
`kl_tokens` most likely clean tokens (default 4) plus one "rest" class. With `d_j` the
first-order change of `log p(v_j)` (one backward per token), the predicted distribution is
`p'_j = p_j exp(d_j)`, `p'_rest = 1 - sum_j p'_j` (clamped at `1e-4 p_rest`, then renormalised),
and the estimate is KL(coarse p || coarse p'). To second order this is the Fisher form
`1/2 [sum_j p_j d_j^2 + (sum_j p_j d_j)^2 / p_rest]` (for one token: `1/2 p/(1-p) d^2`), a lower
bound on the full second-order KL by the data-processing inequality; unlike the quadratic it
saturates (grows linearly, not quadratically, in a large drop of the top token).

**GradDrop** (`graddrop=True`, AtP* §3.1.2): against cancellation between paths, L extra
backward passes each zero the gradient through layer `l'`'s residual contributions (attention
and MLP outputs); the estimate is `1/(L-1) sum_l' |delta_m^{(l')}|` (for KL: the mean of the
L per-drop KL estimates, each >= 0). A head's own layer contributes 0. Costs L x the backward.

**Memory and backends.** The gradients come one layer at a time (`heads.scorers.safety.atp`,
`heads.scorers.layerwise`): memory grows linearly in the prompt, about one layer's activations
plus a residual-stream copy every ~sqrt(L) layers, never the whole model's graph. Every forward
goes through the backend's entry point (`HeadModel.run`: the TransformerLens bridge's rewired
module tree, or an nnsight `trace()`) with the engine's site edits (`head_output`, the residual
stream), so the numbers are the same on `hf`, `transformer_lens` and `nnsight`. nnsight with
`remote=True` is refused: the edits and the backward run locally.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from heads._util.progress import progress_callback
from heads._util.validation import check_int, is_int, short_repr
from heads.engine.activations import ActivationEdit
from heads.engine.edits import AttentionCall, Edit, HeadOutputEdit
from heads.engine.options import SweepOptions, sweep_options
from heads.engine.variants import check_heads, run_rows
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores, HeadSpec
from heads.scorers.controls import random_head_draws
from heads.scorers.safety.atp import BatchSetup, attribute_batch, walks_per_batch
from heads.scorers.safety.common import (
    TEMPLATE,
    ShipsResult,
    check_scoring,
    encode_queries,
    exact_ships,
    head_pairs,
)
from heads.scorers.safety.request import AttributionRequest, control_count
from heads.scorers.stability import attach, check_samples

__all__ = [
    "AttributionMetric",
    "HeadReplace",
    "attribute",
    "confirm_ships",
    "logit_diff",
    "run_attribution",
    "sahara_candidates",
    "target_logprob",
]

Head = tuple[int, int]
AttributionMetric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""`(last_logp [R, V] fp32, prompt_index [R] long) -> [R]`: a differentiable per-prompt metric
(named apart from the patching `heads.scorers.patching.metrics.Metric`; `Metric` here is its old
name, kept one release with a DeprecationWarning)."""


def __getattr__(name: str) -> Any:
    """`Metric`: the old name of `AttributionMetric` (one release; warns)."""
    if name == "Metric":
        import warnings

        warnings.warn(
            "heads.scorers.safety.attribution.Metric is deprecated: use AttributionMetric (the patching "
            "Metric is another thing); the old name is removed in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return AttributionMetric
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(eq=False, repr=False)
class HeadReplace(HeadOutputEdit):
    """Replace the chosen heads' outputs by fixed vectors (mean ablation when `values` are means).

    Attributes:
        values: `[n_heads, d_head]` replacement for every head of the layer (only the chosen
            heads are replaced), the same at every position.

    Raises:
        TypeError: `values` is not a 2-d tensor.
        ValueError: `values` has non-finite entries.
    """

    values: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.values, torch.Tensor) or self.values.ndim != 2:
            raise HeadsteerTypeError(
                f"values must be a [n_heads, d_head] tensor, got {short_repr(self.values)}"
            )
        if not torch.isfinite(self.values).all():
            raise HeadsteerValueError("HeadReplace values must be finite")

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        assert self.values is not None  # checked by validate()
        return self.values.to(z.device, z.dtype).expand_as(z)


def target_logprob(targets: Sequence[int]) -> AttributionMetric:
    """AttributionMetric: log p(target token of prompt i) at the last position (nats).

    Args:
        targets: one token id per prompt (`[N]`).

    Raises:
        ValueError: an empty list or a non-int id.
    """
    ids = _token_ids(targets, "targets")

    def metric(logp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return logp.gather(-1, ids[rows].to(logp.device)[:, None])[:, 0]

    metric.n_prompts, metric.max_token = len(ids), int(ids.max())  # type: ignore[attr-defined]
    metric.label = "target_logprob"  # type: ignore[attr-defined]
    return metric


def logit_diff(targets: Sequence[int], foils: Sequence[int]) -> AttributionMetric:
    """AttributionMetric: logit(target_i) - logit(foil_i) at the last position (= the log-prob difference).

    Raises:
        ValueError: empty or unequal lists, or a non-int id.
    """
    a, b = _token_ids(targets, "targets"), _token_ids(foils, "foils")
    if len(a) != len(b):
        raise HeadsteerValueError(f"targets and foils differ in length: {len(a)} vs {len(b)}")

    def metric(logp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        r = rows.to(logp.device)
        return (
            logp.gather(-1, a[r][:, None].to(logp.device))[:, 0]
            - logp.gather(-1, b[r][:, None].to(logp.device))[:, 0]
        )

    metric.n_prompts, metric.max_token = len(a), int(max(a.max(), b.max()))  # type: ignore[attr-defined]
    metric.label = "logit_diff"  # type: ignore[attr-defined]
    return metric


def _token_ids(ids: Sequence[int], what: str) -> torch.Tensor:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids:
        raise HeadsteerValueError(f"{what} must be a non-empty list of token ids, got {short_repr(ids)}")
    for t in ids:
        if not is_int(t) or t < 0:
            raise HeadsteerValueError(f"{what} must hold non-negative int token ids, got {short_repr(t)}")
    return torch.tensor([int(t) for t in ids], dtype=torch.long)


def _head_means(model: HeadModel, enc: EncodedPrompts, max_rows: int) -> list[torch.Tensor]:
    """Per layer, `[n_heads, d_head]` mean head output over every real position of every prompt
    (read at the engine's `head_output` site)."""
    H, d = model.n_heads, model.d_head
    sums = [torch.zeros(H, d, dtype=torch.float64) for _ in range(model.n_layers)]
    state: dict = {}

    def add(layer: int) -> Callable[[torch.Tensor, AttentionCall], None]:
        def fn(z: torch.Tensor, call: AttentionCall) -> None:
            m = state["mask"].to(z.device, torch.float64)[..., None, None]
            sums[layer] += (z.double() * m).sum((0, 1)).cpu()

        return fn

    reads: list[Edit] = [ActivationEdit("head_output", layer, add(layer)) for layer in range(model.n_layers)]
    for a in range(0, enc.batch, max_rows):
        ids, mask = enc.input_ids[a : a + max_rows], enc.attention_mask[a : a + max_rows]
        state["mask"] = mask
        run_rows(model, ids, mask, reads)
    n = float(enc.attention_mask.sum())
    return [(s / n).float() for s in sums]


def attribute(
    model: HeadModel,
    prompts: str | Sequence[str],
    *,
    heads: Sequence[Head] | None = None,
    ablation: str | Callable[[int], Edit] = "ua",
    eps: float = 1e-5,
    exact: bool = False,
    metric: str | AttributionMetric = "kl",
    kl_tokens: int = 4,
    saturation_fix: bool = True,
    graddrop: bool = False,
    template: str | None = TEMPLATE,
    options: SweepOptions | None = None,
    stability: int = 0,
    **deprecated: Any,
) -> ShipsResult:
    """First-order (AtP / AtP*) estimate of every head's ablation effect, one forward + backward per batch.
    Builds the `AttributionRequest` (its checks) and runs it (`run_attribution`, as `heads.run` does).

    The estimate is a ranking to confirm, not a result: rerun its top heads exactly
    (`confirm_ships`, `ships(method="attribution", confirm=k)`) before reading a head as
    important; it can rank a strong head far down (weakest in the early layers).

    Args:
        model: the model; prompts are plain strings put into `template` (as `ships`).
        heads: heads to report (default all); every head is estimated anyway, the rest are NaN.
        ablation: `"ua"` (query x eps, Ships' default), `"sc"` (output x eps), `"zero"`
            (output x 0), `"mean"` (output -> its mean over all real positions of all prompts),
            or a callable `layer -> Edit` acting on **all heads** of that layer (an attention
            edit such as a PASTA-style `LogitBias` or a `QueryEdit`; its exact pattern change
            is computed by the delta pass).
        eps: the ablation scale for `"ua"`/`"sc"` (default 1e-5); `exact=True` uses 0.
        metric: `"kl"` (Ships: KL(p_clean || p_ablated), nats, via the coarse-grained
            second-order estimate, see the module doc) or an `AttributionMetric` callable
            `(last_logp [R, V], prompt_index [R]) -> [R]` (e.g. `target_logprob`,
            `logit_diff`), estimated to first order as metric(ablated) - metric(clean).
        kl_tokens: for `"kl"`, how many top clean tokens to follow (one backward each; default 4: on the
            embedded model it finds 9 of the exact top 10 in its top 30, against 6 with 1).
        saturation_fix: AtP* §3.1.1 for `"ua"`/custom edits: exact pattern change (default);
            False linearises the softmax as plain AtP does.
        graddrop: AtP* §3.1.2 GradDrop (L extra backward passes; a score then is a magnitude).
        options: `heads.SweepOptions`; `max_rows`: prompts per forward (the memory bound: the
            graph of one batch is kept), fewer where `max_memory` needs it (the `"gradient"`
            plan; refused before any forward when one prompt does not fit); `progress`: a
            tqdm bar (default; drawn after 1 s) or a `(done, total)` callable, counted in walks
            down the layers (one per batch, with GradDrop one per group of dropped layers). The
            0.1 keyword `max_rows=` still works, with a `DeprecationWarning`.
        stability: bootstrap resamples of the prompts (default 0: none; e.g. 100) for the
            ranking's stability, `result.scores.stability` (from the per-prompt estimates, no
            extra forward; `heads.results.stability`).

    Returns:
        ShipsResult: per-prompt estimates `[N, L, H]` and their mean as HeadScores with method
        `"ships_attribution"` (metric "kl": estimated KL in nats, >= 0, larger = more important,
        as `ships`) or `"attribution"` (a callable metric: estimated change of the metric).

    Raises:
        ValueError: empty prompts, unknown heads/ablation/metric, bad eps, kl_tokens, max_rows,
            a metric built for a different number of prompts, graddrop on a 1-layer model, an
            nnsight model with `remote=True` (gradients and hooks are local).
        TypeError: non-bool exact / saturation_fix / graddrop.
    """
    opts = sweep_options(options, deprecated, "attribute", takes=_ATTRIBUTE_TAKES)
    request = AttributionRequest(
        heads=head_pairs(model, heads),
        ablation=ablation,
        eps=eps,
        exact=exact,
        metric=metric,
        kl_tokens=kl_tokens,
        saturation_fix=saturation_fix,
        graddrop=graddrop,
        template=template,
        stability=stability,
    )
    return run_attribution(model, prompts, request, opts)


_ATTRIBUTE_TAKES = ("max_rows", "max_memory")


def run_attribution(
    model: HeadModel,
    prompts: str | Sequence[str],
    request: AttributionRequest,
    options: SweepOptions | None = None,
) -> ShipsResult:
    """Run an `AttributionRequest` on `prompts` (what `attribute` / `heads.attribution_patching`
    does once it has built the request: its values are checked there, its heads, `kl_tokens` and
    `graddrop` here against `model`; `options` takes `max_rows` and `max_memory`; see `attribute`
    for the rest)."""
    if not isinstance(request, AttributionRequest):
        raise HeadsteerTypeError(f"request must be an AttributionRequest, got {type(request).__name__}")
    opts = sweep_options(options, {}, AttributionRequest.NAME, takes=_ATTRIBUTE_TAKES)
    if model.tokenizer is None:
        raise HeadsteerValueError("attribution needs a HeadModel with a tokenizer")
    if getattr(model.backend, "remote", False):
        raise HeadsteerValueError(
            f"attribution on the {short_repr(model.backend.kind)} backend with remote=True: it reads "
            "head outputs "
            "and their gradients through local torch hooks, which do not run on NDIF (use remote=False)"
        )
    request.check_config(model)  # heads in range, kl_tokens below the vocabulary, graddrop's layers
    ablation, eps, exact, metric = request.ablation, request.eps, request.exact, request.metric
    kl_tokens, saturation_fix, graddrop = request.kl_tokens, request.saturation_fix, request.graddrop
    template, stability, heads = request.template, request.stability, request.heads
    chosen = check_heads(model, heads)
    enc = encode_queries(model, prompts, template)
    check_samples(enc.batch, stability, "prompts")
    n_metric = getattr(metric, "n_prompts", None)
    if callable(metric) and n_metric is not None and n_metric != enc.batch:
        raise HeadsteerValueError(f"the metric was built for {n_metric} prompts, got {enc.batch} prompts")
    max_token = getattr(metric, "max_token", None)
    if callable(metric) and max_token is not None and max_token >= model.d_vocab:
        raise HeadsteerValueError(f"token id {max_token} is outside the vocabulary (size {model.d_vocab})")
    model.check_length(enc.length)
    max_rows = opts.within(model, enc.length, "gradient").max_rows  # max_memory: rows whose graph fits
    eps = 0.0 if (exact or ablation == "zero") else float(eps)
    means = _head_means(model, enc, max_rows) if ablation == "mean" else None

    per_prompt = torch.zeros(enc.batch, model.n_layers, model.n_heads)
    setup = BatchSetup(ablation, eps, metric, kl_tokens, saturation_fix, graddrop, means)
    total = -(-enc.batch // max_rows) * walks_per_batch(model.n_layers, setup)
    with progress_callback(opts.progress, "attribution", "walks", delay=1.0) as report:
        done = 0

        def walked() -> None:
            nonlocal done
            done += 1
            if report is not None:
                report(done, total)

        for a in range(0, enc.batch, max_rows):
            rows = torch.arange(a, min(a + max_rows, enc.batch))
            per_prompt[rows] = attribute_batch(model, enc, rows, setup, walked=walked)
    keep = torch.zeros(model.n_layers, model.n_heads, dtype=torch.bool)
    for layer, head in chosen:
        keep[layer, head] = True
    per_prompt = torch.where(keep, per_prompt, math.nan)
    params = {
        "ablation": ablation if isinstance(ablation, str) else "custom",
        "eps": eps,
        "metric": metric if isinstance(metric, str) else getattr(metric, "label", "custom"),
        "kl_tokens": kl_tokens if metric == "kl" else None,
        "saturation_fix": saturation_fix,
        "graddrop": graddrop,
        "template": template,
        "n_prompts": enc.batch,
        "estimate": "attribution patching (first order in head outputs)",
    }
    method = "ships_attribution" if metric == "kl" else "attribution"
    scores = HeadScores(per_prompt.mean(0), method, params, model.name, model.n_kv_heads)
    return ShipsResult(per_prompt, attach(scores, per_prompt, stability))


def _ships_estimate(
    model: HeadModel,
    prompts: str | Sequence[str],
    heads: list[Head],
    ablation: str,
    eps: float,
    exact: bool,
    kl_tokens: int,
    template: str | None,
    options: SweepOptions,
) -> ShipsResult:
    """The attribution estimate of Ships (KL metric) for the ablations Ships has (UA, SC)."""
    if ablation not in ("ua", "sc"):
        raise HeadsteerValueError(f"unknown ablation {short_repr(ablation)}: use 'ua' or 'sc'")
    return attribute(
        model,
        prompts,
        heads=heads,
        ablation=ablation,
        eps=eps,
        exact=exact,
        kl_tokens=kl_tokens,
        template=template,
        options=SweepOptions(
            max_rows=options.max_rows, max_memory=options.max_memory, progress=options.progress
        ),
    )


def confirm_ships(
    model: HeadModel,
    prompts: str | Sequence[str],
    *,
    confirm: int,
    controls: int | None = None,
    heads: HeadSpec | None = None,
    ablation: Literal["ua", "sc"] = "ua",
    eps: float = 1e-5,
    exact: bool = False,
    template: str | None = TEMPLATE,
    kl_tokens: int = 4,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> ShipsResult:
    """Ships by attribution, confirmed exactly: estimate every head, rerun the best exactly.

    Read `scores` (the confirmed ranking, exact) first; `estimate` is a ranking to confirm,
    not a result: on the embedded model the two strongest heads by exact Ships (4 harmful
    prompts) were 14th and 19th in the estimate, so `estimate.top(10)` misses them.

    Ranks `heads` (default all) by `attribute(..., metric="kl", kl_tokens=kl_tokens)`, then
    scores the top `confirm` heads plus `controls` heads (default None: 10, or every head left
    when fewer) drawn at random (`random.Random(options.seed)`) from the rest with the exact batched sweep
    `heads.scorers.safety.ships.ships`. `options` (`heads.SweepOptions`) gives `max_rows`,
    `progress` (of the exact sweep) and `seed`; no shard or executor. The 0.1 keywords
    (`max_rows=`, `progress=`, `seed=`) still work, with a `DeprecationWarning`.
    On the embedded model (16 prompts, UA) the exact top 10 was found in the estimate's top 30
    6 times in 10 with `kl_tokens=1` and 9 in 10 with `kl_tokens=4` (3 more backward passes);
    see benchmarks/attribution.py.

    Returns:
        ShipsResult: `per_prompt` `[N, L, H]` and `scores` (method `"ships"`) hold **exact**
        Ships for the confirmed and control heads and NaN elsewhere; `scores.params` lists
        `"confirmed"` and `"controls"` and has `"method": "attribution"`; `estimate` holds the
        attribution estimate of every head (method `"ships_attribution"`). With `confirm=0`
        nothing is rerun and `scores` is the estimate itself.

    Raises:
        HeadsteerValueError: `confirm` not an int in 0..number of heads, `controls` not an int
            in 0..the heads left after the confirmed ones, a non-int seed, and as `ships` /
            `attribute`.
    """
    takes = ("max_rows", "progress", "seed", "max_memory")
    opts = sweep_options(options, deprecated, "confirm_ships", takes=takes)
    chosen = check_heads(model, heads)
    check_int("confirm", confirm, lo=0, hi=len(chosen))
    control_count(controls, len(chosen) - confirm)
    return confirmed_ships(
        model, prompts, chosen, confirm, controls, ablation, eps, exact, template, kl_tokens, opts
    )


def confirmed_ships(
    model: HeadModel,
    prompts: str | Sequence[str],
    chosen: list[Head],
    confirm: int,
    controls: int | None,
    ablation: Literal["ua", "sc"],
    eps: float,
    exact: bool,
    template: str | None,
    kl_tokens: int,
    opts: SweepOptions,
) -> ShipsResult:
    """`confirm_ships` of checked values (a `ShipsRequest`'s: `run_ships` with `method="attribution"`)."""
    seed = opts.seed
    est = _ships_estimate(model, prompts, chosen, ablation, eps, exact, kl_tokens, template, opts)
    est.estimate = est.scores
    if confirm == 0:
        return est
    ranked = est.scores.ranked()
    top, rest = ranked[:confirm], ranked[confirm:]
    k = control_count(controls, len(chosen) - confirm)
    (control,) = random_head_draws(rest, min(k, len(rest)), 1, seed, generator="python")  # NaN dropped
    control = sorted(control)
    eps, exact_heads = check_scoring(model, eps, exact, top + control)
    res = exact_ships(model, prompts, exact_heads, ablation, eps, template, opts)
    params = dict(res.scores.params)
    params.update(
        method="attribution",
        confirmed=[list(h) for h in top],
        controls=[list(h) for h in control],
        seed=seed,
    )
    res.scores = HeadScores(res.scores.scores, "ships", params, model.name, model.n_kv_heads, seed)
    res.estimate = est.scores
    return res


def sahara_candidates(
    model: HeadModel,
    prompts: Sequence[str],
    k: int,
    *,
    heads: HeadSpec | None = None,
    ablation: Literal["ua", "sc"] = "ua",
    eps: float = 1e-5,
    exact: bool = False,
    kl_tokens: int = 4,
    template: str | None = TEMPLATE,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> list[Head]:
    """The `k` heads with the largest estimated Ships (KL), best first: the heads for Sahara to try.

    Sahara (`heads.scorers.safety.ships.sahara`) rescores every candidate head at every greedy step; passing
    `heads=sahara_candidates(model, prompts, k)` restricts each step to these `k`, which cuts
    its cost by `n_layers * n_heads / k`. The estimate is of per-prompt KL at the clean model,
    a proxy for Sahara's dataset-level angle: a head the estimate ranks below `k` is never
    tried, so choose `k` generously (e.g. 30-60) and check the chosen group exactly.

    Raises:
        ValueError: `k` not an int in 1..number of heads, and as `attribute`.
    """
    opts = sweep_options(options, deprecated, "sahara_candidates", takes=("max_rows", "max_memory"))
    chosen = check_heads(model, heads)
    check_int("k", k, lo=1, hi=len(chosen))
    est = _ships_estimate(model, prompts, chosen, ablation, eps, exact, kl_tokens, template, opts)
    return est.scores.ranked(k)
