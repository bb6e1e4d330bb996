"""`evaluate_pairs`: accuracy and logit difference on prompt pairs, with or without steering.

The follow-up every causal analysis asks for: after finding heads or a circuit, does ablating
(or boosting) them change the behaviour? `evaluate_pairs(model, pairs, steer=[Ablate(heads)])`
runs the clean prompts (or the corrupted ones) once, with the interventions' engine edits
active, and reads the last position: per pair the logit difference LD = mean answer logit -
mean counterfactual logit (the metric of Wang et al. 2022, Sec. 3, as `metrics.logit_diff`)
and whether the arg-max is an answer token. The `PairEvaluation` holds the accuracy (share of
pairs with LD > 0) with a Wilson interval and the mean LD with a Student-t interval.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from heads._util.validation import check_number, short_repr
from heads.engine.context import editing
from heads.engine.edits import Edit
from heads.engine.forward import forward
from heads.engine.options import SweepOptions, sweep_rows
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.results.evaluation import PairEvaluation
from heads.scorers.patching.metrics import logit_diff
from heads.scorers.patching.pairs import PairBatch, check_vocab

__all__ = ["evaluate_pairs"]


def _steerers(steer: Any) -> list[Any]:
    """`steer` as a list of interventions: objects with `.edits(model, enc)` or engine `Edit`s."""
    items = [steer] if hasattr(steer, "edits") or isinstance(steer, Edit) else steer
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise HeadsteerTypeError(
            "steer must be a list of interventions (e.g. steer.Ablate) or engine edits, got "
            + short_repr(steer)
        )
    out = list(items)
    for s in out:
        if not (hasattr(s, "edits") or isinstance(s, Edit)):
            raise HeadsteerTypeError(
                f"steer entries must have .edits(model, enc) (steer.Ablate, steer.Pasta, ...) or be "
                f"engine edits, got {short_repr(s)}"
            )
    return out


@torch.no_grad()
def evaluate_pairs(
    model: HeadModel,
    pairs: PairBatch,
    *,
    steer: Any = (),
    which: str = "clean",
    level: float = 0.95,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> PairEvaluation:
    """Accuracy and mean logit difference of `model` on `pairs`, optionally steered.

    Args:
        model: the model.
        pairs: a `PairBatch` (`encode_pairs`) with counterfactual tokens (N pairs, width T).
        steer: interventions applied while evaluating: objects with `.edits(model, enc)`
            (`steer.Ablate(circuit.heads)`, `steer.Pasta`, ...) or engine `Edit`s; one or a list
            (default none). Their edits act on every row of each batch, at every position.
        which: `"clean"` (default) or `"corrupted"`: the prompts run.
        level: confidence level of the intervals, in (0, 1) (default 0.95).
        options: `heads.SweepOptions`; `max_rows`: pairs per forward (default 16 where
            `max_rows` is left at its default), fewer where `max_memory` needs it (refused
            before any forward when one pair does not fit).
        **deprecated: `batch_size=` (now `max_rows`) as a keyword (one release; a
            `DeprecationWarning`; refused together with `options.max_rows` set).

    Returns:
        a `PairEvaluation`: per pair `logit_diff [N]` (logits) and `top1 [N]`; `accuracy` (LD > 0)
        with `accuracy_ci` (Wilson), `mean_logit_diff` with `logit_diff_ci` (Student t).

    Raises:
        TypeError: `pairs` not a `PairBatch`; a `steer` entry that is no intervention.
        ValueError: vision pairs, pairs without counterfactual tokens, ids outside the
            vocabulary, an unknown `which`, `batch_size` < 1, `level` outside (0, 1); all before
            any forward. An intervention's own errors (unknown heads, ...) come from its
            `.edits`.

    Source: the logit difference of Wang et al. 2022 (arXiv:2211.00593, Sec. 3); the Wilson
    interval (Wilson 1927) for the accuracy.
    """
    if not isinstance(pairs, PairBatch):
        raise HeadsteerTypeError(f"pairs must be a PairBatch (encode_pairs), got {type(pairs).__name__}")
    if which not in ("clean", "corrupted"):
        raise HeadsteerValueError(f"which must be 'clean' or 'corrupted', got {short_repr(which)}")
    opts = sweep_rows(options, deprecated, "evaluate_pairs", default=16, takes=("max_rows", "max_memory"))
    level = check_number("level", level, lo=0, hi=1, lo_open=True, hi_open=True)
    check_vocab(pairs, model.d_vocab)
    if not pairs.has_counterfactual:
        raise HeadsteerValueError(
            "evaluate_pairs needs counterfactual tokens in every pair (the logit difference is "
            "answer - counterfactual)"
        )
    model.check_length(pairs.width)
    batch_size = opts.within(model, pairs.width).max_rows  # max_memory: rows per forward within it
    steerers = _steerers(steer)
    lds, top1 = [], []
    for start in range(0, pairs.n, batch_size):
        idx = torch.arange(start, min(pairs.n, start + batch_size))
        sub = pairs.select(idx)
        n = sub.n
        enc = EncodedPrompts(
            sub.ids(which), sub.attention_mask, [[] for _ in range(n)], [""] * n, [[] for _ in range(n)]
        )
        edits = [e for s in steerers for e in ([s] if isinstance(s, Edit) else s.edits(model, enc))]
        with editing(model, edits):
            logits = forward(model, enc, logits_to_keep=1).logits[:, -1].float().cpu()
        rows = torch.arange(n)
        lds.append(logit_diff(logits, sub, rows))
        best = logits.argmax(-1)
        top1.append(((sub.answers == best[:, None]) & sub.answer_mask).any(-1))
    return PairEvaluation(
        torch.cat(lds),
        torch.cat(top1),
        which=which,
        steer=[repr(s) for s in steerers],
        level=level,
        params={"model": model.name, "batch_size": batch_size},
    )
