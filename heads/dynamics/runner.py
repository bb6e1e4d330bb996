"""`over_checkpoints`: one analysis on every checkpoint of a series, one model in memory at a time,
with per-checkpoint results written atomically so a killed run resumes where it stopped."""

from __future__ import annotations

import gc
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from heads._util.files import check_writable, short_path, write_text
from heads._util.progress import ProgressArg, progress_callback
from heads._util.validation import check_bool, read_json_file
from heads.dynamics.analyses import Analysis, tidy
from heads.dynamics.checkpoints import Checkpoint, find_checkpoints, fingerprint
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.dynamics import CheckpointSeries

__all__ = ["RUN_FILE", "over_checkpoints", "part_name"]

RUN_FILE = "run.json"
"""The file in a results folder naming the run (analysis, parameters, checkpoints)."""
_PART_SCHEMA = "headsteer/checkpoint-part"


def part_name(c: Checkpoint) -> str:
    """The file of one checkpoint's result in a results folder (`step-000000100.json`)."""
    return f"step-{c.step:09d}.json"


def _identity(analysis: Analysis, series: list[Checkpoint], prints: list[str | None]) -> dict:
    return {
        "schema": _PART_SCHEMA,
        **analysis.identity(),
        "checkpoints": [{**c.describe(), "fingerprint": f} for c, f in zip(series, prints, strict=True)],
    }


def _changed_weights(old: dict, ident: dict) -> str | None:
    """The name of the first checkpoint whose weights alone differ between two run identities."""
    ident = json.loads(json.dumps(ident))
    a, b = old.get("checkpoints"), ident["checkpoints"]
    if not isinstance(a, list) or len(a) != len(b):
        return None
    if {**old, "checkpoints": None} != {**ident, "checkpoints": None}:
        return None
    for x, y in zip(a, b, strict=True):
        if not isinstance(x, dict):
            return None
        if {**x, "fingerprint": None} != {**y, "fingerprint": None}:
            return None
    changed = (str(y["name"]) for x, y in zip(a, b, strict=True) if x.get("fingerprint") != y["fingerprint"])
    return next(changed, None)


def _prepare(folder: Path, ident: dict, overwrite: bool) -> None:
    """Check the results folder: a new one, or one of the same run (resume)."""
    if folder.is_symlink():
        raise HeadsteerValueError(f"refusing to write through a symlink: {folder}")
    if folder.exists() and not folder.is_dir():
        raise HeadsteerValueError(f"results folder {short_path(folder)} exists and is not a folder")
    check_writable(folder)
    if not folder.exists():
        return
    files = [*sorted(folder.glob("step-*.json")), folder / RUN_FILE]
    linked = next((p for p in files if p.is_symlink()), None)
    if linked is not None:
        raise HeadsteerValueError(
            f"{short_path(linked)} is a symlink; results are never read or written through one: remove it"
        )
    run = folder / RUN_FILE
    if not run.is_file():
        if any(folder.iterdir()) and not overwrite:
            raise HeadsteerValueError(
                f"results folder {short_path(folder)} is not empty and holds no {RUN_FILE} (it is not "
                "a results folder of over_checkpoints); use another folder, or overwrite=True (--force) "
                "to write there anyway"
            )
        return
    try:
        old = read_json_file(run)
    except HeadsteerValueError:
        old = None
    same = isinstance(old, dict) and old == json.loads(json.dumps(ident))
    if same:
        return
    if not overwrite:
        changed = _changed_weights(old, ident) if isinstance(old, dict) else None
        why = (
            f"checkpoint {changed!r} has other weights than when its results were written: retrained "
            "or replaced"
            if changed is not None
            else "other analysis, parameters or checkpoints"
        )
        raise HeadsteerValueError(
            f"{short_path(folder)} holds the results of another run ({why}); use another folder, or "
            "overwrite=True (--force) to discard them"
        )
    for p in folder.glob("step-*.json"):
        p.unlink()
    run.unlink()


