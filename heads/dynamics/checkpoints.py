"""A series of checkpoints: local model folders (or loaded models) ordered by training step.

`find_checkpoints` turns what a user passes into an ordered list of `Checkpoint`s, before any
weight is read:

* a model folder (it holds `config.json`) is one checkpoint;
* a folder without `config.json` whose sub-folders are model folders (`headsteer build
  organism`'s run folders, a Hugging Face `Trainer` output folder) is every one of them;
* a `HeadModel` already loaded is one checkpoint (its step from `steps=`, else its position).

The step of a folder is read, in order, from `headsteer_checkpoint.json` (`step`, `tokens`:
written by the organism recipe), a `Trainer`'s `trainer_state.json` (`global_step`), or the
folder's name (`step-1000`, `step1000` as Pythia's revisions, `checkpoint-1000`, `ckpt_1000`,
`iter-1000`). The series is sorted by step; when no checkpoint names a step (two models to
compare, base and tuned) the given order is kept and the step is the position (0, 1, ...).
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from heads._util.files import short_path
from heads._util.validation import check_int, is_int, read_json_file, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel

__all__ = ["CHECKPOINT_META", "Checkpoint", "find_checkpoints", "fingerprint", "read_step"]

CHECKPOINT_META = "headsteer_checkpoint.json"
"""The metadata file of a checkpoint folder written by headsteer (step, tokens, train_loss)."""
_TRAINER_STATE = "trainer_state.json"
_NAME_STEP = re.compile(r"(?:^|[^a-z])(?:global_step|step|checkpoint|ckpt|iter)[-_]?(\d+)$", re.IGNORECASE)


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a series.

    Attributes:
        name: a short unique label (the folder's name, `model-<i>` for a loaded model).
        step: the training step (or the position when the series names none).
        tokens: tokens seen at `step`, when the metadata says (else None).
        path: the model folder, or None for a loaded model.
        model: the loaded `HeadModel`, or None for a folder (loaded when analysed).
        meta: the metadata file's numbers (e.g. `train_loss`), recorded as scalars.
        step_source: where `step` came from: `"metadata"`, `"trainer_state"`, `"name"`,
            `"given"` (`steps=`) or `"order"`.
    """

    name: str
    step: int
    tokens: int | None = None
    path: Path | None = None
    model: HeadModel | None = field(default=None, compare=False, repr=False)
    meta: dict = field(default_factory=dict, compare=False)
    step_source: str = "metadata"

    def describe(self) -> dict:
        """The JSON-ready identity of the checkpoint (name, step, tokens, path)."""
        return {
            "name": self.name,
            "step": self.step,
            "tokens": self.tokens,
            "path": None if self.path is None else str(self.path),
        }


_HEADER_CAP = 1 << 28  # a safetensors header is a few kB to MB; more is a damaged file


