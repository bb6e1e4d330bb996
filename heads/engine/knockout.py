"""Attention knockout as an engine edit: `KnockoutBias`, a logit bias on chosen (query, key) pairs.

Knockout (Geva et al. 2023, "Dissecting Recall of Factual Associations in Auto-Regressive Language
Models", EMNLP, arXiv:2304.14767, Sec. 3) blocks attention from chosen query positions to chosen
key positions by setting those attention logits to -inf before the softmax, so each row
renormalises over its other keys. Modification (Ortu et al. 2024, arXiv:2402.11655, Sec. 6)
multiplies those probabilities by a factor and renormalises the row: `log(factor)` added to the
logits, `factor=0` being the knockout.

The analysis (`heads.knockout`) and the steering intervention (`steer.Knockout`) both build on
this edit. Being a query-row term times a key-column term (`LogitBias.rank_one`), it runs on the
blocked path and on the fused kernel (memory linear in the prompt), at prefill and at every
decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from heads.engine.edits import AttentionCall, LogitBias
from heads.errors import HeadsteerValueError

__all__ = ["KnockoutBias", "dead_rows"]


@dataclass(eq=False, repr=False)
class KnockoutBias(LogitBias):
    """Logit bias `log_factor` on the (query, key) pairs `queries[b] x keys[b]` of each row b.

    Attributes:
        queries: `[B, P]` bool over absolute query positions (positions `>= P` are never
            chosen), or None: every query row, generated ones included.
        keys: `[B, P]` bool over absolute key columns (generated columns never chosen).
        log_factor: `log(factor)`; `-inf` blocks the pairs (knockout).

    Raises:
        HeadsteerValueError: (when it runs) a batch of another size than `keys`'.
    """

    queries: torch.Tensor | None = None
    keys: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, dtype=torch.bool))
    log_factor: float = -math.inf

    def is_identity(self) -> bool:
        return (
            self.log_factor == 0.0
            or not bool(self.keys.any())
            or (self.queries is not None and not bool(self.queries.any()))
        )

    rank_one: ClassVar[bool] = True  # queries x keys: runs on the fused kernel too (long prompts)

    def _rows_cols(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        """`([B, Q] bool chosen query rows of the call, [B, K] bool chosen key columns)`."""
        if self.keys.shape[0] != call.batch:
            raise HeadsteerValueError(
                f"Knockout was built for a batch of {self.keys.shape[0]} prompts, "
                f"the model ran {call.batch} rows"
            )
        dev = call.device
        P = self.keys.shape[1]
        kcol = torch.zeros(call.batch, call.k_len, dtype=torch.bool, device=dev)
        n = min(P, call.k_len)
        kcol[:, :n] = self.keys[:, :n].to(dev)
        if self.queries is None:
            qrow = torch.ones(call.batch, call.q_len, dtype=torch.bool, device=dev)
        else:
            qrow = torch.zeros(call.batch, call.q_len, dtype=torch.bool, device=dev)
            a, b = call.q_offset, min(call.q_offset + call.q_len, P)
            if b > a:
                qrow[:, : b - a] = self.queries[:, a:b].to(dev)
        return qrow, kcol

    def bias(self, call: AttentionCall) -> torch.Tensor:
        qrow, kcol = self._rows_cols(call)
        pair = qrow[:, None, :, None] & kcol[:, None, None, :]  # [B, 1, Q, K]
        return torch.where(pair, self.log_factor, 0.0)

    def row_column_bias(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        """`(beta [B, 1, Q], cols [B, K])`: `log_factor` on the chosen query rows, 1 on the chosen
        key columns (the fused kernel adds `beta * cols`; the blocked path uses `bias`)."""
        qrow, kcol = self._rows_cols(call)
        return torch.where(qrow, self.log_factor, 0.0)[:, None, :], kcol.float()


def dead_rows(queries: torch.Tensor | None, keys: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """`[B, P]` bool: the real query rows a knockout (factor 0) leaves with no visible key (every
    key a causal row may see, its own position included, blocked) — a softmax over nothing.

    Args:
        queries: `[B, P]` bool chosen query rows, or None (every row).
        keys: `[B, P]` bool blocked key columns.
        attention_mask: `[B, P]` the prompts' mask (1 = real token, left padding 0).
    """
    real = attention_mask.bool()
    P = real.shape[1]
    visible = torch.ones(P, P, dtype=torch.bool).tril()[None] & real[:, None, :]  # [B, Q, K]
    left = visible & ~keys[:, None, :].to(visible.device)
    chosen = real if queries is None else queries.to(real.device) & real
    return chosen & ~left.any(-1)
