"""ACT: attention-sink calibration (Yu et al., ICML 2024, arXiv:2406.15765; docs/methods/act.md).

On calibrated heads, every query row i moves mass away from the sink columns S:

    A'_is = beta * A_is                                        (s in S)
    A'_ij = A_ij + (1 - beta) * sigma_i * A_ij / sum_{k not in S} A_ik   (j not in S)

with sigma_i = sum_{s in S} A_is and beta = 0.4. Rows still sum to 1; this is *not* a plain
renormalisation (it equals adding the row-dependent logit bias
b_i = log[beta (1 - sigma_i) / (1 - beta sigma_i)] on sink columns). Rows without non-sink
mass are left unchanged. S comes from the prompt's own prefill pattern (`heads.scorers.sinks`).

**Causality.** a_j averages over all later rows, so the prefill edit of row i depends on rows
after i: prefill ACT is not causal (last-position scoring is unaffected). During decoding,
`decode_sinks="frozen"` (default) keeps S from the prefill (generated tokens are never sinks)
and calibrates each new row with it; `"running"` adds each new row to the column statistics
and recomputes S.

**Without a KV cache** (`generate(..., use_cache=False)`) every step re-runs prompt plus
generated tokens. S is then taken from the prompt rows over the prompt columns only (the
same pattern as at prefill, since a prompt row never sees a generated token), and the
generated rows are calibrated in order as above, so cached and uncached generation agree.
The whole prompt must be in one attention call: a prompt longer than the engine's query
block (`heads.engine.state.QUERY_BLOCK`) is refused by `Act.edits`, before anything runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from heads._util.validation import is_number, is_real, short_repr
from heads.engine import state as engine_state
from heads.engine.edits import AttentionCall, ProbEdit
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadSet, HeadSpec
from heads.scorers.sinks import SinkRule, column_scores, find_sinks
from steer.noop import empty_heads, warn_noop

__all__ = ["Act", "ActEdit", "calibrate_rows", "default_act_layers"]

DecodeSinks = Literal["frozen", "running"]


def calibrate_rows(probs: torch.Tensor, sinks: torch.Tensor, beta: float) -> torch.Tensor:
    """ACT's row calibration (docs/methods/act.md). `probs` `[B, H, Q, K]`, `sinks` `[B, H, K]` bool.

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
        rule: the sink rule (`heads.scorers.sinks.SinkRule`).
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
        if call.q_offset == 0:  # prefill, or an uncached re-run of prompt + generated tokens
            if call.q_len < prompt_len or call.k_len < prompt_len or call.batch != self.key_real.shape[0]:
                raise HeadsteerValueError(
                    f"ACT needs the whole prompt ({prompt_len} tokens, batch {self.key_real.shape[0]}) in "
                    f"one attention call, got {call.q_len} query rows over {call.k_len} keys, batch "
                    f"{call.batch} (prompt longer than the engine's query block, or a batch built for "
                    "another prompt set)"
                )
            # the prompt rows over the prompt columns: the same in a prefill and in a re-run
            real = self.key_real.to(probs.device)
            a, n = column_scores(probs[..., :prompt_len, :prompt_len], real)
            self.sinks = find_sinks(a, n, real, self.rule)
            self._col, self._n = a * n[:, None], n  # running column sums, supports
        elif self.sinks is None:
            raise HeadsteerValueError("ACT saw a decode step before the prefill of its prompt")
        sinks = torch.zeros(call.batch, call.n_heads, call.k_len, dtype=torch.bool, device=probs.device)
        sinks[..., :prompt_len] = self.sinks
        first_new = max(prompt_len - call.q_offset, 0)  # first row of the call at a generated position
        if self.decode_sinks == "frozen" or first_new >= call.q_len:
            return calibrate_rows(probs, sinks, self.beta)
        # running: each generated row, in order, joins the column statistics and is calibrated with
        # the sinks they then give (one row per call with a KV cache, all of them in a re-run)
        parts = [calibrate_rows(probs[..., :first_new, :], sinks, self.beta)] if first_new else []
        for r in range(first_new, call.q_len):
            row = probs[..., r : r + 1, :]
            sinks = sinks.clone()
            sinks[..., :prompt_len] = self._running(row)
            parts.append(calibrate_rows(row, sinks, self.beta))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def _running(self, rows: torch.Tensor) -> torch.Tensor:
        """Add query rows `rows` `[B, H, Q, K]` to the prompt columns' statistics and re-flag
        (`"running"` mode); returns the new `[B, H, P]` sink set.

        Raises:
            ValueError: called before the prefill (no column statistics yet).
        """
        if self._col is None or self._n is None:  # set at prefill, which `apply` checks came first
            raise HeadsteerValueError("ACT saw a decode step before the prefill of its prompt")
        prompt_len = self.key_real.shape[1]
        real = self.key_real.to(rows.device)
        col = self._col = self._col + rows.float()[..., :prompt_len].sum(-2)
        n = self._n = self._n + rows.shape[-2] * real
        a = torch.where(n[:, None] > 0, col / n[:, None].clamp(min=1), 0.0)
        return find_sinks(a, n, real, self.rule)