_ROW_FIELDS = {
    "scores": {"metric": str, "layer": int, "head": int, "score": float},
    "scalars": {"metric": str, "value": float},
    "edges": {"metric": str, "source": str, "target": str, "score": float},
    "roles": {"layer": int, "head": int, "role": str},
}


def _good_value(v: Any, kind: type) -> bool:
    if kind is str:
        return isinstance(v, str)
    if isinstance(v, bool):
        return False
    if kind is int:
        return isinstance(v, int) and v >= 0
    return v is None or (isinstance(v, (int, float)) and math.isfinite(v))


def _good_rows(rows: Any) -> bool:
    """Whether a part's `rows` are what `Tidy.to_json` writes (NaN is written as null, so a NaN or
    inf found there was not written by us)."""
    if not isinstance(rows, dict) or not set(rows) <= set(_ROW_FIELDS):
        return False
    for name, table in rows.items():
        if not isinstance(table, list):
            return False
        fields = _ROW_FIELDS[name]
        for r in table:
            if not isinstance(r, dict) or not all(k in r and _good_value(r[k], t) for k, t in fields.items()):
                return False
            if any(isinstance(v, float) and not math.isfinite(v) for v in r.values()):
                return False
    return True


def _read_part(path: Path, c: dict, ident: dict) -> dict | None:
    """A stored part if it is this run's result for checkpoint `c` (its identity with the weights'
    fingerprint) and well formed; None (compute it again) otherwise."""
    if path.is_symlink():
        return None
    try:
        part = read_json_file(path)
    except (OSError, HeadsteerValueError):
        return None  # unreadable: computed again
    if (
        not isinstance(part, dict)
        or part.get("checkpoint") != c
        or part.get("analysis") != ident["analysis"]
        or part.get("params") != ident["params"]
        or not _good_rows(part.get("rows"))
    ):
        return None
    seconds = part.get("seconds")
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds):
        return None
    return part


