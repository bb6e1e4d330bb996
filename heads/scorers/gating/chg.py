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

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from heads._util.files import write_text
from heads._util.progress import progress_callback
from heads._util.validation import check_int, check_number, check_seed, is_number, short_repr
from heads.engine.options import SweepOptions, sweep_options
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores, HeadSet, HeadSpec, _read_json
from heads.results.stability import check_stability
from heads.scorers.gating.gates import GateTask, HeadGate, gate_edits, gate_task, gated_nll
from heads.scorers.stability import attach, check_samples

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = [
    "LABELS",
    "GateTask",
    "GatingResult",
    "HeadGate",
    "gate_edits",
    "gate_heads",
    "gate_task",
    "gated_nll",
]

LABELS = ("facilitating", "interfering", "irrelevant", "ungated")
"""The head labels: the paper's three, and `"ungated"` for a head left out by `heads=`."""

SCHEMA = "headsteer/head-gating"
SCHEMA_VERSION = 1

MAX_STEPS = 100_000
"""Upper bound on `steps` / `reg_steps` (the paper trains 500 per stage)."""
MAX_MASKS = 64
"""Upper bound on `n_masks` (each gate set copies every batch row once)."""


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


@dataclass
class GatingResult:
    """The three CHG fits and the taxonomy. Gates are means over the M gate sets; NaN for heads
    left out by `heads=`.

    Attributes:
        gates: HeadScores `[L, H]` of the unregularised gates G (method `"chg"`).
        retain: HeadScores of G+ (`lam > 0`, method `"chg_retain"`).
        remove: HeadScores of G- (`lam < 0`, method `"chg_remove"`): the facilitation score.
        labels: `[L][H]` strings from `LABELS`.
        history: per stage (`"none"`, `"retain"`, `"remove"`), the training loss's NLL per update.
    """

    gates: HeadScores
    retain: HeadScores
    remove: HeadScores
    labels: list[list[str]]
    history: dict[str, list[float]] = field(default_factory=dict)

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    @property
    def scores(self) -> HeadScores:
        """G- (`remove`): high = the head is needed even under pressure to remove it."""
        return self.remove

    def head_scores(self, fit: str = "remove") -> HeadScores:
        """`[L, H]` gates of one fit: `"remove"` (default, G-: the facilitation score, as
        `scores`), `"retain"` (G+) or `"gates"` (G, unregularised).

        Raises:
            HeadsteerValueError: another fit name.
        """
        fits = {"remove": self.remove, "retain": self.retain, "gates": self.gates}
        if fit not in fits:
            raise HeadsteerValueError(f"unknown fit {short_repr(fit)}: use one of {', '.join(fits)}")
        return fits[fit]

    def heads(self, label: str) -> HeadSet:
        """The heads with `label` (one of `LABELS`)."""
        if label not in LABELS:
            raise HeadsteerValueError(f"unknown label {short_repr(label)}: use one of {', '.join(LABELS)}")
        return HeadSet((la, h) for la, row in enumerate(self.labels) for h, x in enumerate(row) if x == label)

    def counts(self) -> dict[str, int]:
        """How many heads carry each label."""
        flat = [x for row in self.labels for x in row]
        return {k: flat.count(k) for k in LABELS if k in flat}

    def to_frame(self) -> pd.DataFrame:
        """One row per head: `layer, head, kv_head, gate, retain, remove, label`."""
        df = self.gates.to_frame().rename(columns={"score": "gate"})
        df["retain"] = self.retain.scores.flatten().numpy()
        df["remove"] = self.remove.scores.flatten().numpy()
        df["label"] = [x for row in self.labels for x in row]
        return df

    def to_json(self) -> dict:
        def grid(s: HeadScores) -> list:
            return [[None if math.isnan(v) else v for v in row] for row in s.scores.tolist()]

        g = self.gates
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "model": g.model,
            "params": g.params,
            "seed": g.seed,
            "n_kv_heads": g.n_kv_heads,
            "gates": grid(g),
            "retain": grid(self.retain),
            "remove": grid(self.remove),
            "labels": self.labels,
            "history": self.history,
        }

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write JSON (schema `headsteer/head-gating`, version 1) atomically; returns the path.

        Raises:
            ValueError: `path` exists and `overwrite` is False, or is a symlink or a folder.
        """
        return write_text(
            path, json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n", overwrite=overwrite
        )

    @classmethod
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> GatingResult:
        """Read a file written by `save` (checked against `model`'s geometry when given).

        Raises:
            ValueError: not a head-gating file, another version, malformed grids or labels, or a
                geometry other than `model`'s. FileNotFoundError: no such file.
        """
        data = _read_json(path)
        name = str(path)
        try:
            return cls._from_data(data, name, model)
        except HeadsteerValueError:
            raise
        except (TypeError, ValueError, AttributeError, OverflowError) as e:  # a malformed field
            raise HeadsteerValueError(f"{short_repr(name)} is not a valid head-gating file: {e}") from None

    @classmethod
    def _from_data(cls, data: object, name: str, model: HeadModel | None) -> GatingResult:
        """`load`'s checks and construction on the parsed JSON `data` of file `name`."""
        if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
            raise HeadsteerValueError(f"{short_repr(name)} is not a headsteer head-gating file")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise HeadsteerValueError(
                f"{short_repr(name)} has schema_version {short_repr(data.get('schema_version'))}"
            )

        def grid(key: str, method: str) -> HeadScores:
            rows = data.get(key)
            if not isinstance(rows, list) or not rows or any(not isinstance(r, list) for r in rows):
                raise HeadsteerValueError(
                    f"{short_repr(name)}: {short_repr(key)} must be a list of equal rows"
                )
            if len({len(r) for r in rows}) != 1:
                raise HeadsteerValueError(
                    f"{short_repr(name)}: {short_repr(key)} must be a list of equal rows"
                )
            vals = [[math.nan if v is None else v for v in r] for r in rows]
            if any(not is_number(v) for r in vals for v in r):
                raise HeadsteerValueError(
                    f"{short_repr(name)}: {short_repr(key)} holds a value that is not a number"
                )
            return HeadScores(
                torch.tensor(vals, dtype=torch.float32),
                method=method,
                params=dict(data.get("params") or {}),
                model=str(data.get("model", "")),
                n_kv_heads=data.get("n_kv_heads"),
                seed=data.get("seed"),
            )

        g, r, m = grid("gates", "chg"), grid("retain", "chg_retain"), grid("remove", "chg_remove")
        labels = data.get("labels")
        shape = (g.n_layers, g.n_heads)
        if r.scores.shape != g.scores.shape or m.scores.shape != g.scores.shape:
            raise HeadsteerValueError(f"{short_repr(name)}: the three gate grids differ in shape")
        if (
            not isinstance(labels, list)
            or len(labels) != shape[0]
            or any(not isinstance(row, list) or len(row) != shape[1] for row in labels)
            or any(x not in LABELS for row in labels for x in row)
        ):
            raise HeadsteerValueError(f"{short_repr(name)}: labels must be an [L][H] grid of {LABELS}")
        if model is not None and (model.n_layers, model.n_heads, model.n_kv_heads) != (*shape, g.n_kv_heads):
            raise HeadsteerValueError(f"{short_repr(name)} was fitted on a model of another geometry")
        hist = data.get("history") or {}
        if not isinstance(hist, Mapping) or any(not isinstance(v, list) for v in hist.values()):
            raise HeadsteerValueError(f"{short_repr(name)}: history must be an object of lists")
        return cls(g, r, m, [list(row) for row in labels], {str(k): list(v) for k, v in hist.items()})

    def __repr__(self) -> str:
        g = self.gates
        return f"GatingResult({g.model!r}, [{g.n_layers}, {g.n_heads}], {self.counts()})"


# ------------------------------------------------------------------------------ training
def _batches(n: int, size: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """An endless stream of shuffled batches (a new permutation per pass; the last may be short)."""
    while True:
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, size):
            yield perm[i : i + size]


def _check_init(init: object) -> tuple[float, float]:
    if isinstance(init, (str, bytes)) or not isinstance(init, Sequence) or len(init) != 2:
        raise HeadsteerValueError(f"init must be a pair (low, high) in [0, 1], got {short_repr(init)}")
    lo = check_number("init low", init[0], lo=0.0, hi=1.0)
    hi = check_number("init high", init[1], lo=0.0, hi=1.0)
    if lo > hi:
        raise HeadsteerValueError(f"init must have low <= high, got {short_repr(init)}")
    return lo, hi


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
        options: `heads.SweepOptions`; only `progress` applies: a tqdm bar (default), False, or
            a `(done, total)` callable, per update.
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
    opts = sweep_options(options, deprecated, "gate_heads", takes=("progress",))
    if not isinstance(model, HeadModel):
        raise HeadsteerTypeError(f"gate_heads needs a HeadModel, got {type(model).__name__}")
    steps = check_int("steps", steps, lo=1)
    reg_steps = steps if reg_steps is None else check_int("reg_steps", reg_steps, lo=1)
    if max(steps, reg_steps) > MAX_STEPS:
        raise HeadsteerValueError(
            f"steps and reg_steps must be at most {MAX_STEPS}, got {max(steps, reg_steps)}"
        )
    lr = check_number("lr", lr, lo=0.0, lo_open=True, hi=1e6)
    reg_weight = check_number("reg_weight", reg_weight, lo=0.0)
    clamp = check_number("clamp", clamp, lo=0.0, lo_open=True)
    batch_size = check_int("batch_size", batch_size, lo=1)
    if grad_norm is not None:
        grad_norm = check_number("grad_norm", grad_norm, lo=0.0, lo_open=True)
    lo, hi = _check_init(init)
    n_masks = check_int("n_masks", n_masks, lo=1)
    if n_masks > MAX_MASKS:
        raise HeadsteerValueError(f"n_masks must be at most {MAX_MASKS}, got {n_masks}")
    stability = check_stability(stability)
    check_samples(n_masks, stability, "gate fits (n_masks)")
    threshold = check_number("threshold", threshold, lo=0.0, hi=1.0, lo_open=True, hi_open=True)
    seed = check_seed("seed", seed)
    if not isinstance(task, GateTask):
        raise HeadsteerTypeError(f"task must be a GateTask (see gate_task), got {type(task).__name__}")
    task.check(model)
    gated = torch.ones(model.n_layers, model.n_heads, dtype=torch.bool)
    if heads is not None:
        chosen = HeadSet.parse(heads, model.n_layers, model.n_heads)
        if not len(chosen):
            raise HeadsteerValueError("heads selects no head: nothing to gate")
        gated = torch.zeros_like(gated)
        for la, h in chosen:
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
