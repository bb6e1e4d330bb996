"""`build_organism`: train the organism specs and save their checkpoints into one folder, atomically.

Layout of the folder:

    OUT/organism.json            what was trained (specs, seconds, torch version)
    OUT/<spec name>/training_log.json
    OUT/<spec name>/step-NNNNNN/ a Hugging Face folder per checkpoint (`heads.load_model(path)`)

Everything is written into a temporary folder beside OUT and renamed to OUT at the end, so an
interrupted build leaves no partial OUT. An existing OUT is replaced only with `overwrite=True`
(the CLI's `--force`), and only when it is a previous organism build (it holds
`organism.json`) or an empty folder: a folder of other files is never removed.
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

from heads._util.files import check_writable, short_path
from heads._util.progress import ProgressArg, offset_progress, progress_callback
from heads._util.validation import check_bool, check_path
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from probes.organism.recipe import ORGANISMS, OrganismSpec, train_organism

__all__ = ["MANIFEST", "build_organism", "check_organism_out"]

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


def build_organism(
    out: str | os.PathLike,
    *,
    specs: Sequence[OrganismSpec] = ORGANISMS,
    overwrite: bool = False,
    progress: ProgressArg = True,
) -> dict:
    """Train every spec from scratch and write the organism folder `out` (see the module docstring).

    Args:
        out: the folder to write (replaced only with `overwrite`, see `check_organism_out`).
        specs: the recipes (default `ORGANISMS`: the attention-only and the Llama-shaped model);
            names must differ.
        overwrite: replace a previous build at `out`.
        progress: True (a bar), False / None, or `progress(done, total)` in optimiser steps over
            all specs.

    Returns:
        the manifest: `{"specs": [...], "runs": {name: {"seconds", "checkpoints", "final_loss"}},
        "seconds", "torch"}`.

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
            "seconds": time.perf_counter() - t0,
            "torch": torch.__version__,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        os.chmod(tmp, 0o777 & ~_umask())
        if target.exists():
            check_organism_out(target, overwrite)  # re-check: it may have changed meanwhile
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
