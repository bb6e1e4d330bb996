"""Attention Lens: one trained map per head from its output to the vocabulary (Sakarvadia et al.
2023, arXiv:2310.16270), in the tuned-lens form by default (Belrose et al. 2023, arXiv:2303.08112).

Head (l, h) writes `o_h(t) = z_h(t) W_O^h` (`[D]`) into the residual stream at position t. Its
lens reads that contribution as next-token logits:

* `form="tuned"` (default): `logits_h(t) = norm_f(A_h o_h(t) + b_h) W_U`, A_h `[D, D]`
  initialised to the identity and b_h to 0, `norm_f` and `W_U` the model's own final norm and
  unembedding (frozen). Untrained (A = I) it is the "direct" projection of the head's output.
* `form="full"`: the paper's lens, `logits_h(t) = o_h(t) W_h + c_h`, W_h `[D, V]` initialised
  from `W_U`, c_h = 0. At V = 49,152 that is 28 M parameters a head (7.6 G for SmolLM2's 270
  heads), so it is offered for a few heads (`MAX_FULL_HEADS`). The paper's code also sums the
  lenses of a layer's heads and trains on the last position only; here every head has its own
  lens and every real position is a training example.

Training minimises `KL(p_model(t) || softmax(logits_h(t)))` (the model's own next-token
distribution as the target, the paper's loss) with Adam over the positions of a text corpus,
seeded; positions are split into train and held-out sets once (`held_out` share, by whole
texts); after each epoch the held-out KL of every head is measured and its best state kept;
training stops when no head improved for `patience` epochs. With `checkpoint=` the state
(lens, Adam moments, epoch, best states, history) is written after every epoch and a later
call with the same path resumes from it (same result as an uninterrupted run: the shuffle of
epoch e is seeded by (seed, e)).

Files: safetensors with a JSON header (`metadata["headsteer"]`: schema, model name and
geometry, heads, form, training parameters, held-out KL) written atomically through
`heads._util.files`; `AttentionLens.load(path, model)` refuses a file made for another model, and
any file whose header or tensors do not hold together (heads outside the geometry, shapes of
another form or head count, NaN / inf weights).

This module trains (`train_lens`) and exports the lens' public names; the `AttentionLens` object
and its file live in `heads.scorers.roles.attention_lens`, the training data in
`heads.scorers.roles.lens_data`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from heads._util.progress import progress_callback
from heads._util.validation import check_path, short_repr
from heads.engine.options import SweepOptions, sweep_options
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.results.scores import HeadSpec
from heads.scorers.request_base import expand_layers
from heads.scorers.roles.attention_lens import (
    LENS_SCHEMA,
    MAX_FULL_HEADS,
    AttentionLens,
    Form,
    _apply,
    _kl,
    _read,
)
from heads.scorers.roles.attention_lens import (
    LENS_SCHEMA_VERSION as LENS_SCHEMA_VERSION,  # re-exported: the old import path
)
from heads.scorers.roles.lens_data import LensData, _check_data, _texts, collect_lens_data
from heads.scorers.roles.request import MAX_EPOCHS, MAX_LR, LensTrainRequest

__all__ = [
    "LENS_SCHEMA",
    "MAX_EPOCHS",
    "MAX_FULL_HEADS",
    "MAX_LR",
    "AttentionLens",
    "LensData",
    "collect_lens_data",
    "run_train_lens",
    "train_lens",
]


_CHECKPOINT_TENSORS = ("current_weight", "current_bias", "best_kl", "adam_step", "m_w", "v_w", "m_b", "v_b")
_RESUME_PARAMS = ("lr", "batch_positions", "held_out", "max_positions", "seed")
"""Training parameters a resumed run must share with its checkpoint (epochs and patience may differ)."""


def _read_checkpoint(
    checkpoint: str, lens: AttentionLens, params: dict
) -> tuple[AttentionLens, dict[str, torch.Tensor]]:
    """A checkpoint of `lens`'s model, heads and form, written with the same training parameters."""
    ck, extra = _read(checkpoint)
    if (
        ck.model != lens.model
        or ck.geometry != lens.geometry
        or ck.heads != lens.heads
        or ck.form != lens.form
    ):
        raise HeadsteerValueError(f"checkpoint {checkpoint!r} is for other heads, form or model")
    missing = [k for k in _CHECKPOINT_TENSORS if k not in extra]
    state = ck.params.get("state")
    if (
        missing
        or not isinstance(state, dict)
        or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for v in (state.get("epoch"), state.get("stale"))
        )
    ):
        raise HeadsteerValueError(
            f"checkpoint {checkpoint!r} is a lens file, not a train_lens checkpoint "
            f"(missing {missing or 'state'})"
        )
    for k in ("current_weight", "m_w", "v_w"):
        if extra[k].shape != ck.weight.shape:
            raise HeadsteerValueError(f"checkpoint {checkpoint!r}: {k} is {tuple(extra[k].shape)}")
    for k in ("current_bias", "m_b", "v_b"):
        if extra[k].shape != ck.bias.shape:
            raise HeadsteerValueError(f"checkpoint {checkpoint!r}: {k} is {tuple(extra[k].shape)}")
    if tuple(extra["best_kl"].shape) != (len(ck.heads),) or extra["adam_step"].numel() != 1:
        raise HeadsteerValueError(f"checkpoint {checkpoint!r}: best_kl or adam_step has the wrong shape")
    for k in _CHECKPOINT_TENSORS:
        if not extra[k].dtype.is_floating_point or not bool(torch.isfinite(extra[k]).all()):
            raise HeadsteerValueError(f"checkpoint {checkpoint!r}: {k} is not a finite float tensor")
    differ = [k for k in _RESUME_PARAMS if ck.params.get(k) != params[k]]
    if differ:
        raise HeadsteerValueError(
            f"checkpoint {checkpoint!r} was written with other {', '.join(differ)} "
            f"({', '.join(f'{k}={short_repr(ck.params.get(k))}' for k in differ)}): resume with the same "
            "values"
        )
    return ck, extra


