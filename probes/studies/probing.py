"""The per-head probe study behind `headsteer report probes`: fit, rank, compare directions.

For each task (`probes.head_probes.probe_data`: harmful vs harmless requests, sentiment labels,
counterfact "answer from the context" vs "from memory") `probe_study` collects every head's output
at the last token of the train split and fits a logistic-regression probe per head (stratified
k-fold CV, `probes.head_probes.fit_head_probes`). The result holds, per task, the fitted
`ProbeResult`, the majority-class share, how many heads beat chance (Wilson lower bound above the
majority share) and the best head; and per task pair, the `[L, H]` cosine between the tasks'
mass-mean directions. `viz.reports.probes` only draws it.

Method: Li et al. 2023, "Inference-Time Intervention" (ITI), section 3.1 (per-head probes).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from heads import HeadModel
from heads._util.progress import ProgressArg, offset_progress, progress_callback
from heads._util.validation import check_int, short_repr
from heads.errors import HeadsteerValueError
from probes.head_probes import PROBE_TASKS, ProbeResult, collect_head_outputs, fit_head_probes, probe_data

__all__ = [
    "FIT_STEPS",
    "REPORT_TASKS",
    "ProbeStudy",
    "TaskProbes",
    "check_probe_tasks",
    "direction_cosines",
    "probe_study",
]

REPORT_TASKS = ("harmful", "sentiment", "counterfact")
"""The tasks `probe_study` (and `headsteer report probes`) runs by default."""

FIT_STEPS = 50
"""Progress steps one task's probe fitting counts for (about the time of collecting 50 prompts'
head outputs on the embedded model), so that the ETA stays honest across both stages; the fit
advances them as its heads are done."""


def direction_cosines(a: ProbeResult, b: ProbeResult, *, kind: str = "mass_mean") -> torch.Tensor:
    """`[L, H]` cosine between two probe results' directions in every head.

    Args:
        kind: "mass_mean" (default) or "probe".

    Raises:
        HeadsteerValueError: unknown kind, or results of different shapes.
    """
    if kind not in ("mass_mean", "probe"):
        raise HeadsteerValueError(f"kind must be 'mass_mean' or 'probe', got {short_repr(kind)}")
    da, db = getattr(a, f"{kind}_directions"), getattr(b, f"{kind}_directions")
    if da.shape != db.shape:
        raise HeadsteerValueError(
            f"probe results of different shapes: {tuple(da.shape)} vs {tuple(db.shape)}"
        )
    return torch.nn.functional.cosine_similarity(da, db, dim=-1)


@dataclass(frozen=True)
class TaskProbes:
    """One task's fitted probes and what the report says of them.

    Attributes:
        task: the probe task (`probe_data`).
        description: its one-line description.
        result: the fitted `ProbeResult` (accuracy, AUC, intervals, directions per head).
        majority: the majority-class share of its rows (the chance level).
        above_chance: heads whose 95% Wilson lower bound on accuracy is above `majority`.
        best: the best head, `{"head": [layer, head], "accuracy", "interval": [low, high], "auc"}`
            (rounded to 4 places).
    """

    task: str
    description: str
    result: ProbeResult
    majority: float
    above_chance: int
    best: dict

    def summary(self) -> dict:
        """`{"rows", "majority", "above_chance", "best"}` (JSON-able)."""
        return {
            "rows": self.result.n,
            "majority": round(self.majority, 4),
            "above_chance": self.above_chance,
            "best": self.best,
        }


@dataclass(frozen=True)
class ProbeStudy:
    """`probe_study`'s result: per task its probes, per task pair the direction cosines.

    Attributes:
        tasks: task name -> `TaskProbes`, in the order asked.
        cosines: `(a, b)` for each pair of tasks (in order) -> `[L, H]` cosine of their
            mass-mean directions.
        top: the top heads per task the pair summary averages over.
        params: the study's settings (tasks, limit, cv, seed, the probe).
    """

    tasks: dict[str, TaskProbes]
    cosines: dict[tuple[str, str], torch.Tensor]
    top: int
    params: dict = field(default_factory=dict)

    def top_union(self, a: str, b: str) -> list[tuple[int, int]]:
        """The heads in task `a`'s or task `b`'s top `self.top`, sorted."""
        ra, rb = self.tasks[a].result, self.tasks[b].result
        return sorted(set(ra.ranked(self.top)) | set(rb.ranked(self.top)))

    def mean_abs_cosine(self, a: str, b: str) -> float:
        """Mean |cosine| of the two tasks' mass-mean directions over `top_union(a, b)`."""
        cos = self.cosines[(a, b)]
        return float(torch.stack([cos[la, h].abs() for la, h in self.top_union(a, b)]).mean())

    def summary(self) -> dict:
        """`{"tasks": {task: TaskProbes.summary()}, "cosine": {"a~b": mean |cos| (4 places)}}`."""
        return {
            "tasks": {t: tp.summary() for t, tp in self.tasks.items()},
            "cosine": {f"{a}~{b}": round(self.mean_abs_cosine(a, b), 4) for a, b in self.cosines},
        }