def _header_digest(path: Path) -> str:
    """sha256 of a safetensors file's header (its 8-byte length and the JSON after it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        head = f.read(8)
        h.update(head)
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            h.update(f.read(min(n, _HEADER_CAP)))
    return h.hexdigest()


def _folder_fingerprint(folder: Path) -> str:
    h = hashlib.sha256()
    cfg = folder / "config.json"
    if cfg.is_file():
        h.update(b"config.json\0" + cfg.read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0{_header_digest(f)}\0".encode())
    return "files:" + h.hexdigest()[:32]


def _model_fingerprint(model: HeadModel) -> str:
    import torch

    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.model.named_parameters():
            x = p.detach()
            if x.device.type == "meta":
                sums = "meta"
            else:
                x = x.to(torch.float64)
                sums = f"{float(x.sum())!r},{float((x * x).sum())!r}"
            h.update(f"{name}\0{tuple(p.shape)}\0{p.dtype}\0{sums}\0".encode())
    return "params:" + h.hexdigest()[:32]


def fingerprint(c: Checkpoint) -> str:
    """A fingerprint of a checkpoint's weights, cheap to take: for a folder, `config.json`'s bytes
    and each `*.safetensors` file's name, size, modification time (ns) and header hash (the
    weights themselves are not read); for a loaded model, each parameter's name, shape, dtype and
    float64 sum and sum of squares. Retraining a checkpoint in place (or passing another model at
    the same step) changes it; it is part of a results folder's identity
    (`heads.dynamics.over_checkpoints`).

    Returns:
        `"files:<hex>"` or `"params:<hex>"` (32 hex digits of sha256).
    """
    if c.model is not None:
        return _model_fingerprint(c.model)
    if c.path is None:
        raise HeadsteerValueError(f"checkpoint {c.name!r} has neither a folder nor a model")
    return _folder_fingerprint(c.path)


def _is_model_folder(p: Path) -> bool:
    return (p / "config.json").is_file()


def read_step(folder: str | os.PathLike) -> tuple[int | None, int | None, dict, str]:
    """`(step, tokens, numbers, source)` of a checkpoint folder (see the module docstring); step
    None when nothing names one.

    Raises:
        HeadsteerValueError: a metadata file that is not valid JSON, or whose step is not an int >= 0.
    """
    p = Path(folder)
    meta = p / CHECKPOINT_META
    if meta.is_file():
        data = read_json_file(meta)
        if not isinstance(data, dict):
            raise HeadsteerValueError(f"{short_path(meta)} is not a JSON object")
        step = data.get("step")
        tokens = data.get("tokens")
        if not is_int(step) or step < 0 or (tokens is not None and (not is_int(tokens) or tokens < 0)):
            raise HeadsteerValueError(
                f"{short_path(meta)}: step and tokens must be ints >= 0, got step={short_repr(step)}, "
                f"tokens={short_repr(tokens)}"
            )
        numbers = {
            k: float(v)
            for k, v in data.items()
            if k not in ("step", "tokens") and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        return int(step), None if tokens is None else int(tokens), numbers, "metadata"
    state = p / _TRAINER_STATE
    if state.is_file():
        data = read_json_file(state)
        step = data.get("global_step") if isinstance(data, dict) else None
        if is_int(step) and step >= 0:
            return int(step), None, {}, "trainer_state"
    m = _NAME_STEP.search(p.name)
    if m:
        return int(m.group(1)), None, {}, "name"
    return None, None, {}, "order"


def _expand(item: Any, where: str) -> list[tuple[str, Path | None, HeadModel | None]]:
    if isinstance(item, HeadModel):
        return [("", None, item)]
    if not isinstance(item, (str, os.PathLike)):
        raise HeadsteerTypeError(
            f"{where} must be a model folder, a folder of checkpoint folders or a HeadModel, got "
            f"{type(item).__name__}"
        )
    p = Path(item).expanduser()
    if not str(item).strip() or not p.exists():
        raise HeadsteerValueError(f"{where}: no such folder {short_path(p)}")
    if not p.is_dir():
        raise HeadsteerValueError(f"{where}: {short_path(p)} is not a folder")
    if _is_model_folder(p):
        return [(p.name, p, None)]
    subs = sorted(q for q in p.iterdir() if q.is_dir() and _is_model_folder(q))
    if not subs:
        raise HeadsteerValueError(
            f"{where}: {short_path(p)} is neither a model folder (no config.json) nor a folder of them"
        )
    return [(q.name, q, None) for q in subs]


def find_checkpoints(checkpoints: Any, *, steps: Sequence[int] | None = None) -> list[Checkpoint]:
    """The ordered series of checkpoints in `checkpoints` (nothing is loaded).

    Args:
        checkpoints: a folder or `HeadModel`, or a sequence of them, or a mapping
            `{label: folder or HeadModel}` (the labels name the checkpoints). See the module
            docstring for what a folder may be.
        steps: one step per checkpoint found, in the order found, overriding the metadata
            (ints >= 0, distinct); default None.

    Returns:
        the checkpoints sorted by step (ties refused); the given order with steps 0, 1, ... when
        none names a step.

    Raises:
        HeadsteerValueError: a missing folder, a folder with no model in it, an empty series, two
            checkpoints at the same step, some checkpoints with a step and some without, `steps`
            of the wrong length or with repeats, a label given twice.
        HeadsteerTypeError: an item of another type.
    """
    if isinstance(checkpoints, Mapping):
        items = [(str(k), v) for k, v in checkpoints.items()]
    elif isinstance(checkpoints, (str, os.PathLike, HeadModel)):
        items = [("", checkpoints)]
    elif isinstance(checkpoints, Sequence):
        items = [("", v) for v in checkpoints]
    else:
        raise HeadsteerTypeError(
            f"checkpoints must be folders, HeadModels or a {{label: folder}} mapping, got "
            f"{type(checkpoints).__name__}"
        )
    if not items:
        raise HeadsteerValueError("checkpoints is empty: give at least one model folder")
    found: list[tuple[str, Path | None, HeadModel | None]] = []
    for i, (label, item) in enumerate(items):
        where = f"checkpoints[{label!r}]" if label else f"checkpoints[{i}]"
        parts = _expand(item, where)
        if label:
            parts = [(label if len(parts) == 1 else f"{label}/{n}", p, m) for n, p, m in parts]
        found += parts
    if steps is not None:
        if isinstance(steps, (str, bytes)) or not isinstance(steps, Sequence) or len(steps) != len(found):
            raise HeadsteerValueError(
                f"steps must give one int per checkpoint ({len(found)} found), got {short_repr(steps)}"
            )
        given = [check_int(f"steps[{i}]", s, lo=0) for i, s in enumerate(steps)]
        if len(set(given)) != len(given):
            raise HeadsteerValueError(f"steps repeat a value: {short_repr(list(given))}")
    out: list[Checkpoint] = []
    for i, (name, path, model) in enumerate(found):
        step, tokens, meta, source = (None, None, {}, "order") if path is None else read_step(path)
        if steps is not None:
            step, source = given[i], "given"
        label = name or (f"{i}:{model.name}" if model is not None and model.name else f"model-{i}")
        out.append(Checkpoint(label, -1 if step is None else step, tokens, path, model, meta, source))
    with_step = [c for c in out if c.step_source != "order"]
    if with_step and len(with_step) != len(out):
        lost = next(c for c in out if c.step_source == "order")
        raise HeadsteerValueError(
            f"checkpoint {lost.name!r} names no step while others do: write {CHECKPOINT_META}, name the "
            "folder step-N, or pass steps="
        )
    if not with_step:
        out = [Checkpoint(c.name, i, c.tokens, c.path, c.model, c.meta, "order") for i, c in enumerate(out)]
    out.sort(key=lambda c: c.step)
    for a, b in zip(out, out[1:], strict=False):
        if a.step == b.step:
            raise HeadsteerValueError(f"checkpoints {a.name!r} and {b.name!r} are both at step {a.step}")
    names = [c.name for c in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise HeadsteerValueError(
            f"two checkpoints are named {dup!r}: label them with a {{label: folder}} mapping"
        )
    return out
