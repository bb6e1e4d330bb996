"""Attention knockout and modification (docs/methods/patching.md, "Path patching, knockout and speed").

Knockout (Geva et al. 2023, "Dissecting Recall of Factual Associations in Auto-Regressive
Language Models", EMNLP, arXiv:2304.14767, Sec. 3): in a window of layers (and chosen heads),
block attention from chosen query positions to chosen key positions by setting those attention
logits to -inf before the softmax, so each row renormalises over its other keys. Modification
(Ortu et al. 2024, comp-mech, arXiv:2402.11655, Sec. 6): multiply those attention probabilities
by a factor and renormalise the row, which is the same as adding `log(factor)` to the logits —
`factor=0` is the knockout.

`Knockout(...)` is a steering intervention: `SteeredModel.generate(..., steer=[Knockout(...)])`
or `heads.editing(model, Knockout(...).edits(model, enc))`. Its edit is the engine's
`heads.engine.knockout.KnockoutBias` (a `LogitBias`, shared with the `heads.knockout` analysis), so
it runs on the engine's blocked path at prefill and at every decode step, and,
being a query-row term times a key-column term (`LogitBias.rank_one`), on the fused kernel too
(`editing(..., kernel="fused")`, and `"auto"` for long prompts): memory linear in the prompt.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from heads._util.validation import is_number, short_repr
from heads.engine.edits import Edit
from heads.engine.knockout import KnockoutBias, dead_rows
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from steer.noop import warn_noop
from steer.span_rows import warn_rows_without_span

__all__ = ["Knockout", "KnockoutBias"]

Positions = Sequence[int] | Sequence[Sequence[int]]


def _resolve(name: str, spec: object, enc: EncodedPrompts) -> torch.Tensor:
    """`[B, P]` bool of the positions `spec` names (one list for every row, or one per row)."""
    B, P = enc.batch, enc.length
    if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence) or not len(spec):
        raise HeadsteerValueError(
            f"{name} must be a non-empty list of positions (or one list per row), got {short_repr(spec)}"
        )
    rows: list[Sequence[object]]
    if all(isinstance(x, Sequence) and not isinstance(x, (str, bytes)) for x in spec):
        if len(spec) != B:
            raise HeadsteerValueError(f"{name} has {len(spec)} per-row lists for a batch of {B} prompts")
        rows = list(spec)
    else:
        rows = [spec] * B
    out = torch.zeros(B, P, dtype=torch.bool)
    for b, row in enumerate(rows):
        for p in row:
            if isinstance(p, bool) or not isinstance(p, numbers.Integral):
                raise HeadsteerTypeError(f"{name} positions must be ints, got {short_repr(p)}")
            q = int(p) + P if p < 0 else int(p)
            if not 0 <= q < P:
                raise HeadsteerValueError(
                    f"{name} position {short_repr(p)} is out of range for prompt length {P} (0..{P - 1})"
                )
            out[b, q] = True
    return out


def _runs(values: Sequence[object]) -> str:
    """`[0, 1, 2, 5]` as `0..2, 5`; at most 4 runs shown, then the count left."""
    ints = [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]
    if len(ints) != len(values):
        return short_repr(list(values))
    runs: list[tuple[int, int]] = []
    for v in ints:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    parts = [str(a) if a == b else f"{a}..{b}" for a, b in runs[:4]]
    more = f", ... {len(runs) - 4} more runs" if len(runs) > 4 else ""
    return "[" + ", ".join(parts) + more + f"] ({len(ints)})"


def _short_positions(value: object) -> str:
    """A position / layer / head list for a repr: None as `all`, a string as given, runs
    otherwise (one list per row: the rows' count and the first row's runs)."""
    if value is None:
        return "all"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, range):
        value = list(value)
    if isinstance(value, Sequence) and any(isinstance(v, (str, bytes)) for v in value):
        return short_repr(value)  # names (refused at `edits`): as given, not split into characters
    if isinstance(value, Sequence) and value and all(isinstance(v, Sequence) for v in value):
        return f"{len(value)} rows, row 0 {_runs(list(value[0]))}"
    if isinstance(value, Sequence):
        return _runs(list(value))
    return short_repr(value)


@dataclass(frozen=True, repr=False)
class Knockout:
    """Block (or scale) attention from query positions to key positions in chosen layers/heads.

    Args:
        keys: the key positions: absolute (padded) prompt positions, negative counting from the
            end of the prompt (`-1` = its last token), one list for every row or one list per
            row; or `"span"`: each row's emphasized spans (`**text**` markup).
        queries: the query positions, in the same forms (default None: every query row,
            generated tokens included).
        layers: the window of layers (a list or range; default None: every layer).
        heads: query heads in each of those layers (default None: every head).
        factor: 0 (default) blocks the pairs (logit -inf); a factor > 0 multiplies their
            attention probabilities and renormalises each row (logit + log(factor)).

    Raises:
        ValueError: a negative or non-finite factor, unknown layers / heads, positions out of
            range, or — with factor 0 — a query row of a prompt left with no visible key (every
            key it may see, its own position included, blocked), all when the edits are built,
            before any forward.

    Source: Geva et al., EMNLP 2023 (arXiv:2304.14767), Sec. 3 (knockout); Ortu et al., ACL 2024
    (arXiv:2402.11655), Sec. 6 (attention modification).
    """

    keys: Positions | str
    queries: Positions | None = None
    layers: Sequence[int] | None = None
    heads: Sequence[int] | None = None
    factor: float = 0.0

    def __post_init__(self) -> None:
        f = self.factor
        if not is_number(f) or not math.isfinite(f) or f < 0:
            raise HeadsteerValueError(
                f"factor must be a finite number >= 0 (0 = knockout), got {short_repr(f)}"
            )
        if f == 1:
            warn_noop("Knockout factor=1 is a no-op: output equals the unsteered model", stacklevel=4)

    def __repr__(self) -> str:
        """Short: each position list as runs (`500..899 (400)`), what it leaves at its default
        (`queries=all`), the factor ("blocked" at 0)."""
        what = "blocked" if self.factor == 0 else f"x{self.factor:g}"
        return (
            f"Knockout(keys={_short_positions(self.keys)}, queries={_short_positions(self.queries)}, "
            f"layers={_short_positions(self.layers)}, heads={_short_positions(self.heads)}, "
            f"factor={self.factor:g} ({what}))"
        )

    def _layers_heads(self, model: HeadModel) -> tuple[list[int], list[int] | None]:
        layers = list(range(model.n_layers)) if self.layers is None else self.layers
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not len(layers):
            raise HeadsteerValueError(
                f"layers must be a non-empty list of layers, got {short_repr(self.layers)}"
            )
        for la in layers:
            model.check_head(la)
        heads = None
        if self.heads is not None:
            if isinstance(self.heads, (str, bytes)) or not isinstance(self.heads, Sequence) or not self.heads:
                raise HeadsteerValueError(
                    f"heads must be a non-empty list of head indices, got {short_repr(self.heads)}"
                )
            for h in self.heads:
                model.check_head(layers[0], h)
            heads = sorted({int(h) for h in self.heads})
        return sorted({int(la) for la in layers}), heads

    def masks(self, enc: EncodedPrompts) -> tuple[torch.Tensor | None, torch.Tensor]:
        """`(queries [B, P] bool or None, keys [B, P] bool)` on `enc`'s padded positions.

        Raises:
            ValueError: positions out of range; with factor 0, a prompt query row whose every
                visible key is blocked.
        """
        if isinstance(self.keys, str):
            if self.keys != "span":
                raise HeadsteerValueError(f"keys must be positions or 'span', got {short_repr(self.keys)}")
            keys = enc.span_mask()
            if not bool(keys.any()):
                raise HeadsteerValueError("keys='span' but no prompt has an emphasized span (**text**)")
            warn_rows_without_span(enc, "Knockout")  # a row without a span is not knocked out
        else:
            keys = _resolve("keys", self.keys, enc)
        queries = None if self.queries is None else _resolve("queries", self.queries, enc)
        if self.factor == 0:
            dead = dead_rows(queries, keys, enc.attention_mask)
            if bool(dead.any()):
                b, q = (int(x) for x in torch.nonzero(dead)[0])
                raise HeadsteerValueError(
                    f"Knockout blocks every visible key of query position {q} in prompt {b} "
                    "(its own position included); keep at least one key per row"
                )
        return queries, keys

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[Edit]:
        """One `KnockoutBias` per layer of the window (all batch rows)."""
        layers, heads = self._layers_heads(model)
        queries, keys = self.masks(enc)
        logf = -math.inf if self.factor == 0 else math.log(self.factor)
        return [
            KnockoutBias(layer=la, heads=heads, queries=queries, keys=keys, log_factor=logf) for la in layers
        ]
