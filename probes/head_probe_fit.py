"""Per-head linear probes (scikit-learn): one classifier per head on `[N, L, H, d]` head
outputs, scored by stratified K-fold cross-validation, with the probe and mass-mean directions
ITI steers along (Li et al. 2023, arXiv:2306.03341, §3.1-3.2). `probes.head_probes` collects the
head outputs and fits ITI; its names are importable from there too."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from heads import HeadModel
from heads._util.progress import ProgressArg, progress_callback
from heads._util.validation import check_int, is_int, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.scores import HeadScores
from probes.metrics.tasks import wilson_interval

__all__ = ["ProbeResult", "fit_head_probes"]


# --------------------------------------------------------------------------- probes
_Z95 = 1.959963984540054
"""Two-sided 95% normal quantile (as `wilson_interval` takes it from scipy)."""


def _auc_interval(auc: float, n_pos: int, n_neg: int, z: float = _Z95) -> tuple[float, float]:
    """Hanley & McNeil (1982) normal interval for an ROC AUC, clipped to [0, 1]."""
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    var = (auc * (1 - auc) + (n_pos - 1) * (q1 - auc**2) + (n_neg - 1) * (q2 - auc**2)) / (n_pos * n_neg)
    half = z * math.sqrt(max(var, 0.0))
    return max(0.0, auc - half), min(1.0, auc + half)


def _unit(v: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 and math.isfinite(norm) else np.full_like(v, np.nan)


def _scores(est: Any, x: np.ndarray) -> np.ndarray:
    if hasattr(est, "decision_function"):
        s = est.decision_function(x)
    else:
        s = est.predict_proba(x)[:, 1]
    return np.asarray(s, dtype=np.float64).reshape(-1)


def _fit_heads(
    acts: np.ndarray,
    heads: Sequence[tuple[int, int]],
    y: np.ndarray,
    folds: Sequence[tuple[np.ndarray, np.ndarray]],
    estimator: Any,
    seed: int,
) -> list[dict]:
    """Fit the probes of `heads` (list of (layer, head)); one dict of results per head."""
    import warnings

    from sklearn.base import clone
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.metrics import roc_auc_score

    out = []
    pos, neg = y == 1, y == 0
    for layer, head in heads:
        x = np.asarray(acts[:, layer, head, :], dtype=np.float64)
        pred = np.empty(len(y), dtype=np.int64)
        score = np.empty(len(y), dtype=np.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            for train, test in folds:
                est = clone(estimator)
                if "random_state" in est.get_params():
                    est.set_params(random_state=seed)
                est.fit(x[train], y[train])
                pred[test] = est.predict(x[test])
                score[test] = _scores(est, x[test])
            full = clone(estimator)
            if "random_state" in full.get_params():
                full.set_params(random_state=seed)
            full.fit(x, y)
        coef = getattr(full, "coef_", None)
        probe = _unit(np.asarray(coef, dtype=np.float64).reshape(-1)) if coef is not None else None
        if probe is None or probe.shape != (x.shape[1],):
            probe = np.full(x.shape[1], np.nan)
        mm = _unit(x[pos].mean(0) - x[neg].mean(0))
        correct = int((pred == y).sum())
        auc = float(roc_auc_score(y, score))
        out.append(
            {
                "layer": layer,
                "head": head,
                "correct": correct,
                "auc": auc,
                "probe": probe,
                "mass_mean": mm,
                "probe_sigma": float(np.std(x @ probe)) if np.isfinite(probe).all() else float("nan"),
                "mass_mean_sigma": float(np.std(x @ mm)) if np.isfinite(mm).all() else float("nan"),
            }
        )
    return out


@dataclass
class ProbeResult:
    """Per-head probe results of `fit_head_probes`.

    Attributes:
        accuracy: `HeadScores` of pooled held-out accuracy (method "probe_accuracy").
        auc: `HeadScores` of pooled held-out ROC AUC (method "probe_auc").
        accuracy_low: `[L, H]` lower end of the 95% Wilson interval of the accuracy.
        accuracy_high: `[L, H]` its upper end.
        auc_low: `[L, H]` lower end of the 95% Hanley-McNeil interval of the AUC.
        auc_high: `[L, H]` its upper end.
        probe_directions: `[L, H, d]` unit normal of each head's probe (fit on all rows),
            pointing to label 1; NaN for an estimator without `coef_`.
        mass_mean_directions: `[L, H, d]` unit vector mean(label 1) - mean(label 0).
        probe_sigma: `[L, H]` std of the activations projected on the probe direction (the sigma
            of ITI's shift alpha * sigma * direction).
        mass_mean_sigma: `[L, H]` the same on the mass-mean direction.
        n: rows.
        n_positive: rows with label 1.
    """

    accuracy: HeadScores
    auc: HeadScores
    accuracy_low: torch.Tensor
    accuracy_high: torch.Tensor
    auc_low: torch.Tensor
    auc_high: torch.Tensor
    probe_directions: torch.Tensor
    mass_mean_directions: torch.Tensor
    probe_sigma: torch.Tensor
    mass_mean_sigma: torch.Tensor
    n: int
    n_positive: int

    def ranked(self, k: int | None = None, by: str = "accuracy") -> list[tuple[int, int]]:
        """Heads `(layer, head)` by descending held-out `by` ("accuracy" or "auc")."""
        if by not in ("accuracy", "auc"):
            raise HeadsteerValueError(f"by must be 'accuracy' or 'auc', got {short_repr(by)}")
        scores: HeadScores = getattr(self, by)
        return scores.ranked(k)

    def to_frame(self):
        """One row per head: `layer, head, accuracy, accuracy_low, accuracy_high, auc, auc_low,
        auc_high`, sorted by descending accuracy."""
        frame = self.accuracy.to_frame().rename(columns={"score": "accuracy"})
        frame["accuracy_low"] = self.accuracy_low.flatten().numpy()
        frame["accuracy_high"] = self.accuracy_high.flatten().numpy()
        frame["auc"] = self.auc.scores.flatten().numpy()
        frame["auc_low"] = self.auc_low.flatten().numpy()
        frame["auc_high"] = self.auc_high.flatten().numpy()
        return frame.sort_values(["accuracy", "layer", "head"], ascending=[False, True, True]).reset_index(
            drop=True
        )


def _as_array(acts: object) -> np.ndarray:
    if isinstance(acts, torch.Tensor):
        return acts.detach().cpu().float().numpy()
    if isinstance(acts, np.ndarray):
        return acts
    raise HeadsteerValueError(
        f"acts must be a torch tensor or numpy array [N, L, H, d], got {type(acts).__name__}"
    )


def fit_head_probes(
    acts: torch.Tensor | np.ndarray,
    labels: Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor,
    *,
    cv: int = 5,
    seed: int = 0,
    estimator: Any = None,
    n_jobs: int | None = 1,
    groups: Sequence[int] | np.ndarray | None = None,
    model: HeadModel | str = "",
    n_kv_heads: int | None = None,
    progress: ProgressArg = True,
) -> ProbeResult:
    """Fit one binary classifier per head and score it by stratified K-fold cross-validation.

    Args:
        acts: `[N, L, H, d]` activations (tensor, numpy array or memmap; read per head).
        labels: `[N]` binary labels: 0/1 ints or bools; both classes need at least `cv` rows.
        cv: folds (default 5; `StratifiedKFold(shuffle=True, random_state=seed)`, or
            `StratifiedGroupKFold` when `groups` is given). Every head uses the same folds.
        seed: fold shuffling and the estimator's `random_state` (if it has one). Default 0.
        estimator: any scikit-learn classifier (cloned per fit); default
            `LogisticRegression(max_iter=1000)`. The probe direction is its `coef_`.
        n_jobs: joblib workers over heads (default 1; -1 = all cores). Results do not depend on it.
        groups: `[N]` group ids kept on one side of every fold (e.g. the two answers of one prompt).
        model, n_kv_heads: metadata for the returned `HeadScores`: the `HeadModel` the
            activations came from (its name and KV heads are taken; GQA `kv_head` column), or
            a model id with `n_kv_heads` (default None: one KV head per query head).
        progress: True (default: a tqdm bar), False / None (off) or `progress(done, total)`
            (`heads._util.progress`) in heads fitted: `total` is L * H, reported as chunks of heads
            finish (a layer's heads at a time with one worker).

    Returns:
        ProbeResult. Accuracy is pooled over the held-out predictions of all folds (each row
        predicted once, by the fold model that did not see it), with a 95% Wilson interval over
        N; AUC is computed on the pooled held-out decision scores, with a 95% Hanley-McNeil
        interval. Directions come from a fit on all N rows.

    Raises:
        ValueError: acts not 4-D, labels not of length N or not binary 0/1, a class with fewer
            than `cv` rows, `cv` < 2, non-finite activations, or bad `groups`.

    Source: ITI (Li et al. 2023) §3.1 (probe per head, held-out accuracy, top-k heads) and §3.2
    (probe weight vs mass-mean direction, sigma along the direction).
    """
    from joblib import Parallel, delayed
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedGroupKFold, StratifiedKFold

    x = _as_array(acts)
    if x.ndim != 4:
        raise HeadsteerValueError(f"acts must be [N, L, H, d], got shape {tuple(x.shape)}")
    n, n_layers, n_heads, _ = x.shape
    if isinstance(model, HeadModel):
        if (n_layers, n_heads) != (model.n_layers, model.n_heads):
            raise HeadsteerValueError(
                f"acts have [L, H] = [{n_layers}, {n_heads}], the model {model.name} "
                f"[{model.n_layers}, {model.n_heads}]"
            )
        if n_kv_heads is not None and n_kv_heads != model.n_kv_heads:
            raise HeadsteerValueError(
                f"n_kv_heads={n_kv_heads} but the model has {model.n_kv_heads} KV heads"
            )
    elif not isinstance(model, str):
        raise HeadsteerTypeError(
            f"model must be a HeadModel or a model id string, got {type(model).__name__}"
        )
    y = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels)
    if y.shape != (n,):
        raise HeadsteerValueError(f"labels must have shape ({n},) to match acts, got {y.shape}")
    if y.dtype == bool:
        y = y.astype(np.int64)
    bad = sorted({v for v in y.tolist() if v not in (0, 1)}, key=repr)
    if bad:
        raise HeadsteerValueError(f"labels must be binary 0/1, got value {short_repr(bad[0])}")
    y = y.astype(np.int64)
    check_int("cv", cv, lo=2)
    counts = np.bincount(y, minlength=2)
    if counts.min() < cv:
        raise HeadsteerValueError(
            f"each class needs at least cv={cv} rows, got {counts[0]} of 0 and {counts[1]} of 1"
        )
    if not is_int(seed):
        raise HeadsteerValueError(f"seed must be an int, got {short_repr(seed)}")
    for a in range(0, n, 256):
        chunk = np.asarray(x[a : a + 256])
        if not np.isfinite(chunk).all():
            raise HeadsteerValueError(
                f"acts hold NaN or inf (first bad row {a + int(np.argwhere(~np.isfinite(chunk))[0][0])})"
            )
    if estimator is None:
        estimator = LogisticRegression(max_iter=1000)
    elif not (hasattr(estimator, "fit") and hasattr(estimator, "get_params")):
        raise HeadsteerValueError(f"estimator must be a scikit-learn classifier, got {short_repr(estimator)}")
    if groups is not None:
        groups = np.asarray(groups)
        if groups.shape != (n,):
            raise HeadsteerValueError(f"groups must have shape ({n},), got {groups.shape}")
        splitter = StratifiedGroupKFold(n_splits=int(cv), shuffle=True, random_state=int(seed))
        folds = list(splitter.split(np.zeros(n), y, groups))
    else:
        splitter = StratifiedKFold(n_splits=int(cv), shuffle=True, random_state=int(seed))
        folds = list(splitter.split(np.zeros(n), y))
    pairs = [(la, h) for la in range(n_layers) for h in range(n_heads)]
    workers = 1 if n_jobs is None else int(n_jobs)
    chunks = (
        [pairs[i :: max(1, abs(workers)) * 4] for i in range(max(1, abs(workers)) * 4)]
        if workers != 1
        else [pairs[i : i + n_heads] for i in range(0, len(pairs), n_heads)]  # a layer at a time
    )
    parts = []
    # one BLAS thread per fit: these small fits gain nothing from more, and on a busy machine
    # several spinning BLAS threads made them 7x slower (scikit-learn brings threadpoolctl)
    from threadpoolctl import threadpool_limits

    with progress_callback(progress, "head probes", "heads") as report, threadpool_limits(limits=1):
        done = 0
        for part in Parallel(n_jobs=workers, return_as="generator_unordered")(
            delayed(_fit_heads)(x, c, y, folds, estimator, int(seed)) for c in chunks if c
        ):
            parts.append(part)
            done += len(part)
            if report is not None:
                report(done, len(pairs))
    rows = sorted((r for p in parts for r in p), key=lambda r: (r["layer"], r["head"]))
    n_pos, n_neg = int(counts[1]), int(counts[0])

    def grid(key):
        return torch.tensor([r[key] for r in rows], dtype=torch.float32).reshape(n_layers, n_heads)

    acc = torch.tensor([r["correct"] / n for r in rows], dtype=torch.float32).reshape(n_layers, n_heads)
    acc_iv = torch.tensor([wilson_interval(r["correct"], n) for r in rows], dtype=torch.float32)
    auc = grid("auc")
    auc_iv = torch.tensor([_auc_interval(r["auc"], n_pos, n_neg) for r in rows], dtype=torch.float32)
    params = {
        "cv": int(cv),
        "n": n,
        "n_positive": n_pos,
        "estimator": repr(estimator),
        "groups": groups is not None,
    }
    if isinstance(model, HeadModel):
        n_kv_heads = model.n_kv_heads if n_kv_heads is None else n_kv_heads
        model = model.name
    meta: dict[str, Any] = dict(params=params, model=model, n_kv_heads=n_kv_heads, seed=int(seed))
    d = x.shape[3]
    return ProbeResult(
        accuracy=HeadScores(acc, "probe_accuracy", **meta),
        auc=HeadScores(auc, "probe_auc", **meta),
        accuracy_low=acc_iv[:, 0].reshape(n_layers, n_heads),
        accuracy_high=acc_iv[:, 1].reshape(n_layers, n_heads),
        auc_low=auc_iv[:, 0].reshape(n_layers, n_heads),
        auc_high=auc_iv[:, 1].reshape(n_layers, n_heads),
        probe_directions=torch.tensor(np.stack([r["probe"] for r in rows]), dtype=torch.float32).reshape(
            n_layers, n_heads, d
        ),
        mass_mean_directions=torch.tensor(
            np.stack([r["mass_mean"] for r in rows]), dtype=torch.float32
        ).reshape(n_layers, n_heads, d),
        probe_sigma=grid("probe_sigma"),
        mass_mean_sigma=grid("mass_mean_sigma"),
        n=n,
        n_positive=n_pos,
    )
