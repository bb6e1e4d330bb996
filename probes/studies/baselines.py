"""Prompting baselines: a steering method against simply asking, on the same split and metric.

`evaluate_baselines(model, task, method)` runs four conditions on the same examples
(`probes.studies.evaluate.evaluate`):

* `none`: the task prompt, unsteered;
* `prompt`: the prompt with the task's instruction asking for the steered behaviour
  (`probes.datasets.instructions`);
* `method`: the method on the plain prompt;
* `prompt + method`: the method on the instructed prompt.

`baseline_table` turns the per-example results into the report: per metric and condition the
value and a 95 % percentile bootstrap interval over examples (B = 1000 resamples, seeded; the
same resamples for every condition, so differences are paired), and for `method` and
`prompt + method` the paired difference to `prompt` with its interval. `beats_prompt` is True
only when that interval lies above 0: a method "does not beat the prompt" otherwise.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from heads._util.progress import ProgressArg
from heads._util.validation import check_int, check_seed, short_repr
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel

__all__ = ["CONDITIONS", "BaselineResult", "baseline_table", "bootstrap_interval", "evaluate_baselines"]

CONDITIONS = ("none", "prompt", "method", "prompt + method")
N_BOOT = 1000


def _metric_columns(task: str) -> list[tuple[str, str]]:
    """`(metric name, per-example column)` of `task`."""
    from probes.studies.evaluate import _METRICS

    return [(name, "correct" if kind == "correct" else name) for name, kind in _METRICS[task]]


def _resamples(n: int, n_boot: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def bootstrap_interval(values: np.ndarray, n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float]:
    """95 % percentile bootstrap interval of the mean of `values` `[n]` over `n_boot` resamples.

    Raises:
        ValueError: fewer than 1 value, a bad n_boot or seed.
    """
    v = np.asarray(values, dtype=float)
    if v.ndim != 1 or len(v) < 1:
        raise HeadsteerValueError(f"values must be a non-empty 1-d array, got shape {v.shape}")
    check_int("n_boot", n_boot, lo=10)
    means = v[_resamples(len(v), n_boot, check_seed("seed", seed))].mean(1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return float(lo), float(hi)


def baseline_table(
    task: str,
    method: str,
    examples: dict[str, pd.DataFrame],
    *,
    n_boot: int = N_BOOT,
    seed: int = 0,
) -> pd.DataFrame:
    """The baselines report from per-example results.

    Args:
        task: the task (its metrics, `probes.studies.evaluate`).
        method: the method's name (for the rows).
        examples: condition (`CONDITIONS`) -> the per-example frame of `EvalResult.examples`
            (the same example ids in the same order in every frame; `method` and `prompt +
            method` may be missing).
        n_boot: bootstrap resamples (>= 10, default 1000); seed: their seed.

    Returns:
        one row per (metric, condition): `task, method, condition, metric, value, n, low, high,
        diff, diff_low, diff_high, beats_prompt` (the diff columns: condition - prompt, paired,
        NaN / None for none and prompt).

    Raises:
        ValueError: no `none` or `prompt` condition, an unknown condition, frames whose example
            ids differ.
    """
    bad = [c for c in examples if c not in CONDITIONS]
    if bad:
        raise HeadsteerValueError(f"unknown condition {short_repr(bad[0])}: use {CONDITIONS}")
    for need in ("none", "prompt"):
        if need not in examples:
            raise HeadsteerValueError(f"the baselines need the {need!r} condition")
    ids = list(examples["none"]["id"])
    for c, f in examples.items():
        if list(f["id"]) != ids:
            raise HeadsteerValueError(f"condition {c!r} has other examples than 'none'")
    idx = _resamples(len(ids), check_int("n_boot", n_boot, lo=10), check_seed("seed", seed))
    rows = []
    for metric, col in _metric_columns(task):
        ref = examples["prompt"][col].astype(float).to_numpy()
        for cond in CONDITIONS:
            if cond not in examples:
                continue
            v = examples[cond][col].astype(float).to_numpy()
            lo, hi = np.quantile(v[idx].mean(1), [0.025, 0.975])
            row = {
                "task": task,
                "method": method,
                "condition": cond,
                "metric": metric,
                "value": float(v.mean()),
                "n": len(v),
                "low": float(lo),
                "high": float(hi),
                "diff": np.nan,
                "diff_low": np.nan,
                "diff_high": np.nan,
                "beats_prompt": None,
            }
            if cond in ("method", "prompt + method"):
                d = v - ref
                dlo, dhi = np.quantile(d[idx].mean(1), [0.025, 0.975])
                row.update(
                    diff=float(d.mean()),
                    diff_low=float(dlo),
                    diff_high=float(dhi),
                    beats_prompt=bool(dlo > 0),
                )
            rows.append(row)
    return pd.DataFrame(rows)


@dataclass
class BaselineResult:
    """`table`: `baseline_table`'s rows; `examples`: the per-example rows with a `condition` column."""

    table: pd.DataFrame
    examples: pd.DataFrame

    def __repr__(self) -> str:
        t = self.table
        if t.empty:
            return "BaselineResult(no rows)"
        parts = [
            f"{r.metric} {r.condition} {r.value:.2f} [{r.low:.2f}, {r.high:.2f}]"
            + ("" if r.beats_prompt is None else (" > prompt" if r.beats_prompt else " (not above prompt)"))
            for r in t.itertuples()
        ]
        return f"BaselineResult({t.task.iloc[0]} / {t.method.iloc[0]}, n={t.n.iloc[0]}: {'; '.join(parts)})"

    def _repr_html_(self) -> str:
        table = self.table.to_html(index=False, float_format="%.3f")
        return f"<div><b>{html.escape(repr(self))}</b>{table}</div>"