def over_checkpoints(
    checkpoints: Any,
    analysis: Any,
    params: Mapping[str, Any] | None = None,
    *,
    inputs: Any = None,
    steps: Sequence[int] | None = None,
    results_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
    load_kwargs: Mapping[str, Any] | None = None,
    progress: ProgressArg = True,
) -> CheckpointSeries:
    """Run one analysis on each checkpoint of a series; a tidy `CheckpointSeries`.

    Checkpoints are loaded one at a time (`heads.load_model(path, **load_kwargs)`) and released
    before the next, so memory holds one model. Everything is checked before the first load:
    the analysis and its parameters (`Analysis.of`), every folder (a model folder or a folder of
    them, its config, safetensors weights) and the results folder.

    Args:
        checkpoints: model folders, folders of checkpoint folders, loaded `HeadModel`s, or a
            `{label: folder}` mapping (`heads.dynamics.find_checkpoints`); ordered by the step in
            each folder's metadata or name.
        analysis: a name in `heads.dynamics.ANALYSES` (`"detectors"`, `"atlas"`, `"dla"`,
            `"patching"`, `"circuit"`, `"ships"`, `"maps"`, `"icl"`, `"induction_phase"`), a
            callable `fn(model, **params)` returning `HeadScores`, a dict of them, a `Circuit`, a
            `HeadAtlas` or numbers, an `Analysis`, or a request (`run(model)`, `to_json()`).
        params: the analysis' keyword parameters, JSON values (e.g. `{"pairs": [...]}`).
        inputs: with a `heads` analysis request (`PatchRequest(kind="head_out")`, ...), its one
            input (e.g. a list of `PromptPair`s), run as `heads.run(model, request, inputs)` on
            each checkpoint; the request is checked against every checkpoint's config before the
            first load.
        steps: override the steps (one int per checkpoint found).
        results_dir: a folder for per-checkpoint results (`step-NNNNNNNNN.json`, each written
            atomically, and `run.json`). A rerun with the same analysis, parameters and
            checkpoints reuses the results there and computes only the missing ones (resume);
            a part that is truncated or malformed is computed again. A checkpoint's identity
            includes a fingerprint of its weights (`heads.dynamics.checkpoints.fingerprint`): a
            checkpoint retrained in place, or another loaded model at the same step, makes it
            another run. A symlink in the folder is refused. None (default): nothing is written.
        overwrite: discard the results of another run found in `results_dir`, or write into a
            non-empty folder that holds no `run.json` (default False: a `HeadsteerValueError`).
        load_kwargs: keyword arguments of `load_model` (e.g. `{"dtype": "float32"}`).
        progress: True (a tqdm bar), False / None, or `progress(done, total)` in checkpoints.

    Returns:
        `CheckpointSeries`; each checkpoint's metadata numbers (e.g. `train_loss`) are added as
        scalars, and its `seconds` (load + analysis) recorded.

    Raises:
        HeadsteerValueError / HeadsteerTypeError: bad checkpoints, analysis, parameters, results
            folder (see `find_checkpoints`, `Analysis.of`), all before any model is loaded; what
            the analysis raises on a checkpoint; a results folder of another run (other
            analysis, parameters, checkpoints or weights), a non-empty folder without `run.json`,
            or a symlinked file in it, without `overwrite`.
    """
    from transformers import AutoConfig

    from heads.model.loading import check_config, check_weights, load_model

    job = Analysis.of(analysis, params, inputs)
    check_bool("overwrite", overwrite)
    if load_kwargs is not None and not isinstance(load_kwargs, Mapping):
        raise HeadsteerTypeError(f"load_kwargs must be a dict, got {type(load_kwargs).__name__}")
    series = find_checkpoints(checkpoints, steps=steps)
    for c in series:
        if c.path is not None:
            check_weights(c.path)
            check_config(c.path)
            if hasattr(job.request, "check_config"):  # a heads request: its geometry, before loading
                job.request.check_config(AutoConfig.from_pretrained(c.path))
    folder = None if results_dir is None else Path(os.fspath(results_dir)).expanduser()
    # the weights' fingerprints matter only to a results folder (a loaded model's costs a pass)
    ident = _identity(job, series, [None if folder is None else fingerprint(c) for c in series])
    if folder is not None:
        _prepare(folder, ident, overwrite)
    short = job.name if ":" not in job.name else job.name.rsplit(".", 1)[-1].rsplit(":", 1)[-1]
    parts: list[dict] = []
    with progress_callback(progress, "checkpoints", "ckpt") as report:
        if report is not None:
            report(0, len(series))
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            write_text(folder / RUN_FILE, json.dumps(ident, indent=1) + "\n", overwrite=True)
        for i, c in enumerate(series):
            c_ident = ident["checkpoints"][i]
            part = None if folder is None else _read_part(folder / part_name(c), c_ident, ident)
            if part is None:
                t0 = time.perf_counter()
                model = c.model if c.model is not None else load_model(c.path, **dict(load_kwargs or {}))
                result = job.run(model)
                rows = tidy(result, short)
                del model, result
                gc.collect()
                rows.scalars += [{"metric": k, "value": v} for k, v in c.meta.items()]
                part = {
                    "schema": _PART_SCHEMA,
                    **job.identity(),
                    "checkpoint": c_ident,
                    "seconds": time.perf_counter() - t0,
                    "rows": rows.to_json(),
                }
                if folder is not None:
                    text = json.dumps(part, allow_nan=False) + "\n"
                    write_text(folder / part_name(c), text, overwrite=True)
            parts.append(part)
            if report is not None:
                report(i + 1, len(series))
    return CheckpointSeries.from_parts(ident_public(job), parts)


def ident_public(job: Analysis) -> dict:
    """The analysis identity stored in the result."""
    return {"analysis": job.name, "params": job.params}
