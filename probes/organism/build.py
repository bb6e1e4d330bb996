"""`build_organism`: train the organism specs and save their checkpoints into one folder, atomically.

Layout of the folder:

    OUT/organism.json            what was trained (specs, seconds, torch version)
    OUT/<spec name>/training_log.json
    OUT/<spec name>/step-NNNNNN/ a Hugging Face folder per checkpoint (`heads.load_model(path)`)

Everything is trained into a temporary folder beside OUT first, so an interrupted training
leaves OUT as it was. A new OUT is then renamed into place whole. An existing OUT is written only
with `overwrite=True` (the CLI's `--force`), and only when it is a previous organism build (it
holds `organism.json`) or an empty folder: a folder of other files is refused. Even then only the
build's own outputs are replaced, each atomically (a rename): `organism.json`, each run's
`training_log.json` and checkpoint folders, and the checkpoint folders the previous build's
`organism.json` lists for a run trained again (so a run never mixes two trainings). Any other file
in OUT or in a run's folder is left alone. A build of some runs only (the CLI's `--only`) keeps
the previous build's other runs, folders and entries in `organism.json` alike, so `organism.json`
always lists every run in OUT (a later build then knows their checkpoints too); the manifest's
`"trained"` names the runs this build trained. `organism_outputs` names every path written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from heads._util.files import check_writable, current_umask, short_path
from heads._util.progress import ProgressArg, offset_progress, progress_callback
from heads._util.validation import check_bool, check_path
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from probes.organism.recipe import ORGANISMS, OrganismSpec, checkpoint_name, train_organism

__all__ = ["MANIFEST", "build_organism", "check_organism_out", "organism_outputs"]

MANIFEST = "organism.json"
"""The file naming a folder as an organism build."""


def check_organism_out(out: str | os.PathLike, overwrite: bool) -> Path:
    """Check the output folder before any training (see the module docstring).

    Raises:
        HeadsteerValueError: a symlink, a file, an existing build without `overwrite`, a
            non-empty folder that is not an organism build, a folder that cannot be written.
    """
    path = Path(check_path("out", out)).expanduser()
    if path.is_symlink():
        raise HeadsteerValueError(f"refusing to write through a symlink: {path}")
    if path.exists():
        if not path.is_dir():
            raise HeadsteerValueError(f"{short_path(path)} exists and is not a folder")
        empty = not any(path.iterdir())
        if not empty and not (path / MANIFEST).is_file():
            raise HeadsteerValueError(
                f"{short_path(path)} is a folder of other files (no {MANIFEST}); choose a new folder"
            )
        if not empty and not overwrite:
            raise HeadsteerValueError(
                f"{short_path(path)} exists; pass --force (API: overwrite=True) to replace it"
            )
    check_writable(path.parent)
    return path


def organism_outputs(out: str | os.PathLike, manifest: dict) -> list[Path]:
    """Every path a build wrote (from its manifest): each trained run's checkpoint folders and
    `training_log.json`, then `organism.json` (runs kept from a previous build are not listed)."""
    root = Path(out).expanduser()
    paths = []
    for name in manifest.get("trained", manifest["runs"]):
        r = manifest["runs"][name]
        paths += [root / name / checkpoint_name(int(step)) for step in r["checkpoints"]]
        paths.append(root / name / "training_log.json")
    return [*paths, root / MANIFEST]


def _run_name(name: object) -> bool:
    return isinstance(name, str) and "/" not in name and "\\" not in name and name not in ("", ".", "..")


def _with_previous_runs(target: Path, manifest: dict) -> dict:
    """`manifest` written over the previous build at `target`: the previous build's runs that
    this build does not train, and whose folders are still there, are kept (their specs and run
    entries, in the previous order; the new runs replace theirs or follow). An unreadable
    previous manifest keeps nothing."""
    from heads._util.validation import read_json_file

    try:
        old = read_json_file(target / MANIFEST)
        old_specs = {str(sp["name"]): sp for sp in old["specs"]}
        old_runs = dict(old["runs"])
    except (OSError, HeadsteerValueError, KeyError, TypeError, ValueError, AttributeError):
        return manifest
    new_specs = {sp["name"]: sp for sp in manifest["specs"]}
    kept = [
        n
        for n in old_runs
        if n not in new_specs
        and n in old_specs
        and _run_name(n)
        and (target / n).is_dir()
        and not (target / n).is_symlink()
    ]
    order = [n for n in old_runs if n in kept or n in new_specs]
    order += [n for n in new_specs if n not in order]
    specs = [new_specs[n] if n in new_specs else old_specs[n] for n in order]
    runs = {n: manifest["runs"][n] if n in new_specs else old_runs[n] for n in order}
    return {**manifest, "specs": specs, "runs": runs}


def _previous_checkpoints(target: Path) -> dict[str, list[str]]:
    """The checkpoint folder names per run listed by the previous build's manifest (none when
    unreadable)."""
    from heads._util.validation import read_json_file

    try:
        old = read_json_file(target / MANIFEST)
        return {
            str(name): [checkpoint_name(int(s)) for s in r["checkpoints"]]
            for name, r in old["runs"].items()
            if _run_name(name)
        }
    except (OSError, HeadsteerValueError, KeyError, TypeError, ValueError, AttributeError):
        return {}


def _replace(src: Path, dst: Path) -> None:
    """Move `src` to `dst` by a rename; an old folder at `dst` is renamed aside first and then
    removed (a symlink at `dst` is refused)."""
    if dst.is_symlink():
        raise HeadsteerValueError(f"refusing to write through a symlink: {dst}")
    if dst.is_dir():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def _install(tmp: Path, target: Path, names: list[str]) -> None:
    """Move the build's outputs from `tmp` into the existing `target`, one rename each."""
    previous = _previous_checkpoints(target)
    for name in names:
        run = target / name
        if run.is_symlink() or (run.exists() and not run.is_dir()):
            raise HeadsteerValueError(f"{short_path(run)} is a symlink or a file, not a run folder")
    for name in names:
        src, run = tmp / name, target / name
        run.mkdir(exist_ok=True)
        new = {p.name for p in src.iterdir()}
        for item in sorted(src.iterdir()):
            _replace(item, run / item.name)
        for stale in previous.get(name, []):
            p = run / stale
            if stale not in new and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
    _replace(tmp / MANIFEST, target / MANIFEST)