_SHARED = ("batch_size", "max_new_tokens")


def _offset(progress: ProgressArg, k: int) -> ProgressArg:
    """Run k of 4 reports `(k * total + done, 4 * total)` to a callable `progress`."""
    if not callable(progress) or isinstance(progress, bool):
        return progress
    report = progress
    return lambda done, total: report(k * total + done, 4 * total)


def evaluate_baselines(
    model: HeadModel,
    task: str,
    method: str,
    *,
    split: str = "test",
    limit: int | None = None,
    n_boot: int = N_BOOT,
    seed: int = 0,
    progress: ProgressArg = True,
    **options: Any,
) -> BaselineResult:
    """none / prompt / method / prompt + method of `method` on `task` (module docstring).

    Args:
        method: any method of `probes.studies.evaluate.METHODS` but `"none"`.
        split, limit: as `evaluate`; n_boot, seed: the bootstrap (`baseline_table`).
        **options: passed to every `evaluate` call (`batch_size`, `max_new_tokens`, the method's
            options). A fitted CAA vector or ITI probes are fitted once and reused.

    Raises:
        ValueError: `method` "none" or unknown, and everything `evaluate` refuses (checked by the
            first `evaluate` call, before its forward passes).
    """
    from probes.studies.evaluate import METHODS, evaluate, fit_caa

    if method == "none" or method not in METHODS:
        raise HeadsteerValueError(
            f"method must be one of {', '.join(m for m in METHODS if m != 'none')}, got {short_repr(method)}"
        )
    check_int("n_boot", n_boot, lo=10)
    check_seed("seed", seed)
    if method == "caa" and options.get("caa") is None:  # one vector for both runs
        kw = {k[4:]: options.pop(k) for k in ("caa_layer", "caa_coefficient") if k in options}
        if kw.get("coefficient") is None:
            kw.pop("coefficient", None)
        options["caa"] = fit_caa(model, task, **kw)
    if method == "iti" and options.get("iti") is None:
        from probes.head_probes import fit_iti

        kw = {k[4:]: options.pop(k) for k in ("iti_k", "iti_alpha", "iti_direction") if k in options}
        options["iti"] = fit_iti(model, task, batch_size=options.get("batch_size", 16), **kw)
    runs = {
        "method": (method, False),
        "none": ("none", False),
        "prompt": ("none", True),
        "prompt + method": (method, True),
    }
    frames = {}
    for k, (cond, (m, prompt)) in enumerate(runs.items()):
        opts = options if m != "none" else {o: v for o, v in options.items() if o in _SHARED}
        res = evaluate(
            model, task, m, split=split, limit=limit, progress=_offset(progress, k), prompt=prompt, **opts
        )
        frames[cond] = res.examples
    table = baseline_table(task, method, frames, n_boot=n_boot, seed=seed)
    examples = pd.concat([f.assign(condition=c) for c, f in frames.items()], ignore_index=True)
    return BaselineResult(table, examples)