def check_probe_tasks(tasks: Sequence[str]) -> list[str]:
    """`tasks` as a list if every one is in `PROBE_TASKS` and there is at least one.

    Raises:
        HeadsteerValueError: an unknown task, or none.
    """
    tasks = list(tasks)
    bad = [t for t in tasks if t not in PROBE_TASKS]
    if bad or not tasks:
        raise HeadsteerValueError(
            f"unknown probe task {short_repr(bad[0] if bad else tasks)}: use some of {PROBE_TASKS}"
        )
    return tasks


def probe_study(
    model: HeadModel,
    *,
    tasks: Sequence[str] = REPORT_TASKS,
    limit: int | None = None,
    top: int = 10,
    cv: int = 5,
    seed: int = 0,
    batch_size: int = 16,
    n_jobs: int = 1,
    progress: ProgressArg = True,
) -> ProbeStudy:
    """Fit per-head probes on each task and compare the tasks' directions.

    Args:
        model: a `HeadModel` with a tokenizer.
        tasks: probe tasks (`probes.head_probes.PROBE_TASKS`; default harmful, sentiment,
            counterfact), each on its train split.
        limit: at most `limit` examples per task (`probe_data`), default all.
        top: heads per task the pair summary averages over (default 10).
        cv, seed, n_jobs: as `fit_head_probes`; batch_size as `collect_head_outputs`.
        progress: True (default: a tqdm bar), False / None (off) or `progress(done, total)`
            (`heads._util.progress`) in steps: each prompt whose head outputs are collected (after
            each batch), then `FIT_STEPS` when a task's probes are fitted; total known up front.

    Returns:
        A `ProbeStudy`.

    Raises:
        HeadsteerValueError: an unknown task, or bad numbers (before any forward pass).
    """
    tasks = check_probe_tasks(tasks)
    top = check_int("top", top, lo=1)
    datas = {task: probe_data(task, "train", limit=limit) for task in tasks}
    # steps: each prompt whose head outputs are collected, then FIT_STEPS per task for the probes
    total = sum(len(d.prompts) + FIT_STEPS for d in datas.values())
    done = 0
    fitted: dict[str, TaskProbes] = {}
    with progress_callback(progress, "probes", "steps") as report:
        for task in tasks:  # collect, then fit
            data = datas[task]
            acts = collect_head_outputs(
                model,
                data.prompts,
                "last",
                batch_size=batch_size,
                chat=data.chat,
                progress=offset_progress(report, done, total) or False,
            )
            done += len(data.prompts)

            def fit_progress(d: int, t: int, at: int = done) -> None:
                if report is not None:
                    report(at + FIT_STEPS * d // t, total)

            res = fit_head_probes(
                acts,
                data.labels,
                cv=cv,
                seed=seed,
                groups=data.groups,
                n_jobs=n_jobs,
                model=model.name,
                n_kv_heads=model.n_kv_heads,
                progress=fit_progress if report else False,
            )
            done += FIT_STEPS
            majority = max(res.n_positive, res.n - res.n_positive) / res.n
            (layer, head), *_ = res.ranked(1)
            best = {
                "head": [layer, head],
                "accuracy": round(float(res.accuracy.scores[layer, head]), 4),
                "interval": [
                    round(float(res.accuracy_low[layer, head]), 4),
                    round(float(res.accuracy_high[layer, head]), 4),
                ],
                "auc": round(float(res.auc.scores[layer, head]), 4),
            }
            fitted[task] = TaskProbes(
                task, data.description, res, majority, int((res.accuracy_low > majority).sum()), best
            )
    cosines = {
        (a, b): direction_cosines(fitted[a].result, fitted[b].result)
        for a, b in itertools.combinations(tasks, 2)
    }
    probe = "LogisticRegression(max_iter=1000)"
    params = {"tasks": tasks, "limit": limit, "cv": cv, "seed": seed, "probe": probe}
    return ProbeStudy(fitted, cosines, top, params)
