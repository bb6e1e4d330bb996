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
from typing import Any

import numpy as np
import torch

from heads import EncodedPrompts, HeadModel, encode_prompts, forward
from heads._util.files import check_output
from heads._util.progress import ProgressArg, progress_callback
from heads._util.validation import check_int, check_number, is_int, short_repr
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, HeadOutputEdit
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.scores import HeadScores
from probes.metrics.tasks import wilson_interval

__all__ = [
    "PROBE_TASKS",
    "ProbeData",
    "ProbeResult",
    "collect_head_outputs",
    "fit_head_probes",
    "fit_iti",
    "probe_data",
]

PROBE_TASKS = ("harmful", "sentiment", "counterfact", "sentiment_answer")

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
            w = self.select.to(device=z.device, dtype=torch.float32)
            self.value = torch.einsum("bt,bthd->bhd", w, z.float()).cpu()
        return z


PositionSpec = str | int | Callable


def _weights(enc, position: PositionSpec) -> torch.Tensor:
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
        return mask / mask.sum(1, keepdim=True)
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
    emphasize=None,
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


def _collect(model, encode, position, order, batch_size, out, report) -> None:
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
        out[torch.tensor(idx)] = torch.stack([r.value for r in recs], dim=1)
        if report is not None:
            report(min(a + batch_size, n), n)


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


def _scores(est, x: np.ndarray) -> np.ndarray:
    if hasattr(est, "decision_function"):
        s = est.decision_function(x)
    else:
        s = est.predict_proba(x)[:, 1]
    return np.asarray(s, dtype=np.float64).reshape(-1)


def _fit_heads(acts, heads, y, folds, estimator, seed) -> list[dict]:
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
        accuracy_low, accuracy_high: `[L, H]` 95% Wilson interval of the accuracy.
        auc_low, auc_high: `[L, H]` 95% Hanley-McNeil interval of the AUC.
        probe_directions: `[L, H, d]` unit normal of each head's probe (fit on all rows),
            pointing to label 1; NaN for an estimator without `coef_`.
        mass_mean_directions: `[L, H, d]` unit vector mean(label 1) - mean(label 0).
        probe_sigma, mass_mean_sigma: `[L, H]` std of the activations projected on each
            direction (the sigma of ITI's shift alpha * sigma * direction).
        n, n_positive: rows and rows with label 1.
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
        return getattr(self, by).ranked(k)

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


def _as_array(acts) -> np.ndarray:
    if isinstance(acts, torch.Tensor):
        return acts.detach().cpu().float().numpy()
    if isinstance(acts, np.ndarray):
        return acts
    raise HeadsteerValueError(
        f"acts must be a torch tensor or numpy array [N, L, H, d], got {type(acts).__name__}"
    )


def fit_head_probes(
    acts,
    labels,
    *,
    cv: int = 5,
    seed: int = 0,
    estimator=None,
    n_jobs: int | None = 1,
    groups=None,
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
        model, n_kv_heads = model.name, model.n_kv_heads if n_kv_heads is None else n_kv_heads
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


# --------------------------------------------------------------------------- shipped data
@dataclass
class ProbeData:
    """Prompts and labels for one probe task (`probe_data`).

    Attributes:
        name: one of `PROBE_TASKS`.
        prompts: N prompt texts (or chats).
        labels: N labels, 0/1.
        groups: N group ids (the example each row came from).
        chat: whether prompts go through the chat template.
        description: what label 1 and label 0 mean.
    """

    name: str
    prompts: list
    labels: list[int]
    groups: list[int]
    chat: bool
    description: str


def _answer_rows(examples) -> tuple[list[str], list[int], list[int]]:
    prompts, labels, groups = [], [], []
    for g, e in enumerate(examples):
        for i, choice in enumerate(e.choices):
            prompts.append(e.prompt + " " + choice)
            labels.append(int(i == e.label))
            groups.append(g)
    return prompts, labels, groups


def probe_data(name: str, split: str = "train", limit: int | None = None) -> ProbeData:
    """Prompts and labels for a shipped probe task (see the module docstring for the labelling).

    Args:
        name: "harmful", "sentiment", "counterfact" or "sentiment_answer".
        split: "train" (default) or "test" ("validation" too, except for "harmful", whose
            files have only train/test).
        limit: at most `limit` examples (harmful: per class; answer tasks: examples, two rows
            each); default all.

    Raises:
        ValueError: unknown name or split, or a bad limit.
    """
    from probes.datasets.requests import load_requests
    from probes.datasets.tasks import load_task

    if name not in PROBE_TASKS:
        raise HeadsteerValueError(f"unknown probe task {short_repr(name)}: use one of {PROBE_TASKS}")
    if limit is not None and (not is_int(limit) or limit < 1):
        raise HeadsteerValueError(f"limit must be a positive int, got {short_repr(limit)}")
    if name == "harmful":
        if split not in ("train", "test"):
            raise HeadsteerValueError(
                f"the request sets have splits 'train' and 'test', got {short_repr(split)}"
            )
        bad = load_requests("harmful", split)[:limit]
        good = load_requests("harmless", split)[:limit]
        prompts = [[{"role": "user", "content": r["prompt"]}] for r in bad + good]
        labels = [1] * len(bad) + [0] * len(good)
        return ProbeData(name, prompts, labels, list(range(len(prompts))), True, "1 = harmful, 0 = harmless")
    task = "sentiment" if name.startswith("sentiment") else "counterfact"
    examples = load_task(task, split).examples[:limit]
    if name == "sentiment":
        prompts = [e.prompt for e in examples]
        labels = [int(e.choices[e.label] == "positive") for e in examples]
        return ProbeData(
            name, prompts, labels, list(range(len(prompts))), False, "1 = positive review, 0 = negative"
        )
    prompts, labels, groups = _answer_rows(examples)
    what = (
        "1 = answer from the context (current fact), 0 = from memory (previous fact)"
        if task == "counterfact"
        else "1 = right sentiment label, 0 = wrong label"
    )
    return ProbeData(name, prompts, labels, groups, False, what)


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
):
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
