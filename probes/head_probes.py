"""Per-head linear probes (scikit-learn) on each head's output, and ITI fitted from them.

Three steps, after Li et al. 2023, "Inference-Time Intervention: Eliciting Truthful Answers
from a Language Model" (ITI, arXiv:2306.03341, §3.1-3.2):

1. `collect_head_outputs`: each head's output (its slice of the `o_proj` input, `z`) at one
   position per prompt, `[N, L, H, d]`, recorded by a head-output edit in the engine (the model
   is not changed). Above `max_bytes` the array streams into a memory-mapped file on disk.
2. `fit_head_probes`: one classifier per head (logistic regression by default), stratified
   K-fold held-out accuracy and ROC AUC with 95% intervals, the probe direction (from a fit on
   all rows) and the mass-mean direction, and the activations' standard deviation along each.
3. `fit_iti`: probes on a task's train split -> `steer.Iti` on the top-k heads.

Step 2 lives in `probes.head_probe_fit` and the probe data in `probes.datasets.probe_tasks`;
their names are importable from here.

Probe data for the shipped sets (`probe_data`):

- `"harmful"`: harmful (label 1) vs harmless (label 0) requests (`probes.datasets.requests`), chat
  template applied, last prompt token.
- `"sentiment"`: the sentiment task's query review, positive (1) vs negative (0), last prompt
  token (the few-shot prompt stops at "Sentiment:").
- `"counterfact"`: "the answer comes from the context" (1) vs "from memory" (0). Every
  counterfact prompt states an old fact ("Previously, ...") and the current one
  ("Currently, ..."); the row pair of one example is the prompt followed by the current
  (context) answer, label 1, and by the previous (memory-like, superseded) answer, label 0,
  recorded at the answer's last token. Both rows share the prompt, so the probe cannot read the
  label off the prompt; the two rows of an example share a CV group (`groups`), so they never
  sit on both sides of a fold. This is the same "answer-conditioned" design as ITI's
  true/false answers.
- `"sentiment_answer"`: the same design on sentiment: prompt + the right label (1) vs prompt +
  the wrong one (0). `fit_iti` uses the answer-conditioned design on every choice task, so the
  direction points from wrong to right answers.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from heads import EncodedPrompts, HeadModel, encode_prompts, forward
from heads._util.files import check_output
from heads._util.progress import Progress, ProgressArg, progress_callback
from heads._util.validation import check_int, check_number, is_int, short_repr
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, HeadOutputEdit
from heads.errors import HeadsteerValueError
from probes.datasets.probe_tasks import PROBE_TASKS, ProbeData, _answer_rows, probe_data
from probes.head_probe_fit import _Z95 as _Z95  # re-exported (the interval test reads it here)
from probes.head_probe_fit import ProbeResult, fit_head_probes

if TYPE_CHECKING:
    from steer.iti import Iti

__all__ = [
    "PROBE_TASKS",
    "ProbeData",
    "ProbeResult",
    "collect_head_outputs",
    "fit_head_probes",
    "fit_iti",
    "probe_data",
]


MAX_BYTES = 1 << 30
"""Default size above which `collect_head_outputs` streams into a memory-mapped file (1 GiB)."""


# --------------------------------------------------------------------------- collection
@dataclass(eq=False, repr=False)
class _HeadOutputRecorder(HeadOutputEdit):
    """Reads every head's output at chosen positions; returns `z` unchanged.

    `select[b]` is a `[P]` float weight row over positions (one-hot for one position, uniform
    over a span for a mean); `value` gets `[B, H, d]` fp32 after the call.
    """

    select: torch.Tensor | None = None
    index: torch.Tensor | None = None  # [B] positions when every row is one-hot (a cheap gather)
    value: torch.Tensor | None = field(default=None, init=False)

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        if self.index is not None:
            rows = torch.arange(z.shape[0], device=z.device)
            self.value = z[rows, self.index.to(z.device)].float().cpu()
        else:
            select = cast(torch.Tensor, self.select)  # given whenever `index` is not
            w = select.to(device=z.device, dtype=torch.float32)
            self.value = torch.einsum("bt,bthd->bhd", w, z.float()).cpu()
        return z


PositionSpec = str | int | Callable


def _weights(enc: EncodedPrompts, position: PositionSpec) -> torch.Tensor:
    """`[B, P]` fp32 weights over positions for one encoded batch (rows sum to 1)."""
    batch, length = enc.input_ids.shape
    w = torch.zeros(batch, length)
    if position == "last":
        w[:, -1] = 1.0
        return w
    if position == "span":
        mask = enc.span_mask().float()
        empty = [b for b in range(batch) if mask[b].sum() == 0]
        if empty:
            raise HeadsteerValueError(
                f"position='span' needs an emphasized span in every prompt; row {empty[0]} has none"
            )
        mean: torch.Tensor = mask / mask.sum(1, keepdim=True)
        return mean
    if is_int(position):
        real = enc.attention_mask.sum(1)
        for b in range(batch):
            n = int(real[b])
            p = int(position) if position >= 0 else n + int(position)
            if not 0 <= p < n:
                raise HeadsteerValueError(f"position {position} is outside prompt {b} ({n} tokens)")
            w[b, length - n + p] = 1.0
        return w
    if callable(position):
        out = position(enc)
        out = torch.as_tensor(out)
        if out.dtype == torch.bool and tuple(out.shape) == (batch, length):
            if not out.any(1).all():
                raise HeadsteerValueError("the position function returned a row with no position")
            out = out.float()
            return out / out.sum(1, keepdim=True)
        if out.dtype in (torch.int32, torch.int64) and tuple(out.shape) == (batch,):
            if (out < 0).any() or (out >= length).any():
                raise HeadsteerValueError(
                    f"the position function returned positions outside 0..{length - 1}: {out}"
                )
            w[torch.arange(batch), out.long()] = 1.0
            return w
        raise HeadsteerValueError(
            f"the position function must return [B] int positions or a [B, P] bool mask "
            f"(B={batch}, P={length}), got {out.dtype} {tuple(out.shape)}"
        )
    raise HeadsteerValueError(
        f"position must be 'last', 'span', an int or a callable, got {short_repr(position)}"
    )


@torch.no_grad()
def collect_head_outputs(
    model: HeadModel,
    prompts: Sequence,
    position: PositionSpec = "last",
    *,
    batch_size: int = 16,
    chat: bool | None = None,
    markup: bool = False,
    emphasize: Sequence | None = None,
    max_bytes: int = MAX_BYTES,
    path: str | os.PathLike | None = None,
    overwrite: bool = False,
    progress: ProgressArg = True,
) -> torch.Tensor:
    """Each head's output (`o_proj` input slice `z`) at one position per prompt.

    Args:
        model: a `HeadModel` with a tokenizer.
        prompts: N prompts (strings or chats, as `heads.encode_prompts` takes).
        position: `"last"` (the last prompt token, default), `"span"` (the mean over each
            prompt's emphasized tokens: `emphasize` or `**markup**`), an int (a token index
            within each prompt's real tokens; negative counts from the end, -1 = "last"), or a
            callable `fn(enc) -> [B] long positions | [B, P] bool mask` on each encoded,
            left-padded batch (padded coordinates; a mask averages its positions).
        batch_size: prompts per forward (default 16). Prompts are grouped by length to keep
            padding small; the output keeps the input order.
        chat: apply the chat template (default: when the tokenizer has one).
        markup: parse `**…**` in prompts (default False: texts are read verbatim).
        emphasize: spans per prompt for `position="span"` (see `encode_prompts`).
        max_bytes: above `N*L*H*d*4` bytes of this (default 1 GiB) the result streams into a
            float32 `numpy.memmap` on disk; the returned tensor shares its memory.
        path: file for the memmap (default: an anonymous temporary file, deleted once the
            tensor is freed). Refused if it exists unless `overwrite`. The data goes to a
            temporary file beside it (blocks reserved up front), renamed over `path` only when
            every batch is written: an interrupted or failed run leaves `path` (and a previous
            file there) untouched.
        overwrite: allow replacing `path`.
        progress: True (default: a tqdm bar), False / None (off) or `progress(done, total)`
            after each batch (`heads._util.progress`), in prompts: `total` is N.

    Returns:
        fp32 tensor `[N, L, H, d]` (CPU; memmap-backed above `max_bytes`). The model is used
        read-only: one forward per batch (`logits_to_keep=1`) with a recording edit per layer.

    Raises:
        ValueError: no prompts, a bad `batch_size`/`max_bytes`/`position`, an empty prompt, a
            prompt without a span for `"span"`, an existing `path` without `overwrite`, a folder
            that cannot be written, or not enough free space for `N*L*H*d*4` bytes.

    Source: ITI (Li et al. 2023) §3.1 probes each head's output at the answer's last token.
    """
    if not isinstance(model, HeadModel) or model.tokenizer is None:
        raise HeadsteerValueError(
            "collect_head_outputs needs a HeadModel with a tokenizer (heads.load_model)"
        )
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise HeadsteerValueError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise HeadsteerValueError("prompts is empty")
    check_int("batch_size", batch_size, lo=1)
    check_int("max_bytes", max_bytes, lo=0, what="a non-negative int")
    if not (position in ("last", "span") or callable(position) or isinstance(position, numbers.Integral)):
        raise HeadsteerValueError(
            f"position must be 'last', 'span', an int or a callable, got {short_repr(position)}"
        )
    if isinstance(position, bool):
        raise HeadsteerValueError(
            f"position must be 'last', 'span', an int or a callable, got {short_repr(position)}"
        )
    n = len(prompts)
    emph_rows = None
    if emphasize is not None:
        if not isinstance(emphasize, Sequence) or len(emphasize) != n:
            raise HeadsteerValueError(
                f"emphasize must hold one entry per prompt ({n}), got {short_repr(emphasize)}"
            )
        emph_rows = list(emphasize)
    shape = (n, model.n_layers, model.n_heads, model.d_head)
    nbytes = 4 * math.prod(shape)
    target = check_output(path, overwrite=overwrite) if path is not None else None
    tmp: str | None = None
    if nbytes > max_bytes or path is not None:
        folder = str(target.parent) if target is not None else tempfile.gettempdir()
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
        _check_space(folder, nbytes)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{target.name}." if target is not None else "headsteer-acts-", suffix=".tmp", dir=folder
        )
        try:
            _reserve(fd, nbytes, folder)
            os.close(fd)
            arr = np.memmap(tmp, dtype=np.float32, mode="r+", shape=shape)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            os.unlink(tmp)
            raise
        if target is None:
            os.unlink(tmp)  # the mapping keeps the data; the file goes when the tensor is freed
            tmp = None
        out = torch.from_numpy(arr)
    else:
        arr = None
        out = torch.empty(shape, dtype=torch.float32)
    order = sorted(range(n), key=lambda i: len(str(prompts[i])))
    try:
        with progress_callback(progress, "head outputs", "prompts") as report:

            def encode(idx: list[int]) -> EncodedPrompts:
                return encode_prompts(
                    model.tokenizer,
                    [prompts[i] for i in idx],
                    emphasize=None if emph_rows is None else [emph_rows[i] for i in idx],
                    chat=chat,
                    markup=markup,
                )

            _collect(model, encode, position, order, batch_size, out, report)
        if arr is not None:
            arr.flush()
        if tmp is not None and target is not None:
            check_output(target, overwrite=overwrite)  # still ours to replace (no symlink appeared)
            os.replace(tmp, target)  # only now is a previous file replaced
            tmp = None
    finally:
        if tmp is not None:  # interrupted or failed: the user's path is untouched
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return out


def _check_space(folder: str, nbytes: int) -> None:
    """ValueError when `folder`'s file system has less than `nbytes` free (checked up front)."""
    free = shutil.disk_usage(folder).free
    if free < nbytes:
        raise HeadsteerValueError(
            f"the activations need {nbytes / 2**20:.1f} MiB but {folder} has {free / 2**20:.1f} MiB free: "
            "free space, pass another path=, or fewer prompts"
        )


def _reserve(fd: int, nbytes: int, folder: str) -> None:
    """Allocate the file's blocks now, so writing through the memmap can never fault (SIGBUS) on
    a full disk; a failure is a `ValueError` naming the folder."""
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:  # pragma: no cover - macOS / Windows: sparse, but sized
            os.ftruncate(fd, nbytes)
    except OSError as exc:
        raise HeadsteerValueError(
            f"cannot reserve {nbytes / 2**20:.1f} MiB for the activations in {folder}: {exc.strerror or exc}"
        ) from None


def _collect(
    model: HeadModel,
    encode: Callable[[list[int]], EncodedPrompts],
    position: PositionSpec,
    order: list[int],
    batch_size: int,
    out: torch.Tensor,
    report: Progress | None,
) -> None:
    """Fill `out` `[N, L, H, d]` batch by batch (see `collect_head_outputs`); `encode(idx)` encodes
    the prompts at the indices `idx` of `order`'s batch."""
    n = len(order)
    for a in range(0, n, batch_size):
        idx = order[a : a + batch_size]
        enc = encode(idx)
        w = _weights(enc, position)
        index = w.argmax(1) if bool((w.max(1).values == 1).all()) else None
        recs = [_HeadOutputRecorder(layer=la, select=w, index=index) for la in range(model.n_layers)]
        with editing(model, recs):
            forward(model, enc, logits_to_keep=1)
        values = [cast(torch.Tensor, r.value) for r in recs]  # each set by the forward
        out[torch.tensor(idx)] = torch.stack(values, dim=1)
        if report is not None:
            report(min(a + batch_size, n), n)


def fit_iti(
    model: HeadModel,
    task: str,
    *,
    k: int = 16,
    alpha: float = 15.0,
    direction: str = "mass_mean",
    cv: int = 5,
    seed: int = 0,
    batch_size: int = 16,
    limit: int | None = None,
) -> Iti:
    """`steer.Iti` fitted on the train split of a choice task (never its test split).

    Rows: each train prompt followed by each choice, label 1 for the right one (the
    answer-conditioned design of `probe_data`), recorded at the last token. Heads: the `k`
    best by held-out probe accuracy (grouped stratified CV); shift `alpha * sigma * direction`.

    Raises:
        ValueError: an unknown task or a task without choices, or bad k / alpha / direction.

    Source: ITI (Li et al. 2023) §3.2, with the mass-mean direction by default (their best).
    """
    from probes.datasets.tasks import load_task
    from steer.iti import Iti

    if (
        isinstance(k, bool)
        or not isinstance(k, numbers.Integral)
        or not 1 <= k <= model.n_layers * model.n_heads
    ):
        raise HeadsteerValueError(
            f"k must be an int in 1..{model.n_layers * model.n_heads}, got {short_repr(k)}"
        )
    check_number("alpha", alpha)
    if direction not in ("mass_mean", "probe"):
        raise HeadsteerValueError(f"direction must be 'mass_mean' or 'probe', got {short_repr(direction)}")
    examples = load_task(task, "train").examples[:limit]
    if examples[0].choices is None:
        raise HeadsteerValueError(
            f"ITI needs a choice task (counterfact, sentiment, occupation), got {short_repr(task)}"
        )
    prompts, labels, groups = _answer_rows(examples)
    acts = collect_head_outputs(model, prompts, "last", batch_size=batch_size, chat=examples[0].chat)
    result = fit_head_probes(
        acts, labels, cv=cv, seed=seed, groups=groups, model=model.name, n_kv_heads=model.n_kv_heads
    )
    return Iti.from_probes(result, k=k, alpha=alpha, direction=direction)
