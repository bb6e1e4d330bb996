"""The gate of Causal Head Gating and the task it is fitted on: `HeadGate` (an edit at the engine's
`head_output` site scaling each head's output by its gate), `gate_edits` (one per layer), the
prompts and target tokens (`GateTask`, `gate_task`) and the gated model's loss (`gated_nll`).

The method (and its source) is described in `heads.scorers.gating.chg`, which re-exports these
names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from heads._util.validation import short_repr
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, HeadOutputEdit
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel

__all__ = ["GateTask", "HeadGate", "gate_edits", "gate_task", "gated_nll"]


# ------------------------------------------------------------------------------ the edit
@dataclass(eq=False, repr=False)
class HeadGate(HeadOutputEdit):
    """Scale every head's output `z` of `layer` by its gate: `z[..., h, :] * gate[h]`.

    Attributes:
        gate: `[H]` (one gate per query head), or `[M, H]` for M gate sets evaluated at once:
            the batch is then M copies of each row, row `b * M + m` gated by `gate[m]`. The tensor
            may require grad (CHG training differentiates through it).

    Raises:
        TypeError: `gate` is not a floating-point tensor.
        ValueError: `gate` is not 1-d or 2-d, or holds NaN / inf.
    """

    site: ClassVar[str] = "head_output"
    gate: torch.Tensor = field(default_factory=lambda: torch.ones(0))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        super().validate()
        g = self.gate
        if not isinstance(g, torch.Tensor) or not g.dtype.is_floating_point:
            raise HeadsteerTypeError(
                f"HeadGate gate must be a float tensor [H] or [M, H], got {short_repr(g)}"
            )
        if g.ndim not in (1, 2):
            raise HeadsteerValueError(f"HeadGate gate must be [H] or [M, H], got shape {tuple(g.shape)}")
        if not bool(torch.isfinite(g.detach()).all()):
            raise HeadsteerValueError(f"HeadGate at layer {self.layer}: gates must be finite")

    def is_identity(self) -> bool:
        return not self.gate.requires_grad and bool((self.gate == 1).all())

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        g = self.gate.to(device=z.device, dtype=z.dtype)
        if g.shape[-1] != z.shape[2]:
            raise HeadsteerValueError(
                f"HeadGate at layer {self.layer} has {g.shape[-1]} gates for {z.shape[2]} heads"
            )
        if g.ndim == 1:
            return z * g[None, None, :, None]
        m = g.shape[0]
        if z.shape[0] % m:
            raise HeadsteerValueError(f"HeadGate: batch {z.shape[0]} is not a multiple of {m} gate sets")
        zz = z.reshape(z.shape[0] // m, m, *z.shape[1:])  # [B, M, T, H, d]
        return (zz * g[None, :, None, :, None]).reshape(z.shape)


def gate_edits(model: HeadModel, gates: torch.Tensor) -> list[HeadGate]:
    """One `HeadGate` per layer from `gates` `[L, H]` (or `[M, L, H]` for M gate sets).

    Raises:
        ValueError: a shape other than the model's `[n_layers, n_heads]`.
    """
    if not isinstance(gates, torch.Tensor):
        raise HeadsteerTypeError(f"gates must be a tensor [L, H], got {type(gates).__name__}")
    if tuple(gates.shape[-2:]) != (model.n_layers, model.n_heads) or gates.ndim not in (2, 3):
        raise HeadsteerValueError(
            f"gates must be [{model.n_layers}, {model.n_heads}] (or [M, L, H]), got {tuple(gates.shape)}"
        )
    return [HeadGate(layer=la, gate=gates[..., la, :]) for la in range(model.n_layers)]


# ------------------------------------------------------------------------------ the task
@dataclass
class GateTask:
    """Token rows for CHG, right-padded (as the reference's datasets).

    Attributes:
        input_ids: `[N, T]` long.
        attention_mask: `[N, T]` long, 0 on padding.
        loss_mask: `[N, T]` bool, True on the target tokens (each predicted from the position
            before it; position 0 is never a target).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor

    def check(self, model: HeadModel) -> None:
        """ValueError for shapes that disagree, a row without targets, a target at position 0 or on
        padding, token ids outside the vocabulary, or rows beyond the model's position limit."""
        ids, am, lm = self.input_ids, self.attention_mask, self.loss_mask
        if not all(isinstance(x, torch.Tensor) for x in (ids, am, lm)):
            raise HeadsteerTypeError("GateTask fields must be tensors")
        if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
            raise HeadsteerValueError(f"input_ids must be [N, T] with N >= 1, T >= 2, got {tuple(ids.shape)}")
        if am.shape != ids.shape or lm.shape != ids.shape:
            raise HeadsteerValueError("input_ids, attention_mask and loss_mask must have one shape")
        if ids.dtype.is_floating_point or lm.dtype != torch.bool:
            raise HeadsteerValueError("input_ids must be integer and loss_mask bool")
        if not bool(lm.any(-1).all()):
            raise HeadsteerValueError(
                f"rows {torch.nonzero(~lm.any(-1)).flatten().tolist()} have no target token"
            )
        if bool(lm[:, 0].any()) or bool((lm & (am == 0)).any()):
            raise HeadsteerValueError("a target token at position 0 or on padding")
        if int(ids.min()) < 0 or int(ids.max()) >= model.d_vocab:
            raise HeadsteerValueError(f"token ids must be in 0..{model.d_vocab - 1}")
        model.check_length(int(ids.shape[1]))

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def rows(self, index: torch.Tensor) -> GateTask:
        """The rows at `index`, trimmed to their longest row (right padding)."""
        am = self.attention_mask[index]
        t = int(am.sum(-1).max())
        return GateTask(self.input_ids[index, :t], am[:, :t], self.loss_mask[index, :t])


def gate_task(model: HeadModel, prompts: Sequence[str], targets: Sequence[str]) -> GateTask:
    """Rows `prompt + target` (no chat template), the loss on the target's tokens.

    The prompt is tokenized with the tokenizer's special tokens (BOS if it adds one), the target
    without; e.g. an IOI pair gives prompt = the clean prompt and target = `" Mary"`.

    Raises:
        ValueError: no prompts, a length mismatch, an empty prompt or a target of no tokens.
    """
    tok = model.tokenizer
    if tok is None:
        raise HeadsteerTypeError("gate_task needs a model with a tokenizer")
    for name, xs in (("prompts", prompts), ("targets", targets)):
        if isinstance(xs, (str, bytes)) or not isinstance(xs, Sequence) or not xs:
            raise HeadsteerValueError(f"{name} must be a non-empty list of strings, got {short_repr(xs)}")
        if any(not isinstance(x, str) for x in xs):
            raise HeadsteerValueError(f"{name} must be strings")
    if len(prompts) != len(targets):
        raise HeadsteerValueError(f"{len(prompts)} prompts for {len(targets)} targets")
    rows, masks = [], []
    for p, t in zip(prompts, targets, strict=True):
        a = list(tok(p).input_ids)
        b = list(tok(t, add_special_tokens=False).input_ids)
        if not a or not b:
            raise HeadsteerValueError(f"empty prompt or target: {short_repr(p[:40])} / {short_repr(t)}")
        rows.append(a + b)
        masks.append([False] * len(a) + [True] * len(b))
    width = max(len(r) for r in rows)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
    am = torch.zeros(len(rows), width, dtype=torch.long)
    lm = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        am[i, : len(r)] = 1
        lm[i, : len(r)] = torch.tensor(m)
    return GateTask(ids, am, lm)


def gated_nll(model: HeadModel, task: GateTask, gates: torch.Tensor | None) -> torch.Tensor:
    """Mean NLL (nats) of each row's target tokens under `gates`: `[N]` for gates `[L, H]` (or
    None, the plain model), `[N, M]` for M gate sets `[M, L, H]`. Differentiable in `gates`.

    Only the logits from the first predicting position on are computed (`logits_to_keep`).
    """
    ids, am, lm = task.input_ids, task.attention_mask, task.loss_mask
    n, t = ids.shape
    m = 1 if gates is None or gates.ndim == 2 else int(gates.shape[0])
    first = int(torch.nonzero(lm.any(0)).min()) - 1  # the first position whose logits are used
    keep = t - first
    dev = model.device
    run_ids, run_am = ids.repeat_interleave(m, 0).to(dev), am.repeat_interleave(m, 0).to(dev)
    edits = [] if gates is None else gate_edits(model, gates)
    with editing(model, edits):
        logits = model.run(
            input_ids=run_ids, attention_mask=run_am, use_cache=False, logits_to_keep=keep
        ).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1)  # [N*M, keep-1, V] predicting first+1 .. t-1
    target = run_ids[:, first + 1 :]
    mask = lm.repeat_interleave(m, 0)[:, first + 1 :].to(dev).float()
    nll = -logp.gather(-1, target[..., None])[..., 0]
    per_row = (nll * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_row if gates is None or gates.ndim == 2 else per_row.reshape(n, m)
