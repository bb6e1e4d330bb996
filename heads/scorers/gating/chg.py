"""Causal Head Gating, CHG (Nam, Conklin, Yang, Griffiths, Cohen and Leslie, "Causal Head Gating: A
Framework for Interpreting Roles of Attention Heads in Transformers", NeurIPS 2025, arXiv:2505.13737;
public code `jonhanke/nam_causal-head-gating`; docs/methods/head_gating.md).

Gates. One logit `a[l, h]` per query head (L layers, H query heads; under GQA a gate is per query
head, the shared K/V are never touched); the gate `g = sigmoid(a)` scales the head's output
`z[l, h]` (its `[d]` slice of the `o_proj` input) at every position, through the engine's
`head_output` site (`HeadGate`). The model's weights stay frozen; only `a` is trained.

Objective (paper Eq. 2, with the code's means):

    loss(a) = mean_{n in batch} NLL_n(a) - lam * mean_{l,h} clamp(a[l, h], -c, c)       (scalar)

where `NLL_n` is the mean negative log-likelihood of row n's target tokens (the `loss_mask`
positions, each predicted from the position before it) under the gated model, `lam` the
regularisation weight (default 0.1) and `c` the logit clamp (default 4, the paper's "clipped
inverse sigmoid"). Three fits with Adam (lr 1.0, gradient norm clipped to 1.0, batches of 32):

1. `lam = 0` from `a = logit(u)`, `u ~ U(0, 1)` per head (`steps` updates): the plain gates G;
2. `lam = +reg_weight` from G's logits (`reg_steps` updates): G+, pushed towards 1 (retain);
3. `lam = -reg_weight` from G's logits (`reg_steps` updates): G-, pushed towards 0 (remove).

Taxonomy (paper Sec. 3, threshold 0.5): a head is *interfering* when G+ < 0.5 (removed although
the regulariser asks to keep it), *facilitating* when G- >= 0.5 (kept although the regulariser
asks to remove it), and *irrelevant* otherwise (its gate follows the regulariser).

The gate edit and the task (`HeadGate`, `gate_edits`, `GateTask`, `gate_task`, `gated_nll`) live
in `heads.scorers.gating.gates` and are re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from heads._util.progress import progress_callback
from heads.engine.options import SweepOptions, sweep_options
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.results.gating import LABELS as LABELS
from heads.results.gating import SCHEMA as SCHEMA
from heads.results.gating import SCHEMA_VERSION as SCHEMA_VERSION
from heads.results.gating import GatingResult as GatingResult  # defined there; imported here as before
from heads.results.scores import HeadScores, HeadSet, HeadSpec
from heads.scorers.gating.gates import GateTask, HeadGate, gate_edits, gate_task, gated_nll
from heads.scorers.gating.request import MAX_MASKS as MAX_MASKS
from heads.scorers.gating.request import MAX_STEPS as MAX_STEPS
from heads.scorers.gating.request import GatingRequest
from heads.scorers.stability import attach

if TYPE_CHECKING:  # pragma: no cover
    pass

__all__ = [
    "LABELS",
    "GateTask",
    "GatingResult",
    "HeadGate",
    "gate_edits",
    "gate_heads",
    "gate_task",
    "gated_nll",
    "run_gating",
]


# ------------------------------------------------------------------------------ results
def _labels(retain: torch.Tensor, remove: torch.Tensor, gated: torch.Tensor, t: float) -> list[list[str]]:
    out = []
    for la in range(retain.shape[0]):
        row = []
        for h in range(retain.shape[1]):
            if not bool(gated[la, h]):
                row.append("ungated")
            elif float(retain[la, h]) < t:
                row.append("interfering")
            elif float(remove[la, h]) >= t:
                row.append("facilitating")
            else:
                row.append("irrelevant")
        out.append(row)
    return out


# ------------------------------------------------------------------------------ training
def _batches(n: int, size: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """An endless stream of shuffled batches (a new permutation per pass; the last may be short)."""
    while True:
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, size):
            yield perm[i : i + size]


def gate_heads(
    model: HeadModel,
    task: GateTask,
    *,
    steps: int = 500,
    reg_steps: int | None = None,
    lr: float = 1.0,
    reg_weight: float = 0.1,
    clamp: float = 4.0,
    batch_size: int = 32,
    grad_norm: float | None = 1.0,
    init: tuple[float, float] = (0.0, 1.0),
    n_masks: int = 1,
    heads: HeadSpec | None = None,
    threshold: float = 0.5,
    seed: int = 0,
    stability: int = 0,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> GatingResult:
    """Fit CHG gates on `task` with the model frozen (module docstring) and label every head.

    Args:
        model: the model (in eval mode; its weights are only read).
        task: the rows and their target tokens (`gate_task(model, prompts, targets)`).
        steps: Adam updates of the unregularised fit (default 500, the reference's).
        reg_steps: updates of each regularised fit (default: `steps`; the reference's 500).
        lr: Adam learning rate of all three fits (default 1.0, the reference's).
        reg_weight: lam, the regularisation weight (default 0.1).
        clamp: c, the logit clamp of the regulariser (default 4.0).
        batch_size: rows per update (default 32; fewer rows than that: all of them).
        grad_norm: gradient-norm clip (default 1.0; None: none).
        init: the uniform range of the initial gates (default (0, 1)).
        n_masks: gate sets fitted at once from different random inits (default 1, the trainer's;
            the reference's high-level API uses 10); results are their mean.
        heads: the heads that get a gate (a `HeadSpec`; default all); the others stay at 1.
        threshold: the taxonomy threshold (default 0.5).
        seed: seeds the initial gates and the batch order (default 0).
        stability: bootstrap resamples of the `n_masks` gate fits (default 0: none; needs
            n_masks >= 2) for each ranking's stability (`result.gates.stability`, `.retain`,
            `.remove`: over the fits' gates, no extra training).
        options: `heads.SweepOptions`; `progress`: a tqdm bar (default), False, or a
            `(done, total)` callable, per update; `max_memory`: refused before any forward when
            one step's gradient forward (`batch_size` x `n_masks` rows, not split: the method's
            minibatch) plans above it.
        **deprecated: `progress=` as a keyword (one release; a `DeprecationWarning`).

    Returns:
        GatingResult (G, G+, G-, labels, NLL history).

    Raises:
        ValueError: a bad number (steps / reg_steps / batch_size / n_masks < 1, lr / clamp /
            grad_norm <= 0, reg_weight < 0, init outside [0, 1], threshold outside (0, 1)), an
            unknown or empty head selection, a bad task, a model in training mode. All checked
            before any forward pass; the model is left exactly as it was.

    Source: arXiv:2505.13737 Sec. 3 (Eq. 2, the taxonomy); reference `core/trainer.py`
    (`CHGTrainer`: defaults, the clamped-logit regulariser, the three stages).
    """
    opts = sweep_options(options, deprecated, "gate_heads", takes=("progress", "max_memory"))
    if not isinstance(model, HeadModel):
        raise HeadsteerTypeError(f"gate_heads needs a HeadModel, got {type(model).__name__}")
    if heads is not None:  # any HeadSpec (a list of layers needs the model's head count)
        heads = HeadSet.parse(heads, model.n_layers, model.n_heads).heads
    request = GatingRequest(
        steps=steps,
        reg_steps=reg_steps,
        lr=lr,
        reg_weight=reg_weight,
        clamp=clamp,
        batch_size=batch_size,
        grad_norm=grad_norm,
        init=init,
        n_masks=n_masks,
        heads=heads,
        threshold=threshold,
        seed=seed,
        stability=stability,
    )
    return run_gating(model, task, request, opts)


def run_gating(
    model: HeadModel, task: GateTask, request: GatingRequest, options: SweepOptions | None = None
) -> GatingResult:
    """Run a `GatingRequest` on `task` (see `gate_heads` for the method and the errors).

    Raises:
        HeadsteerTypeError: not a `HeadModel`, a `GatingRequest` or a `GateTask`.
        HeadsteerValueError: heads outside the model, a bad task, a model in training mode —
            before any forward; the model is left exactly as it was.
    """
    if not isinstance(model, HeadModel):
        raise HeadsteerTypeError(f"gate_heads needs a HeadModel, got {type(model).__name__}")
    if not isinstance(request, GatingRequest):
        raise HeadsteerTypeError(f"request must be a GatingRequest, got {type(request).__name__}")
    opts = sweep_options(options, {}, "gate_heads", takes=("progress", "max_memory"))
    request.check_config(model)
    r = request
    steps, lr, reg_weight, clamp, grad_norm = r.steps, r.lr, r.reg_weight, r.clamp, r.grad_norm
    reg_steps = steps if r.reg_steps is None else r.reg_steps
    batch_size, (lo, hi), n_masks, threshold = r.batch_size, r.init, r.n_masks, r.threshold
    seed, stability = r.seed, r.stability
    if not isinstance(task, GateTask):
        raise HeadsteerTypeError(f"task must be a GateTask (see gate_task), got {type(task).__name__}")
    task.check(model)
    # max_memory: a step's batch (rows x gate sets, one gradient forward) is the method's own
    # minibatch, not split; a budget below its plan is refused before any forward
    opts.check_run(model, task.input_ids.shape[1], "gradient", min(batch_size, len(task)) * n_masks)
    gated = torch.ones(model.n_layers, model.n_heads, dtype=torch.bool)
    if r.heads is not None:
        gated = torch.zeros_like(gated)
        for la, h in r.heads:
            gated[la, h] = True
    if model.model.training:
        raise HeadsteerValueError(
            "the model is in training mode (dropout would vary the gated loss); call .eval()"
        )

    dev = model.device
    gen = torch.Generator().manual_seed(seed)
    u = lo + (hi - lo) * torch.rand(n_masks, model.n_layers, model.n_heads, generator=gen)
    u = u.clamp(1e-6, 1 - 1e-6)
    start = torch.log(u / (1 - u))
    on = gated.to(dev)
    batches = _batches(len(task), batch_size, gen)
    history: dict[str, list[float]] = {}
    total = steps + 2 * reg_steps

    def fit(stage: str, logits0: torch.Tensor, lam: float, n: int, done: int, report: Any) -> torch.Tensor:
        a = logits0.clone().to(dev).requires_grad_(True)
        opt = torch.optim.Adam([a], lr=lr)
        losses = history.setdefault(stage, [])
        for i in range(n):
            rows = task.rows(next(batches))
            g = torch.where(on, torch.sigmoid(a), torch.ones((), device=dev))
            nll = gated_nll(model, rows, g).mean()
            loss = nll
            if lam != 0:
                loss = loss - lam * a.clamp(-clamp, clamp)[:, on].mean()
            (grad,) = torch.autograd.grad(loss, [a])
            grad = torch.where(on, grad, 0.0)
            if grad_norm is not None:  # torch.nn.utils.clip_grad_norm_ on the one tensor
                coef = grad_norm / (float(grad.norm()) + 1e-6)
                if coef < 1:
                    grad = grad * coef
            a.grad = grad
            opt.step()
            a.grad = None
            losses.append(float(nll.detach()))
            if report is not None:
                report(done + i + 1, total)
        return a.detach().cpu()

    with progress_callback(opts.progress, "chg", "updates") as report:
        a0 = fit("none", start, 0.0, steps, 0, report)
        a_pos = fit("retain", a0, reg_weight, reg_steps, steps, report)
        a_neg = fit("remove", a0, -reg_weight, reg_steps, steps + reg_steps, report)

    def mean_gate(a: torch.Tensor) -> torch.Tensor:
        return torch.where(gated, torch.sigmoid(a).mean(0), torch.tensor(math.nan))

    params: dict[str, Any] = {
        "steps": steps,
        "reg_steps": reg_steps,
        "lr": lr,
        "reg_weight": reg_weight,
        "clamp": clamp,
        "batch_size": batch_size,
        "grad_norm": grad_norm,
        "init": [lo, hi],
        "n_masks": n_masks,
        "threshold": threshold,
        "n_rows": len(task),
        "n_gated": int(gated.sum()),
    }

    def scores(a: torch.Tensor, method: str) -> HeadScores:
        out = HeadScores(
            mean_gate(a),
            method=method,
            params=params,
            model=model.name,
            n_kv_heads=model.n_kv_heads,
            seed=seed,
        )
        per_fit = torch.where(gated, torch.sigmoid(a), torch.tensor(math.nan))  # [M, L, H]
        return attach(out, per_fit, stability)

    g, gp, gm = scores(a0, "chg"), scores(a_pos, "chg_retain"), scores(a_neg, "chg_remove")
    return GatingResult(g, gp, gm, _labels(gp.scores, gm.scores, gated, threshold), history)