@dataclass(frozen=True)
class Act:
    """ACT sink calibration on `heads` (from `heads.calibrate_act_heads` or a `{"layer": [heads]}`
    JSON file), default beta 0.4 and the relative sink rule.

    Args:
        heads: the calibrated heads (any form `HeadSet.parse` accepts); None = every head of
            layers 2..L-2 (the reference's layer range, without head filtering).
        beta: sink scale in [0, 1] (default 0.4; 1 = no-op).
        rule: `heads.scorers.sinks.SinkRule` (default relative, alpha_s 5, position-0 exemption).
        decode_sinks: `"frozen"` (default) or `"running"`.

    Raises:
        ValueError / TypeError: beta outside [0, 1], unknown decode mode, bad heads.

    Source: Yu et al. 2024, §4 (calibration) and §5 (head filtering); reference GATECH-EIC/ACT.
    """

    heads: HeadSpec | None = None
    beta: float = 0.4
    rule: SinkRule = field(default_factory=SinkRule)
    decode_sinks: DecodeSinks = "frozen"

    def __post_init__(self) -> None:
        self.validate()
        if self.beta == 1:
            warn_noop(f"ACT beta={self.beta} is a no-op: output equals the unsteered model", stacklevel=4)
        if self.heads is not None and empty_heads(self.heads):
            warn_noop("ACT with no heads steers nothing: output equals the unsteered model", stacklevel=4)

    def validate(self) -> None:
        b = self.beta
        if not is_real(b):
            raise HeadsteerTypeError(f"beta must be a number, got {short_repr(b)}")
        if not is_number(b) or not math.isfinite(b) or not 0 <= b <= 1:
            raise HeadsteerValueError(f"beta must be in [0, 1], got {short_repr(b)}")
        if self.decode_sinks not in ("frozen", "running"):
            raise HeadsteerValueError(
                f"unknown decode_sinks {short_repr(self.decode_sinks)}: use 'frozen' or 'running'"
            )
        if not isinstance(self.rule, SinkRule):
            raise HeadsteerTypeError(
                f"rule must be a heads.scorers.sinks.SinkRule, got {short_repr(self.rule)}"
            )

    def head_set(self, model: HeadModel) -> HeadSet:
        if self.heads is None:
            return HeadSet((la, h) for la in default_act_layers(model.n_layers) for h in range(model.n_heads))
        return HeadSet.parse(self.heads, model.n_layers, model.n_heads)

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[ActEdit]:
        """One `ActEdit` per calibrated layer for the batch `enc`.

        Raises:
            ValueError: a prompt longer than the engine's query block (ACT's prefill edit of each
                row reads all later rows, so the whole prompt must be in one attention call).
        """
        self.validate()
        heads = self.head_set(model)
        if self.beta == 1:
            return []
        block = engine_state.QUERY_BLOCK
        if enc.length > block:
            raise HeadsteerValueError(
                f"ACT needs the whole prompt in one attention call (each row's calibration reads the "
                f"sink columns' attention from all later rows), but the prompt has {enc.length} tokens "
                f"and the engine runs {block} query rows per block (heads.engine.state.QUERY_BLOCK)"
            )
        real = enc.attention_mask.bool()
        beta = float(self.beta)
        return [
            ActEdit(
                layer=la, heads=hs, key_real=real, beta=beta, rule=self.rule, decode_sinks=self.decode_sinks
            )
            for la, hs in heads.by_layer().items()
        ]
