"""Comparisons across the checkpoints of a `CheckpointSeries` (Tigges et al. 2024).

* **Emergence** of a quantity (a scalar such as the ICL score, the score of one head, or the
  best head's score of a metric): the first checkpoint at which it passes a threshold *and stays
  past it* for the rest of the run. The answer is a window `(previous checkpoint, checkpoint]`:
  the quantity crossed somewhere in between. The threshold is a number, or `"midpoint"`: half-way
  from the first checkpoint's value to the last one's (a jump's middle, for quantities without a
  natural scale such as a loss). Default thresholds: role scores 0.5 (`heads.scorers.roles.atlas`'
  `ROLE_THRESHOLDS`).
* **Role timelines**: per role metric and step, the heads at or above its threshold and the top
  head.
* **Function persistence**: a role that stays while the head holding it changes. A *hand-over*
  is a pair of consecutive checkpoints where the role is held at both (top score >= threshold)
  by different top heads.
* **Overlap** of two sets of scored items (circuit edges, or heads): Jaccard of the top-k sets,
  and the weighted overlap `sum_e min(|s_a(e)|, |s_b(e)|) / sum_e max(|s_a(e)|, |s_b(e)|)` over
  the union (a missing item scores 0), between consecutive checkpoints and against the final one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import pandas as pd

from heads._util.validation import check_int, check_number, is_number, short_repr
from heads.errors import HeadsteerValueError
from heads.results.dynamics import CheckpointSeries

__all__ = [
    "Emergence",
    "component_emergence",
    "edge_overlap",
    "emergence",
    "head_overlap",
    "overlap",
    "persistence",
    "quantity",
    "role_timelines",
]

Threshold = float | Literal["midpoint"]


@dataclass(frozen=True)
class Emergence:
    """When a quantity appears.

    Attributes:
        metric: what was measured (with the head or reduction).
        step: the first checkpoint step from which the quantity stays past the threshold; None if
            it never does by the last checkpoint.
        window: `(previous step, step)`: it crossed in between (previous None: already at the
            first checkpoint).
        threshold: the threshold used (a `"midpoint"` resolved to its number).
        direction: `"above"` (>=) or `"below"` (<=).
        values: the quantity per step.
    """

    metric: str
    step: int | None
    window: tuple[int | None, int | None]
    threshold: float
    direction: str
    values: pd.Series

    def to_dict(self) -> dict:
        """JSON-ready summary (no values)."""
        return {
            "metric": self.metric,
            "step": self.step,
            "window": list(self.window),
            "threshold": self.threshold,
            "direction": self.direction,
        }


def quantity(
    series: CheckpointSeries,
    metric: str,
    *,
    head: tuple[int, int] | None = None,
    layers: list[int] | None = None,
    reduce: Literal["max", "min", "mean"] = "max",
) -> pd.Series:
    """A quantity per step: a scalar metric; one head's score (`head`); or the `reduce` of a
    per-head metric over the heads (of `layers`, default all).

    Raises:
        HeadsteerValueError: an unknown metric or reduction, a head or layer with no rows.
    """
    if metric in series.scalar_metrics:
        if head is not None or layers is not None:
            raise HeadsteerValueError(f"{metric!r} is a scalar: head= and layers= do not apply")
        return series.scalar(metric)
    if metric not in series.metrics:
        known = ", ".join(series.metrics + series.scalar_metrics) or "none"
        raise HeadsteerValueError(f"no metric {short_repr(metric)} in this series: {known}")
    sub = series.scores[series.scores["metric"] == metric]
    if head is not None:
        sub = sub[(sub["layer"] == head[0]) & (sub["head"] == head[1])]
    if layers is not None:
        sub = sub[sub["layer"].isin(list(layers))]
    if sub.empty:
        raise HeadsteerValueError(f"no {metric!r} scores for head={head!r}, layers={layers!r}")
    if reduce not in ("max", "min", "mean"):
        raise HeadsteerValueError(f"reduce must be 'max', 'min' or 'mean', got {short_repr(reduce)}")
    out = sub.groupby("step")["score"].agg(reduce)
    out.name = metric
    return out.sort_index()


def _resolve(values: pd.Series, threshold: Threshold) -> float:
    if isinstance(threshold, str):
        if threshold != "midpoint":
            raise HeadsteerValueError(
                f"threshold must be a number or 'midpoint', got {short_repr(threshold)}"
            )
        v = values.dropna()
        if v.empty:
            return math.nan
        return float(v.iloc[0] + 0.5 * (v.iloc[-1] - v.iloc[0]))
    if not is_number(threshold) or not math.isfinite(threshold):
        raise HeadsteerValueError(
            f"threshold must be a finite number or 'midpoint', got {short_repr(threshold)}"
        )
    return float(threshold)


def _first_lasting(values: pd.Series, threshold: float, direction: str) -> tuple[int | None, int | None]:
    steps = [int(s) for s in values.index]
    ok = [
        (not math.isnan(v)) and (v >= threshold if direction == "above" else v <= threshold)
        for v in values.to_numpy(float)
    ]
    if not ok or not ok[-1]:
        return None, steps[-1] if steps else None
    i = len(ok) - 1
    while i > 0 and ok[i - 1]:
        i -= 1
    return steps[i], (steps[i - 1] if i > 0 else None)


def emergence(
    series: CheckpointSeries,
    metric: str,
    *,
    threshold: Threshold = 0.5,
    direction: Literal["above", "below"] = "above",
    head: tuple[int, int] | None = None,
    layers: list[int] | None = None,
    reduce: Literal["max", "min", "mean"] = "max",
) -> Emergence:
    """The step a quantity appears (see the module docstring).

    Args:
        series: the series.
        metric: a scalar metric or a per-head metric (`quantity`'s rules: `head`, `layers`,
            `reduce`; default the best head's score).
        threshold: a number, or `"midpoint"` (default 0.5).
        direction: `"above"` (default: the quantity rises past it) or `"below"` (falls below:
            a loss, the ICL score).

    Returns:
        `Emergence`; `step` None when it is not past the threshold at the last checkpoint.

    Raises:
        HeadsteerValueError: an unknown metric, threshold or direction.
    """
    if direction not in ("above", "below"):
        raise HeadsteerValueError(f"direction must be 'above' or 'below', got {short_repr(direction)}")
    values = quantity(series, metric, head=head, layers=layers, reduce=reduce)
    t = _resolve(values, threshold)
    step, prev = _first_lasting(values, t, direction)
    label = metric if head is None else f"{metric}[L{head[0]}.H{head[1]}]"
    if head is None and metric not in series.scalar_metrics:
        label += f" ({reduce} over {'all heads' if layers is None else f'layers {list(layers)}'})"
    return Emergence(label, step, (prev, step), t, direction, values)


def component_emergence(series: CheckpointSeries, metric: str, threshold: Threshold = 0.5) -> pd.DataFrame:
    """The emergence step of every head on `metric`: a table `layer, head, step, window_start,
    final_score` (step None for heads that do not end past the threshold), earliest first."""
    rows = []
    heads = series.scores[series.scores["metric"] == metric][["layer", "head"]].drop_duplicates()
    if heads.empty:
        raise HeadsteerValueError(f"no per-head metric {short_repr(metric)} in this series")
    for la, h in zip(heads["layer"], heads["head"], strict=True):
        e = emergence(series, metric, threshold=threshold, head=(int(la), int(h)))
        rows.append(
            {
                "layer": int(la),
                "head": int(h),
                "step": e.step,
                "window_start": e.window[0],
                "final_score": float(e.values.iloc[-1]),
            }
        )
    out = pd.DataFrame(rows, columns=["layer", "head", "step", "window_start", "final_score"])
    return out.sort_values(["step", "final_score"], ascending=[True, False], na_position="last").reset_index(
        drop=True
    )


def role_timelines(series: CheckpointSeries, thresholds: Mapping[str, float]) -> pd.DataFrame:
    """Per role metric and step: the heads at or above its threshold and the top head.

    Args:
        thresholds: `{metric: threshold}` (e.g. `{"induction": 0.5, "previous_token": 0.5}`).

    Returns:
        a table `role, step, top_head, top_score, heads, n_heads` (`heads`: `"L1.H2 L1.H3"`).

    Raises:
        HeadsteerValueError: a metric not in the series, a threshold that is not a finite number.
    """
    rows = []
    for metric, t in thresholds.items():
        t = check_number(f"thresholds[{metric!r}]", t)
        if metric not in series.metrics:
            raise HeadsteerValueError(f"no per-head metric {short_repr(metric)} in this series")
        sub = series.scores[series.scores["metric"] == metric]
        for step, g in sub.groupby("step", sort=True):
            g = g.dropna(subset=["score"])
            top = g.loc[g["score"].idxmax()] if not g.empty else None
            held = g[g["score"] >= t].sort_values("score", ascending=False)
            rows.append(
                {
                    "role": metric,
                    "step": int(step),
                    "top_head": None if top is None else f"L{int(top['layer'])}.H{int(top['head'])}",
                    "top_score": math.nan if top is None else float(top["score"]),
                    "heads": " ".join(
                        f"L{int(a)}.H{int(b)}" for a, b in zip(held["layer"], held["head"], strict=True)
                    ),
                    "n_heads": len(held),
                }
            )
    return pd.DataFrame(rows, columns=["role", "step", "top_head", "top_score", "heads", "n_heads"])


def persistence(series: CheckpointSeries, metric: str, threshold: float = 0.5) -> dict:
    """Function persistence of one role: who holds it at each step and how often it changes hands.

    Returns:
        `{"role", "threshold", "held_from": the emergence step of the role (best head), "holders":
        [{"step", "top_head", "top_score", "heads"}], "handovers": [{"from_step", "to_step",
        "from_head", "to_head"}], "n_handovers", "set_changes": consecutive held steps whose sets
        of holding heads differ}`.
    """
    tl = role_timelines(series, {metric: threshold})
    held = tl["top_score"] >= threshold
    handovers = []
    set_changes = 0
    rows = tl.to_dict("records")
    for a, b, ha, hb in zip(rows, rows[1:], held, held[1:], strict=False):
        if ha and hb and a["top_head"] != b["top_head"]:
            handovers.append(
                {
                    "from_step": a["step"],
                    "to_step": b["step"],
                    "from_head": a["top_head"],
                    "to_head": b["top_head"],
                }
            )
        if ha and hb and set(a["heads"].split()) != set(b["heads"].split()):
            set_changes += 1
    e = emergence(series, metric, threshold=threshold)
    return {
        "role": metric,
        "threshold": threshold,
        "held_from": e.step,
        "holders": [{k: r[k] for k in ("step", "top_head", "top_score", "heads")} for r in rows],
        "handovers": handovers,
        "n_handovers": len(handovers),
        "set_changes": set_changes,
    }


def overlap(a: Mapping[str, float], b: Mapping[str, float], k: int | None = None) -> tuple[float, float]:
    """`(jaccard, weighted)` overlap of two scored sets (see the module docstring).

    Args:
        a, b: `{item: score}` (edges `"src->dst"`, heads `"L1.H2"`); NaN scores count as 0.
        k: keep the top `k` items of each by |score| first (default all).

    Returns:
        Jaccard of the (top-k) item sets, and the weighted overlap over their union (NaN when
        both are empty).
    """
    if k is not None:
        k = check_int("k", k, lo=1)

    def top(d: Mapping[str, float]) -> dict[str, float]:
        items = {e: (0.0 if (v is None or math.isnan(v)) else abs(float(v))) for e, v in d.items()}
        if k is None:
            return items
        return dict(sorted(items.items(), key=lambda kv: (-kv[1], kv[0]))[:k])

    ta, tb = top(a), top(b)
    union = set(ta) | set(tb)
    if not union:
        return math.nan, math.nan
    jac = len(set(ta) & set(tb)) / len(union)
    hi = sum(max(ta.get(e, 0.0), tb.get(e, 0.0)) for e in union)
    lo = sum(min(ta.get(e, 0.0), tb.get(e, 0.0)) for e in union)
    return jac, (lo / hi if hi > 0 else math.nan)


def _curve(items: dict[int, dict[str, float]], k: int | None, reference: str) -> pd.DataFrame:
    if reference not in ("previous", "final"):
        raise HeadsteerValueError(f"reference must be 'previous' or 'final', got {short_repr(reference)}")
    steps = sorted(items)
    rows = []
    for i, s in enumerate(steps):
        ref = steps[i - 1] if reference == "previous" else steps[-1]
        if reference == "previous" and i == 0:
            continue
        jac, w = overlap(items[ref], items[s], k)
        rows.append({"step": s, "reference_step": ref, "jaccard": jac, "weighted": w})
    return pd.DataFrame(rows, columns=["step", "reference_step", "jaccard", "weighted"])


def edge_overlap(
    series: CheckpointSeries, *, k: int | None = None, reference: str = "previous", metric: str | None = None
) -> pd.DataFrame:
    """Overlap of the circuit edges between checkpoints: a table `step, reference_step, jaccard,
    weighted`, against the previous checkpoint (`reference="previous"`, default) or the final one.

    Args:
        k: compare the top `k` edges by |score| of each checkpoint (default: every circuit edge).
        metric: which circuit, when the series holds several (the edges' `metric`).

    Raises:
        HeadsteerValueError: a series without edges, a bad `reference` or `k`.
    """
    e = series.edges
    if metric is not None:
        e = e[e["metric"] == metric]
    if e.empty:
        raise HeadsteerValueError("this series holds no circuit edges (run the 'circuit' analysis)")
    items = {
        int(s): {f"{a}->{b}": float(v) for a, b, v in zip(g["source"], g["target"], g["score"], strict=True)}
        for s, g in e.groupby("step")
    }
    for s in series.steps:  # a checkpoint whose circuit is empty still counts
        items.setdefault(s, {})
    return _curve(items, k, reference)


def head_overlap(
    series: CheckpointSeries, metric: str, *, k: int = 10, reference: str = "previous"
) -> pd.DataFrame:
    """Overlap of the top-`k` heads by |score| of `metric` between checkpoints (as `edge_overlap`)."""
    if metric not in series.metrics:
        raise HeadsteerValueError(f"no per-head metric {short_repr(metric)} in this series")
    sub = series.scores[series.scores["metric"] == metric]
    items = {
        int(s): {
            f"L{int(a)}.H{int(b)}": float(v)
            for a, b, v in zip(g["layer"], g["head"], g["score"], strict=True)
        }
        for s, g in sub.groupby("step")
    }
    return _curve(items, k, reference)