def build_organism(
    out: str | os.PathLike,
    *,
    specs: Sequence[OrganismSpec] = ORGANISMS,
    overwrite: bool = False,
    progress: ProgressArg = True,
) -> dict:
    """Train every spec from scratch and write the organism folder `out` (see the module docstring).

    Args:
        out: the folder to write (its build outputs replaced only with `overwrite`, see the module
            docstring and `check_organism_out`).
        specs: the recipes (default `ORGANISMS`: the attention-only and the Llama-shaped model);
            names must differ.
        overwrite: replace a previous build's outputs at `out` (other files there are kept).
        progress: True (a bar), False / None, or `progress(done, total)` in optimiser steps over
            all specs. transformers' own "Writing model shards" bars never show (also with
            False / None: nothing is printed), and its progress-bar switch is restored after.

    Returns:
        the manifest written to `organism.json`: `{"specs": [...], "runs": {name: {"seconds",
        "checkpoints", "final_loss"}}, "trained": [names], "seconds", "torch"}`; over a previous
        build, its runs not trained again are kept in `specs` and `runs` (`trained` names the
        runs this call trained).

    Raises:
        HeadsteerValueError / HeadsteerTypeError: a bad folder, spec list or flag (before training).
    """
    check_bool("overwrite", overwrite)
    if isinstance(specs, OrganismSpec) or not isinstance(specs, Sequence) or not specs:
        raise HeadsteerTypeError("specs must be a non-empty list of OrganismSpec")
    if not all(isinstance(s, OrganismSpec) for s in specs):
        raise HeadsteerTypeError("specs must be a non-empty list of OrganismSpec")
    names = [s.name for s in specs]
    if len(set(names)) != len(names) or MANIFEST in names:
        raise HeadsteerValueError(f"spec names must be distinct, got {names}")
    target = check_organism_out(out, overwrite)
    total = sum(s.steps for s in specs)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    t0 = time.perf_counter()
    try:
        runs = {}
        with progress_callback(progress, "organism", "step") as report:
            done = 0
            for spec in specs:
                log = train_organism(spec, tmp / spec.name, progress=offset_progress(report, done, total))
                done += spec.steps
                runs[spec.name] = {
                    "seconds": log["seconds"],
                    "checkpoints": log["checkpoints"],
                    "final_loss": log["losses"][-1] if log["losses"] else None,
                }
        manifest = {
            "specs": [s.to_dict() for s in specs],
            "runs": runs,
            "trained": names,
            "seconds": time.perf_counter() - t0,
            "torch": torch.__version__,
        }
        if target.exists():  # the previous build's other runs stay listed (`--only`)
            manifest = _with_previous_runs(target, manifest)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        os.chmod(tmp, 0o777 & ~current_umask())
        if target.exists():
            check_organism_out(target, overwrite)  # re-check: it may have changed meanwhile
            _install(tmp, target, names)
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
