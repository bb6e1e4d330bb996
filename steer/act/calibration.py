"""ACT head filtering (docs/methods/act.md): calibrate one head at a time, keep the heads that help.

For every candidate head (default: all heads of layers 2..L-2) ACT is applied to that head
alone and a choice task is scored from last-position log-probs (the argmax over each choice's
first token). Heads are packed one per batch row on the shared variant engine
(`heads.engine.variants`), which starts each batch at its heads' layer from the clean residual stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from heads._util.progress import progress_callback
from heads._util.validation import check_number, is_int, short_repr
from heads.engine.edits import Edit
from heads.engine.executors import run_head_shards
from heads.engine.options import SweepOptions, sweep_options
from heads.engine.variants import check_heads, clean_run, evaluate_variants, row_head_masks
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import encode_prompts, normalize_prompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores, HeadSet, HeadSpec
from heads.results.views import html_view, top_heads_text
from heads.scorers.safety.common import merge_scores
from heads.scorers.sinks import SinkRule
from steer.act.method import ActEdit, default_act_layers

__all__ = ["NOISE", "ActCalibration", "calibrate_act_heads", "choice_ids"]

NOISE = 1e-4
"""Gains within this of `delta` are float rounding (batch layout changes fp32 sums by ~1e-6),
never a reason to keep a head: a no-op edit must select nothing."""

Head = tuple[int, int]


def choice_ids(tokenizer: Any, choices: Sequence[Sequence[str]]) -> torch.Tensor:
    """`[N, C]` first token of `" " + choice` for every example's choices.

    Raises:
        TypeError: an example's choices are not a list of strings.
        ValueError: fewer than 2 choices, an empty choice, examples with different numbers of
            choices, or two choices of one example sharing a first token.
    """
    rows = []
    for i, cs in enumerate(choices):
        if (
            isinstance(cs, (str, bytes))
            or not isinstance(cs, Sequence)
            or not all(isinstance(c, str) for c in cs)
        ):
            raise HeadsteerTypeError(f"example {i}: choices must be a list of strings, got {short_repr(cs)}")
        if len(cs) < 2 or not all(c.strip() for c in cs):
            raise HeadsteerValueError(
                f"example {i}: need at least 2 non-empty choices, got {short_repr(list(cs))}"
            )
        ids = [tokenizer(" " + c, add_special_tokens=False)["input_ids"][0] for c in cs]
        if len(set(ids)) != len(ids):
            raise HeadsteerValueError(f"example {i}: choices {list(cs)} share a first token")
        rows.append(ids)
    if len({len(r) for r in rows}) != 1:
        raise HeadsteerValueError("every example needs the same number of choices")
    return torch.tensor(rows)


def _correct_and_margin(logp: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`[R, 2]`: 1.0 if the label's choice has the highest log-prob (ties wrong), and the margin
    log p(label) - max log p(other choices)."""
    lp = logp.gather(1, ids)
    right = lp.gather(1, labels[:, None])[:, 0]
    other = lp.scatter(1, labels[:, None], -torch.inf).max(-1).values
    return torch.stack([(right > other).float(), right - other], -1)


@dataclass
class ActCalibration:
    """Result of `calibrate_act_heads`.

    Attributes:
        accuracy: HeadScores, accuracy with ACT on that head alone minus the base accuracy.
        margin: HeadScores, the same for the mean log-prob margin of the right choice (nats).
        base_accuracy: the uncalibrated model's accuracy.
        base_margin: the uncalibrated model's margin.
        heads: the kept heads (gain above `delta` by more than float noise, `NOISE`).
    """

    accuracy: HeadScores
    margin: HeadScores
    base_accuracy: float
    base_margin: float
    heads: HeadSet

    def __repr__(self) -> str:
        return (
            f"ActCalibration(kept {len(self.heads)} heads; base accuracy {self.base_accuracy:.3f}, "
            f"margin {self.base_margin:.3f} nats; margin gain top {top_heads_text(self.margin)})"
        )

    def _repr_html_(self) -> str:
        rows = [
            (f"L{la}.H{h}", self.accuracy.scores[la, h].item(), self.margin.scores[la, h].item())
            for la, h in self.margin.ranked(10)
        ]
        return html_view(repr(self), rows, ("head", "accuracy gain", "margin gain (nats)"))


