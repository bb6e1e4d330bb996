"""The induction-head phase change (Olsson et al. 2022) read from a checkpoint series.

Olsson et al. observe, in small attention-only models, that at one point of training (a) the
in-context-learning score drops, (b) induction heads form, (c) the training loss shows a bump,
and (d) previous-token heads in the earlier layer form at the same time, K-composing with the
induction heads. `phase_change` locates each on a series made by the `"induction_phase"`
analysis (`over_checkpoints`), with one rule for all of them: the **jump step** of a quantity is
the first checkpoint from which it stays past the middle of its change over the run
(`emergence(..., threshold="midpoint")`), reported with its window `(previous checkpoint, step]`:

| quantity | series metric | direction |
|---|---|---|
| ICL score | `icl_score` | falls |
| induction | best `induction` head of layers >= 1 | rises |
| previous token | best `previous_token` head of layers before the last | rises |
| training loss | `train_loss_repeated` (loss on the repeated-segment rows; else `train_loss`) | falls |
| K-composition | `k_composition` (top previous-token head into the top induction head) | rises |

The role thresholds of the atlas (0.5) are reported too (`role_emergence`): the step from which
the best head *holds* the role.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from heads._util.progress import ProgressArg
from heads.dynamics.compare import Emergence, emergence
from heads.dynamics.runner import over_checkpoints
from heads.errors import HeadsteerValueError
from heads.results.dynamics import CheckpointSeries

__all__ = ["PhaseChange", "induction_phase_change", "phase_change"]


@dataclass
class PhaseChange:
    """Where each quantity of the induction phase change jumps (see the module docstring).

    Attributes:
        series: the `"induction_phase"` series.
        jumps: `{"icl", "induction", "previous_token", "loss", "k_composition"}` -> `Emergence`
            (midpoint rule); a quantity the series lacks is left out.
        role_emergence: `{"induction", "previous_token"}` -> `Emergence` at the role threshold.
        heads: the top `induction` and `previous_token` heads at the last checkpoint.
    """

    series: CheckpointSeries
    jumps: dict[str, Emergence]
    role_emergence: dict[str, Emergence] = field(default_factory=dict)
    heads: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def detected(self) -> bool:
        """Whether there is a phase change to read: the best induction head holds the role (its
        score reaches the role threshold and stays) by the last checkpoint. When it does not, the
        midpoint rule still returns steps, but they are the middle of a change that did not
        happen (e.g. a run stopped on the plateau)."""
        e = self.role_emergence.get("induction")
        return e is not None and e.step is not None

    def steps(self) -> dict[str, int | None]:
        """`{quantity: jump step}`."""
        return {k: e.step for k, e in self.jumps.items()}

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers: per quantity its jump step, window, threshold, first and last value;
        `spread`: the largest difference between the jump steps of ICL, induction and previous
        token (0: the same checkpoint); `detected` (see the property); the top heads; the role
        emergence steps."""
        out: dict[str, Any] = {}
        for k, e in self.jumps.items():
            v = e.values.dropna()
            out[k] = {
                **e.to_dict(),
                "first": float(v.iloc[0]) if len(v) else math.nan,
                "last": float(v.iloc[-1]) if len(v) else math.nan,
            }
        core = [self.jumps[k].step for k in ("icl", "induction", "previous_token") if k in self.jumps]
        out["spread"] = (max(core) - min(core)) if core and None not in core else None  # type: ignore[type-var,operator]
        out["detected"] = self.detected
        out["heads"] = {k: list(v) for k, v in self.heads.items()}
        out["role_emergence"] = {k: e.to_dict() for k, e in self.role_emergence.items()}
        return out


def _best(series: CheckpointSeries, metric: str, layers: list[int]) -> tuple[int, int]:
    s = series.head_scores(None, metric).scores.clone()
    for la in range(s.shape[0]):
        if la not in layers:
            s[la] = -1.0
    la, h = divmod(int(s.nan_to_num(-1.0).argmax()), s.shape[1])
    return la, h


def phase_change(series: CheckpointSeries, *, role_threshold: float = 0.5) -> PhaseChange:
    """Locate the phase change in a series made by the `"induction_phase"` analysis.

    Raises:
        HeadsteerValueError: a series without the `induction`, `previous_token` and `icl_score`
            metrics, or of a one-layer model.
    """
    need = {"induction", "previous_token"} - set(series.metrics)
    if need or "icl_score" not in series.scalar_metrics:
        raise HeadsteerValueError(
            "phase_change needs the 'induction_phase' analysis (metrics induction, previous_token, icl_score)"
        )
    n_layers = int(series.scores["layer"].max()) + 1
    if n_layers < 2:
        raise HeadsteerValueError("an induction circuit needs at least two layers")
    late, early = list(range(1, n_layers)), list(range(n_layers - 1))
    jumps = {
        "icl": emergence(series, "icl_score", threshold="midpoint", direction="below"),
        "induction": emergence(series, "induction", threshold="midpoint", layers=late),
        "previous_token": emergence(series, "previous_token", threshold="midpoint", layers=early),
    }
    for name in ("train_loss_repeated", "train_loss"):
        if name in series.scalar_metrics:
            jumps["loss"] = emergence(series, name, threshold="midpoint", direction="below")
            break
    if "k_composition" in series.scalar_metrics:
        jumps["k_composition"] = emergence(series, "k_composition", threshold="midpoint")
    roles = {
        "induction": emergence(series, "induction", threshold=role_threshold, layers=late),
        "previous_token": emergence(series, "previous_token", threshold=role_threshold, layers=early),
    }
    heads = {"induction": _best(series, "induction", late)}
    heads["previous_token"] = _best(series, "previous_token", list(range(heads["induction"][0])))
    return PhaseChange(series, jumps, roles, heads)


def induction_phase_change(
    checkpoints: Any,
    *,
    n: int = 16,
    length: int | None = None,
    seed: int = 0,
    composition: bool = True,
    role_threshold: float = 0.5,
    results_dir: Any = None,
    overwrite: bool = False,
    progress: ProgressArg = True,
) -> PhaseChange:
    """Run the `"induction_phase"` analysis over `checkpoints` and locate the phase change.

    Args:
        checkpoints: as `over_checkpoints` (e.g. the folder of one organism run).
        n, length, seed: the repeated sequences (`icl_sequences`).
        composition: also measure the K-composition (default True).
        role_threshold: the role threshold of `role_emergence` (default 0.5).
        results_dir, overwrite, progress: as `over_checkpoints` (resume).

    Returns:
        `PhaseChange`.
    """
    params = {"n": n, "length": length, "seed": seed, "composition": composition}
    series = over_checkpoints(
        checkpoints,
        "induction_phase",
        params,
        results_dir=results_dir,
        overwrite=overwrite,
        progress=progress,
    )
    return phase_change(series, role_threshold=role_threshold)
