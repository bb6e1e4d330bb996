"""ACT: attention-sink calibration (Yu et al., ICML 2024, arXiv:2406.15765; methods/act.md).

On calibrated heads, every query row i moves mass away from the sink columns S:

    A'_is = beta * A_is                                        (s in S)
    A'_ij = A_ij + (1 - beta) * sigma_i * A_ij / sum_{k not in S} A_ik   (j not in S)

with sigma_i = sum_{s in S} A_is and beta = 0.4. Rows still sum to 1; this is *not* a plain
renormalisation (it equals adding the row-dependent logit bias
b_i = log[beta (1 - sigma_i) / (1 - beta sigma_i)] on sink columns). Rows without non-sink
mass are left unchanged. S comes from the prompt's own prefill pattern (`heads.sinks`).

**Causality.** a_j averages over all later rows, so the prefill edit of row i depends on rows
after i: prefill ACT is not causal (last-position scoring is unaffected). During decoding,
`decode_sinks="frozen"` (default) keeps S from the prefill (generated tokens are never sinks)
and calibrates each new row with it; `"running"` adds each new row to the column statistics
and recomputes S.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Literal

import torch

from heads.edits import AttentionCall, ProbEdit
from heads.model import HeadModel
from heads.prompts import EncodedPrompts
from heads.scores import HeadSet
from heads.sinks import SinkRule, column_scores, find_sinks

__all__ = ["Act", "ActEdit", "calibrate_rows", "default_act_layers"]

DecodeSinks = Literal["frozen", "running"]


def calibrate_rows(probs: torch.Tensor, sinks: torch.Tensor, beta: float) -> torch.Tensor:
    """ACT's row calibration (methods/act.md §2). `probs` `[B, H, q, K]`, `sinks` `[B, H, K]` bool.

    Rows whose non-sink mass is 0 are returned unchanged.
    """
    s = sinks[:, :, None, :]
    p = probs.float()
    sigma = (p * s).sum(-1, keepdim=True)
    rest = (p * ~s).sum(-1, keepdim=True)
    ok = rest > 0
    moved = p + (1 - beta) * sigma * p / rest.clamp(min=1e-30)
    new = torch.where(s, beta * p, moved)
    return torch.where(ok & (sigma > 0), new, p).to(probs.dtype)


def default_act_layers(n_layers: int) -> range:
    """Layers 2 .. L-2 (reference LLaMA path: 2..30 of 32; SmolLM2: 2..28); every layer for
    models too shallow to have any (fewer than 4 layers)."""
    return range(2, n_layers - 1) if n_layers >= 4 else range(n_layers)


@dataclass(eq=False, repr=False)
class ActEdit(ProbEdit):
    """ACT on one layer's chosen heads (or per-row heads via `row_heads`).

    Attributes:
        key_real: `[B, P]` bool, real (non-pad) prompt positions.
        beta: sink scale in [0, 1]; 1 is a no-op.
        rule: the sink rule (`heads.sinks.SinkRule`).
        decode_sinks: `"frozen"` or `"running"` (see the module docstring).
        sinks: `[B, H, P]` the sink set found at prefill (for inspection / frozen decoding).
    """

    key_real: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, dtype=torch.bool))
    beta: float = 0.4
    rule: SinkRule = field(default_factory=SinkRule)
    decode_sinks: DecodeSinks = "frozen"
    sinks: torch.Tensor | None = field(default=None, init=False)
    _col: torch.Tensor | None = field(default=None, init=False)
    _n: torch.Tensor | None = field(default=None, init=False)

    def is_identity(self) -> bool:
        return self.beta == 1

    def apply(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        prompt_len = self.key_real.shape[1]
        if call.q_offset == 0:  # prefill: the whole prompt in this call
            if call.q_len != call.k_len or call.k_len != prompt_len:
                raise ValueError(
                    f"ACT needs the whole prompt ({prompt_len} tokens) in one attention call, got "
                    f"{call.q_len} query rows over {call.k_len} keys (prompt longer than the engine's "
                    "query block, or a batch built for another prompt set)"
                )
            real = self.key_real.to(probs.device)
            a, n = column_scores(probs, real)
            self.sinks = find_sinks(a, n, real, self.rule)
            self._col, self._n = a * n[:, None], n  # running column sums, supports
            sinks = self.sinks
        else:
            if self.sinks is None:
                raise ValueError("ACT saw a decode step before the prefill of its prompt")
            width = call.k_len
            sinks = torch.zeros(call.batch, call.n_heads, width, dtype=torch.bool, device=probs.device)
            if self.decode_sinks == "frozen":
                sinks[..., :prompt_len] = self.sinks
            else:
                sinks[..., :prompt_len] = self._running(probs, call)
        return calibrate_rows(probs, sinks, self.beta)

    def _running(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """Add the new rows to the prompt columns' statistics and re-flag (`"running"` mode)."""
        prompt_len = self.key_real.shape[1]
        real = self.key_real.to(probs.device)
        self._col = self._col + probs.float()[..., :prompt_len].sum(-2)
        self._n = self._n + call.q_len * real
        a = torch.where(self._n[:, None] > 0, self._col / self._n[:, None].clamp(min=1), 0.0)
        return find_sinks(a, self._n, real, self.rule)


@dataclass(frozen=True)
class Act:
    """ACT sink calibration on `heads` (from `heads.calibrate_act_heads` or a `{"layer": [heads]}`
    JSON file), default beta 0.4 and the relative sink rule.

    Args:
        heads: the calibrated heads (any form `HeadSet.parse` accepts); None = every head of
            layers 2..L-2 (the reference's layer range, without head filtering).
        beta: sink scale in [0, 1] (default 0.4; 1 = no-op).
        rule: `heads.sinks.SinkRule` (default relative, alpha_s 5, position-0 exemption).
        decode_sinks: `"frozen"` (default) or `"running"`.

    Raises:
        ValueError / TypeError: beta outside [0, 1], unknown decode mode, bad heads.

    Source: Yu et al. 2024, §4 (calibration) and §5 (head filtering); reference GATECH-EIC/ACT.
    """

    heads: object = None
    beta: float = 0.4
    rule: SinkRule = field(default_factory=SinkRule)
    decode_sinks: DecodeSinks = "frozen"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        b = self.beta
        if isinstance(b, bool) or not isinstance(b, numbers.Real):
            raise TypeError(f"beta must be a number, got {b!r}")
        if not math.isfinite(b) or not 0 <= b <= 1:
            raise ValueError(f"beta must be in [0, 1], got {b!r}")
        if self.decode_sinks not in ("frozen", "running"):
            raise ValueError(f"unknown decode_sinks {self.decode_sinks!r}: use 'frozen' or 'running'")
        if not isinstance(self.rule, SinkRule):
            raise TypeError(f"rule must be a heads.sinks.SinkRule, got {self.rule!r}")

    def head_set(self, model: HeadModel) -> HeadSet:
        if self.heads is None:
            return HeadSet((la, h) for la in default_act_layers(model.n_layers) for h in range(model.n_heads))
        return HeadSet.parse(self.heads, model.n_layers, model.n_heads)

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[ActEdit]:
        """One `ActEdit` per calibrated layer for the batch `enc`."""
        self.validate()
        heads = self.head_set(model)
        if self.beta == 1:
            return []
        real = enc.attention_mask.bool()
        kw = {"beta": float(self.beta), "rule": self.rule, "decode_sinks": self.decode_sinks}
        return [ActEdit(layer=la, heads=hs, key_real=real, **kw) for la, hs in heads.by_layer().items()]