def train_lens(
    model: HeadModel,
    texts: Sequence[str] | LensData,
    heads: HeadSpec | None = None,
    *,
    form: Form = "tuned",
    epochs: int = 10,
    lr: float = 1e-3,
    batch_positions: int = 128,
    held_out: float = 0.2,
    patience: int = 2,
    max_positions: int = 4096,
    seed: int = 0,
    checkpoint: str | os.PathLike | None = None,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> AttentionLens:
    """Train Attention Lenses for `heads` (default every head) on `texts` (see the module docstring).

    Args:
        texts: a text corpus (plain strings; e.g. `probes.datasets.corpus.load_corpus()`) or
            `LensData` already collected for these heads.
        form: `"tuned"` (default) or `"full"` (at most `MAX_FULL_HEADS` heads).
        epochs: most passes over the training positions (default 10).
        lr: Adam learning rate (default 1e-3).
        batch_positions: positions per Adam step (all heads step together, each its own lens).
        held_out: share of the texts kept out for early stopping and the reported KL (default 0.2).
        patience: epochs without a held-out improvement of any head before stopping (default 2).
        max_positions: real token positions collected from the corpus (default 4096, >= 2).
        seed: seeds the split and every epoch's shuffle (an int in 0..2**32 - 1, default 0).
        checkpoint: a file to write after each epoch and to resume from when it exists (the
            resumed call must use the same lr, batch_positions, held_out, max_positions, seed).
        options: `heads.SweepOptions`; `progress`: True (default: a tqdm bar), False / None,
            or `progress(done, total)` in epochs; `max_memory`: the data collection's texts per
            forward within it (`collect_lens_data`; refused before any forward below one text).
        **deprecated: `progress=` as a keyword (one release; a `DeprecationWarning`; refused
            together with `options.progress` set).

    Every argument is checked before any forward: `epochs` in 1..`MAX_EPOCHS`, `lr` in
    (0, `MAX_LR`], `held_out` in (0, 1), `batch_positions` and `patience` positive ints.

    Returns:
        AttentionLens with the best held-out state of every head, `held_out_kl`, `untrained_kl`,
        and `history`; `params["seconds"]` holds the training time.

    Raises:
        HeadsteerValueError: bad arguments, fewer than 2 texts, LensData of another model or
            heads, or a checkpoint of another model, heads, form or training parameters.
        HeadsteerTypeError: `progress` or `checkpoint` of a wrong type.
    """
    opts = sweep_options(options, deprecated, "train_lens", takes=("progress", "max_memory"))
    request = LensTrainRequest(
        heads=expand_layers(heads, model.n_layers, model.n_heads),  # type: ignore[arg-type]
        form=form,
        epochs=epochs,
        lr=lr,
        batch_positions=batch_positions,
        held_out=held_out,
        patience=patience,
        max_positions=max_positions,
        seed=seed,
    )
    return run_train_lens(model, texts, request, opts, checkpoint=checkpoint)


def run_train_lens(
    model: HeadModel,
    texts: Sequence[str] | LensData,
    request: LensTrainRequest,
    options: SweepOptions | None = None,
    *,
    checkpoint: str | os.PathLike | None = None,
) -> AttentionLens:
    """Run a `LensTrainRequest` on `texts` (what `train_lens` does once it has built the request,
    whose values are checked there; its geometry is checked here against `model`). `options`:
    `progress`, and `max_memory` for the collection's texts per forward (`collect_lens_data`).
    See `train_lens` for `checkpoint`, the result and the errors."""
    if not isinstance(request, LensTrainRequest):
        raise HeadsteerTypeError(f"request must be a LensTrainRequest, got {type(request).__name__}")
    opts = sweep_options(options, {}, "train_lens", takes=("progress", "max_memory"))
    progress = opts.progress
    request.check_config(model)  # heads in range, a full lens of at most MAX_FULL_HEADS heads
    form, epochs, lr, seed = request.form, request.epochs, request.lr, request.seed
    batch_positions, held_out, patience = request.batch_positions, request.held_out, request.patience
    max_positions = request.max_positions
    if checkpoint is not None:
        checkpoint = check_path("checkpoint", checkpoint)
    heads = None if request.heads is None else list(request.heads)
    lens = AttentionLens.init(model, heads, form=form)
    resume_params = {
        "lr": float(lr),
        "batch_positions": batch_positions,
        "held_out": float(held_out),
        "max_positions": max_positions,
        "seed": seed,
    }
    resume = (
        _read_checkpoint(checkpoint, lens, resume_params)
        if checkpoint is not None and Path(checkpoint).is_file()
        else None
    )
    if isinstance(texts, LensData):
        _check_data(model, texts, lens.heads)
        data = texts
        if data.outputs.shape[1] == 0:
            raise HeadsteerValueError("the LensData holds no positions")
        n_texts = int(data.text_index.max()) + 1
    else:
        corpus = _texts(texts)
        n_texts = len(corpus)
        if n_texts < 2:
            raise HeadsteerValueError("a lens needs at least 2 texts (train and held-out)")
        budget = SweepOptions(max_memory=opts.max_memory)  # the collection's texts per forward
        data = collect_lens_data(model, corpus, lens.heads, max_positions=max_positions, options=budget)
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_texts, generator=g)
    n_held = min(max(1, round(held_out * n_texts)), n_texts - 1)
    held_texts = order[:n_held]
    is_held = torch.isin(data.text_index, held_texts)
    idx = [data.heads.index(h) for h in lens.heads]
    o_all = data.outputs[idx]
    train = LensData(
        lens.heads,
        o_all[:, ~is_held],
        data.target_logits[~is_held],
        data.text_index[~is_held],
        data.token_ids[~is_held],
    )
    held = LensData(
        lens.heads,
        o_all[:, is_held],
        data.target_logits[is_held],
        data.text_index[is_held],
        data.token_ids[is_held],
    )
    if train.outputs.shape[1] == 0 or held.outputs.shape[1] == 0:
        raise HeadsteerValueError("the train / held-out split left one side without positions: add texts")
    dev = model.device
    w = torch.nn.Parameter(lens.weight.clone().to(dev))
    b = torch.nn.Parameter(lens.bias.clone().to(dev))
    opt = torch.optim.Adam([w, b], lr=float(lr))
    start_epoch, history = 0, []
    untrained = lens.kl(model, held, trained=False)
    best = untrained.clone()
    best_w, best_b = lens.weight.clone(), lens.bias.clone()
    stale = 0
    params = {
        "form": form,
        "epochs": epochs,
        "lr": float(lr),
        "batch_positions": batch_positions,
        "held_out": float(held_out),
        "patience": patience,
        "max_positions": max_positions,
        "seed": seed,
        "n_train_positions": int(train.outputs.shape[1]),
        "n_held_out_positions": int(held.outputs.shape[1]),
    }
    if resume is not None:
        ck, extra = resume
        state = ck.params["state"]
        start_epoch, stale, history = int(state["epoch"]), int(state["stale"]), list(ck.history)
        with torch.no_grad():
            w.copy_(extra["current_weight"].to(dev))
            b.copy_(extra["current_bias"].to(dev))
        best_w, best_b, best = ck.weight, ck.bias, extra["best_kl"]
        opt.load_state_dict(
            {
                "state": {
                    0: {
                        "step": extra["adam_step"].clone(),
                        "exp_avg": extra["m_w"].to(dev),
                        "exp_avg_sq": extra["v_w"].to(dev),
                    },
                    1: {
                        "step": extra["adam_step"].clone(),
                        "exp_avg": extra["m_b"].to(dev),
                        "exp_avg_sq": extra["v_b"].to(dev),
                    },
                },
                "param_groups": opt.state_dict()["param_groups"],
            }
        )
    n_train = train.outputs.shape[1]
    with progress_callback(progress, "attention lens", "epochs") as report:
        if report is not None:
            report(start_epoch, epochs)
        for epoch in range(start_epoch, epochs):
            if stale >= patience:
                break
            perm = torch.randperm(
                n_train, generator=torch.Generator().manual_seed(seed * 100_003 + epoch + 1)
            )
            total = 0.0
            for a in range(0, n_train, batch_positions):
                sel = perm[a : a + batch_positions]
                o = train.outputs[:, sel].to(dev)
                t = train.target_logits[sel].to(dev).float()
                loss = (
                    _kl(_apply(model, form, w, b, o), t).mean(-1).sum()
                )  # sum over heads: independent lenses
                opt.zero_grad()
                loss.backward(inputs=[w, b])  # the lens only: the model's norm gets no .grad
                opt.step()
                total += loss.item() * len(sel)
            cur = AttentionLens(
                lens.heads, form, w.detach().cpu(), b.detach().cpu(), lens.model, lens.geometry
            )
            kl = cur.kl(model, held)
            better = kl < best
            best = torch.where(better, kl, best)
            best_w[better], best_b[better] = cur.weight[better], cur.bias[better]
            stale = 0 if bool(better.any()) else stale + 1
            history.append(
                {
                    "epoch": epoch + 1,
                    "train_kl": total / n_train / len(lens.heads),
                    "held_out_kl": float(kl.mean()),
                }
            )
            if checkpoint is not None:
                st = opt.state_dict()["state"]
                ck = AttentionLens(
                    lens.heads,
                    form,
                    best_w,
                    best_b,
                    lens.model,
                    lens.geometry,
                    {**params, "state": {"epoch": epoch + 1, "stale": stale}},
                    history,
                )
                ck.save(
                    checkpoint,
                    overwrite=True,
                    extra={
                        "current_weight": cur.weight,
                        "current_bias": cur.bias,
                        "best_kl": best,
                        "adam_step": st[0]["step"].cpu(),
                        "m_w": st[0]["exp_avg"].cpu(),
                        "v_w": st[0]["exp_avg_sq"].cpu(),
                        "m_b": st[1]["exp_avg"].cpu(),
                        "v_b": st[1]["exp_avg_sq"].cpu(),
                    },
                )
            if report is not None:
                report(epoch + 1, epochs)
    params["seconds"] = time.perf_counter() - t0
    params["epochs_run"] = len(history)
    return AttentionLens(
        lens.heads, form, best_w, best_b, lens.model, lens.geometry, params, history, best.clone(), untrained
    )