def calibrate_act_heads(
    model: HeadModel,
    prompts: Sequence,
    choices: Sequence[Sequence[str]],
    labels: Sequence[int],
    *,
    beta: float = 0.4,
    rule: SinkRule | None = None,
    heads: HeadSpec | None = None,
    chat: bool | None = False,
    keep: Literal["accuracy", "margin"] = "accuracy",
    delta: float = 0.0,
    options: SweepOptions | None = None,
    **deprecated: Any,
) -> ActCalibration:
    """Score every candidate head with ACT applied to it alone; keep the heads that help.

    Args:
        prompts, choices, labels: a choice task (N prompts; each with the same number of
            choices, scored by the first token of `" " + choice`; `labels` index the right one).
        beta, rule: ACT's parameters (default 0.4, relative rule).
        heads: candidates, any `HeadSpec` (default all heads of layers 2..L-2).
        keep: `"accuracy"` (paper: acc_h > acc_0 + delta) or `"margin"` (mean log-prob margin
            above the base by more than delta; finer-grained on small calibration sets). A gain
            must also exceed `delta` by `NOISE` (1e-4), so rounding never selects a head.
        options: how the sweep runs (`heads.SweepOptions`): `max_rows` batch rows per forward
            (fewer where `max_memory` needs it; refused before any forward below one row);
            `progress` a tqdm bar by default, in (head, prompt) rows (`total` is
            `len(heads) * N`); `executor` (`"local"`, `"ray"` or a
            `heads.engine.executors.Executor`) splits the candidates into the executor's shards,
            runs them (Ray: as tasks, each worker loading the model once) and merges them;
            default None runs here. No `shard` (pass `heads=` instead).
        **deprecated: the 0.1 keywords `max_rows=`, `progress=`, `executor=`: still accepted
            for this release, with a `DeprecationWarning`.

    Raises:
        ValueError: mismatched lengths, labels out of range, colliding choices, bad heads or keep.
    """
    from steer.act.method import Act

    takes = ("max_rows", "progress", "executor", "max_memory")
    opts = sweep_options(options, deprecated, "calibrate_act_heads", takes=takes)
    rule = rule or SinkRule()
    Act(beta=beta, rule=rule)  # validates beta and rule
    check_number("delta", delta)
    if keep not in ("accuracy", "margin"):
        raise HeadsteerValueError(f"keep must be 'accuracy' or 'margin', got {short_repr(keep)}")
    enc = encode_prompts(model.tokenizer, normalize_prompts(prompts)[0], chat=chat, markup=False)
    if not len(choices) == len(labels) == enc.batch:
        raise HeadsteerValueError(
            f"{enc.batch} prompts, {len(choices)} choice lists and {len(labels)} labels"
        )
    if not all(is_int(x) for x in labels):
        raise HeadsteerTypeError(
            f"labels must be ints (indices into each example's choices), got {short_repr(list(labels))}"
        )
    ids = choice_ids(model.tokenizer, choices)
    lab = torch.tensor([int(x) for x in labels])
    if ((lab < 0) | (lab >= ids.shape[1])).any():
        raise HeadsteerValueError(f"labels must be in 0..{ids.shape[1] - 1}")
    heads = check_heads(model, heads, default_act_layers(model.n_layers))
    opts = opts.within(model, enc.length, whole=enc.batch)  # max_memory: rows within it
    if opts.executor is not None:
        kw: dict[str, object] = dict(
            prompts=list(prompts), choices=[list(c) for c in choices], labels=[int(x) for x in labels]
        )
        kw.update(beta=beta, rule=rule, chat=chat, keep=keep, delta=delta)
        kw.update(options=SweepOptions(max_rows=opts.max_rows, progress=False))
        parts = run_head_shards(calibrate_act_heads, model, opts.executor, kw, heads)
        acc = merge_scores([p.accuracy for p in parts])
        mar = merge_scores([p.margin for p in parts])
        table = acc if keep == "accuracy" else mar
        kept = HeadSet((la, h) for la, h in heads if table.scores[la, h].item() > delta + NOISE)
        return ActCalibration(acc, mar, parts[0].base_accuracy, parts[0].base_margin, kept)
    real = enc.attention_mask.bool()

    def row_edits(rows: list[Sequence[Head]], ps: torch.Tensor, trim: int) -> list[Edit]:
        masks = row_head_masks(model, rows)
        kr = real[ps, trim:]
        return [ActEdit(layer=la, row_heads=m, key_real=kr, beta=beta, rule=rule) for la, m in masks.items()]

    def score(logp: torch.Tensor, final: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
        return _correct_and_margin(logp, ids[ps], lab[ps])

    with progress_callback(opts.progress, "ACT calibration", "rows") as report:
        clean = clean_run(model, enc)
        base = _correct_and_margin(clean.logp, ids, lab).mean(0)  # [2]
        got = evaluate_variants(
            model, clean, [[h] for h in heads], row_edits, score, max_rows=opts.max_rows, progress=report
        ).mean(1)  # [M, 2]
    tables = torch.full((2, model.n_layers, model.n_heads), float("nan"))
    for k, (layer, head) in enumerate(heads):
        tables[:, layer, head] = got[k] - base
    params = {"beta": beta, "rule": rule.rule, "n_prompts": enc.batch, "keep": keep, "delta": delta}
    acc = HeadScores(tables[0], "act_accuracy_gain", dict(params), model.name, model.n_kv_heads)
    mar = HeadScores(tables[1], "act_margin_gain", dict(params), model.name, model.n_kv_heads)
    table = acc if keep == "accuracy" else mar
    kept = HeadSet((la, h) for la, h in heads if table.scores[la, h].item() > delta + NOISE)
    return ActCalibration(acc, mar, float(base[0]), float(base[1]), kept)
