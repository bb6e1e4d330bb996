"""Edits: plain descriptions of what to change in which heads, applied by `heads.engine.context`.

Every edit class declares its *site*, `site` (docs/architecture.md, "The edit engine"); the engine
dispatches through its site table (`heads.engine.context.SITES`):

* `QueryEdit` (`"query"`): a function of each head's query as the attention function
  receives it (after any QK-norm and RoPE), e.g. `QueryScale` for UA ablation.
* `LogitBias` (`"logits"`): an additive bias on the attention logits (pre-softmax, after
  any soft-capping) of chosen query heads, e.g. PASTA.
* `ProbEdit` (`"probs"`): a function of the post-softmax attention pattern, e.g. ACT;
  `Recorder` is a `ProbEdit` that only reads the pattern.
* `HeadOutputEdit` (`"head_output"`): a function of each head's output `z` (the input of
  `o_proj`, `[batch, pos, n_heads, d_head]`), e.g. `HeadScale` for ablation.
* `ResidualEdit` (`"residual"`): reads (or replaces) the residual stream entering a decoder
  layer `[batch, pos, d_model]`, e.g. `ResidualRecorder`; VAR's sink detection.

Every edit names one `layer` and its query `heads` (None = all), or carries a
per-batch-row head mask `row_heads` (`[batch, n_heads]` bool) so that one forward
pass can evaluate a different head set in every batch row. `calls` counts how
often the engine ran the edit, so that an edit that never fired is an error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar, Protocol

import torch

from heads._util.validation import check_int, is_int, is_number, is_real, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError

__all__ = [
    "AttentionCall",
    "Edit",
    "HeadOutputEdit",
    "HeadScale",
    "QueryEdit",
    "QueryScale",
    "LogitBias",
    "ProbEdit",
    "Recorder",
    "ResidualEdit",
    "ResidualRecorder",
    "SpanShareEdit",
    "check_combined_factors",
    "max_factor",
]


@dataclass(frozen=True)
class AttentionCall:
    """What an edit sees of one attention call (one layer, one block of query rows).

    Key column `j` is absolute position `j` of the (left-padded) sequence, so a
    prompt of padded length P occupies columns `0..P-1` and generated tokens
    columns `>= P`. Query row `r` of the block is absolute position `q_offset + r`.
    A static KV cache holds more key columns than positions: `k_len` may exceed
    `q_offset + q_len`, the columns beyond are empty slots the mask hides.
    """

    layer: int
    batch: int
    n_heads: int
    q_len: int  # query rows in this block
    k_len: int  # key columns (all positions so far)
    q_offset: int  # absolute position of the block's first query row
    device: torch.device
    split: bool = False  # the call's query rows were split into blocks; this is one of them
    pattern_of: Callable[..., torch.Tensor] | None = field(default=None, compare=False, repr=False)
    """In the blocked kernel's pattern edits: `pattern_of(query [B, h, q_len, d], key [B, h or
    h / groups, K, d], heads=None)`, the fp32 pattern `[B, h, q_len, K]` the layer itself computes
    (its scale, soft-cap, this block's mask, and the sinks of `heads`, the `[h]` query heads given,
    default all; no edit, no bias) for other queries and keys after QK-norm and RoPE (e.g.
    another run's, read at the `query` and `rot_k` sites) in the pattern edits that ask for it
    (`ProbEdit.uses_pattern_of`); None elsewhere."""

    @property
    def query_positions(self) -> torch.Tensor:
        """`[q_len]` absolute positions of the query rows."""
        return torch.arange(self.q_offset, self.q_offset + self.q_len, device=self.device)


@dataclass(eq=False)
class Edit:
    """Base of all edits: one layer, a set of query heads, optionally per batch row.

    Attributes:
        layer: layer index, 0-based.
        heads: query-head indices in that layer; None means every head.
        row_heads: optional `[batch, n_heads]` bool mask; row b edits the heads
            where `row_heads[b]` is True. Overrides `heads`.
        calls: how many attention calls ran this edit (set by the engine).
        site: (class attribute) where the edit acts, a key of `heads.engine.context.SITES`;
            None on this abstract base.
    """

    site: ClassVar[str | None] = None
    layer: int
    heads: Sequence[int] | None = None
    row_heads: torch.Tensor | None = None
    calls: int = field(default=0, init=False)

    def is_identity(self) -> bool:
        """True when the edit provably changes nothing (it is then skipped)."""
        return False

    def validate(self) -> None:
        """Check the edit's fields (run again by the engine at every use).

        Raises:
            TypeError: a layer that is not an int, heads that are not a list of
                ints, or a `row_heads` that is not a bool tensor.
            ValueError: a bad parameter (subclasses).
        """
        check_int("layer", self.layer, type_error=True)
        if self.heads is not None:
            if isinstance(self.heads, (str, bytes)) or not isinstance(self.heads, Iterable):
                raise HeadsteerTypeError(
                    f"heads must be a list of ints or None, got {short_repr(self.heads)}"
                )
            self.heads = tuple(self.heads)  # a generator or an array, read once
            for h in self.heads:
                check_int("head", h, type_error=True)
            if not self.heads:
                raise HeadsteerValueError(
                    f"{type(self).__name__} at layer {self.layer}: heads is empty, the edit would change "
                    "nothing (None = every head)"
                )
        if self.row_heads is not None and (
            not isinstance(self.row_heads, torch.Tensor) or self.row_heads.dtype != torch.bool
        ):
            raise HeadsteerTypeError(
                f"row_heads must be a bool torch.Tensor [batch, n_heads], got {short_repr(self.row_heads)}"
            )

    def acts_on(self, call: AttentionCall) -> bool:
        """False when the edit provably changes nothing in `call` (head-output and query edits
        are then skipped and the call does not count as fired). Default True."""
        return True

    def head_mask(self, batch: int, n_heads: int, device: torch.device) -> torch.Tensor:
        """`[batch or 1, n_heads]` bool mask of the (row, head) pairs this edit touches."""
        if self.row_heads is not None:
            if tuple(self.row_heads.shape) != (batch, n_heads):
                raise HeadsteerValueError(
                    f"{type(self).__name__} at layer {self.layer}: row_heads has shape "
                    f"{tuple(self.row_heads.shape)}, the call has batch {batch} x {n_heads} heads"
                )
            return self.row_heads.to(device=device, dtype=torch.bool)
        heads = tuple(range(n_heads)) if self.heads is None else tuple(int(h) for h in self.heads)
        cached = getattr(self, "_mask", None)
        if cached is None or cached[0] != (heads, n_heads, device):
            mask = torch.zeros(1, n_heads, dtype=torch.bool, device=device)
            mask[0, list(heads)] = True
            cached = self._mask = ((heads, n_heads, device), mask)
        return cached[1]

    def head_list(self, n_heads: int) -> list[int]:
        """The heads this edit touches in any row."""
        if self.row_heads is not None:
            return sorted(set(torch.nonzero(self.row_heads.any(0)).flatten().tolist()))
        return list(range(n_heads)) if self.heads is None else sorted(set(self.heads))

    def __repr__(self) -> str:
        who = "row_heads" if self.row_heads is not None else f"heads={self.heads}"
        return f"{type(self).__name__}(layer={self.layer}, {who})"


@dataclass(eq=False, repr=False)
class LogitBias(Edit):
    """Additive attention-logit bias. Subclasses implement `bias`.

    Added to the scaled (and, in soft-capping families, soft-capped) logits together with the
    model's mask, before the softmax.
    """

    site: ClassVar[str] = "logits"
    per_column: ClassVar[bool] = False
    """True when `bias` never depends on the query row (shape `[batch or 1, n_heads or 1, 1,
    k_len]`): such a bias runs in the fused kernel (`heads.engine.kernels.fused`, `editing(kernel=...)`)."""

    reads_scores: ClassVar[bool] = False
    """True for a bias that is a function of the logits themselves (`score_bias`, e.g. AdaptVis's
    temperature on the image columns): it runs on the blocked path, after the logits are formed."""

    rank_one: ClassVar[bool] = False
    """True when the bias is a row term times a column term, `beta[b, h, q] * cols[b, k]`
    (`row_column_bias`, e.g. attention knockout from chosen query rows to chosen key columns):
    such a bias also runs in the fused kernel, in its per-row span term."""

    def bias(self, call: AttentionCall) -> torch.Tensor:
        """fp32 tensor broadcastable to `[batch, n_heads, q_len, k_len]`."""
        raise NotImplementedError

    def row_column_bias(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        """With `rank_one`: `(beta, cols)`, fp32 `beta` broadcastable to `[batch, n_heads, q_len]`
        and fp32 `cols` `[batch or 1, k_len]`, such that `bias(call)` equals `beta[..., None] *
        cols[:, None, None, :]` wherever it is finite (`beta` may hold `-inf` where `bias` does:
        the engine clamps it to the fp32 minimum, which blocks the key exactly as `-inf` would)."""
        raise NotImplementedError

    def score_bias(self, scores: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """With `reads_scores`: the bias as a function of the fp32 logits `scores` `[batch,
        n_heads, q_len, k_len]` (scaled and soft-capped, before the mask), same shape or broadcastable."""
        raise NotImplementedError


@dataclass(eq=False, repr=False)
class ProbEdit(Edit):
    """Function of the post-softmax attention pattern. Subclasses implement `apply`."""

    site: ClassVar[str] = "probs"
    reads_only: ClassVar[bool] = False
    """True for an edit whose `apply` returns the pattern unchanged (it only reads it, e.g.
    `Recorder`): a layer whose pattern edits all read only computes its output with the model's
    own attention (bitwise the unedited model, in every dtype) and the pattern beside it."""
    uses_pattern_of: ClassVar[bool] = False
    """True for an edit that calls `call.pattern_of` (the blocked kernel builds it only then)."""

    def block_rows(self, batch: int, n_heads: int, k_len: int) -> int | None:
        """At most this many query rows per block of the blocked kernel (default None: its
        `QUERY_BLOCK`): an edit that computes more block-sized `[B, H, rows, K]` tensors caps
        them to keep the layer's memory a small part of a forward's."""
        return None

    def apply(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """Map fp32 probs `[batch, n_heads, q_len, k_len]` to new probs of the same shape."""
        raise NotImplementedError


@dataclass(eq=False, repr=False)
class Recorder(ProbEdit):
    """Reads the (edited) attention pattern of one layer without changing it.

    `fn(probs, call)` gets fp32 probs `[batch, n_heads, q_len, k_len]` after all
    other edits of the layer and returns anything; results are appended to
    `records` in call order (one per attention call and query block).

    `query_range=(start, stop)` keeps only the query rows at absolute positions `start <= p <
    stop`: `fn` sees those rows of each block (`call.q_offset` / `call.q_len` describe them) and a
    block without any is skipped. When every edit of a layer only reads the pattern, the engine
    computes just those rows (QRHead's query rows of a long document: `[H, rows, T]`, never
    `[H, T, T]`) in blocks of `read_block_rows` rows, so a reduction in `fn` keeps memory linear
    in the sequence (docs/long-context.md).

    Raises:
        HeadsteerTypeError / HeadsteerValueError: `query_range` not two ints `0 <= start < stop`.
    """

    reads_only: ClassVar[bool] = True
    fn: Callable[[torch.Tensor, AttentionCall], object] | None = None
    records: list = field(default_factory=list, init=False)
    query_range: tuple[int, int] | None = None

    def validate(self) -> None:
        super().validate()
        r = self.query_range
        if r is None:
            return
        if isinstance(r, (str, bytes)) or not isinstance(r, Sequence) or len(r) != 2:
            raise HeadsteerTypeError(f"query_range must be (start, stop) ints or None, got {short_repr(r)}")
        start = check_int("query_range start", r[0], lo=0, type_error=True)
        stop = check_int("query_range stop", r[1], lo=start + 1)
        self.query_range = (start, stop)

    def apply(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        if self.query_range is not None:
            start = max(self.query_range[0], call.q_offset)
            stop = min(self.query_range[1], call.q_offset + call.q_len)
            if stop <= start:
                return probs
            rows = probs[:, :, start - call.q_offset : stop - call.q_offset]
            sub = replace(call, q_len=stop - start, q_offset=start, split=True)
            self.records.append(rows.detach().clone() if self.fn is None else self.fn(rows, sub))
            return probs
        if self.fn is None:
            self.records.append(probs.detach().clone())
        else:
            self.records.append(self.fn(probs, call))
        return probs


@dataclass(eq=False, repr=False)
class SpanShareEdit(ProbEdit):
    """A pattern edit that depends on the pattern only through each row's share of attention on
    a set of key columns (the *span*), and that rescales the span: `W' = softmax(S + beta m)`,
    i.e. `W * e^(beta m)` renormalised, with a per-row bias `beta` (SpotLight).

    Because only the shares are read, the fused kernel (`heads.engine.kernels.fused`) runs it without
    materialising the pattern: one pass gets each row's span mass and total mass, the edit
    turns them into `beta`, a second pass applies it. Subclasses implement `span_columns`
    and `span_beta`; `apply` (the blocked path) is derived from them.
    """

    def span_columns(self, call: AttentionCall) -> torch.Tensor:
        """`[batch, k_len]` bool: the span's key columns in this call."""
        raise NotImplementedError

    def span_beta(self, num: torch.Tensor, den: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
        """The bias `beta` broadcastable to `[batch, n_heads, q_len]` (fp32; 0 = row unchanged),
        or None when no row changes.

        Args:
            num: fp32 `[batch, n_heads, q_len]` attention mass on the span per row (0 on the
                (row, head) pairs the edit does not touch).
            den: the same for the whole row (1 for a row with visible keys, else 0).
        """
        raise NotImplementedError

    def apply(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        m = self.span_columns(call).to(probs.device)[:, None, None, :]  # [B, 1, 1, K]
        heads = self.head_mask(call.batch, call.n_heads, probs.device)[:, :, None]  # [B|1, H, 1]
        w = probs.float()
        num = torch.where(heads, (w * m).sum(-1), 0.0)  # [B, H, Q]; pad rows are all-zero
        den = torch.where(heads, w.sum(-1), 0.0)
        beta = self.span_beta(num, den, call)
        if beta is None:
            return probs  # bitwise unchanged
        beta = beta.expand_as(num)[..., None]  # [B, H, Q, 1]
        scaled = torch.where(m, w * torch.exp(beta), w)
        new = scaled / scaled.sum(-1, keepdim=True).clamp(min=1e-30)
        return torch.where(beta != 0, new, probs)


MAX_FACTOR = 1e4
"""Largest |factor| a scaling edit accepts: beyond it activations overflow in low precision."""


def max_factor(dtype: torch.dtype) -> float:
    """Largest |factor| a scaling edit may apply to activations of `dtype`.

    `MAX_FACTOR` (1e4), and at most sqrt(M) where M is the largest finite value of `dtype`,
    so that a factor times an activation of the same size stays finite: 255 in float16
    (M = 65504), 1e4 in bfloat16 and float32 (M ~ 3.4e38). Integer dtypes: `MAX_FACTOR`.
    """
    if not dtype.is_floating_point:
        return MAX_FACTOR
    return min(MAX_FACTOR, math.floor(math.sqrt(torch.finfo(dtype).max)))


class _Scaling(Protocol):
    """An edit with a scale `factor` (`HeadScale`, `QueryScale`)."""

    factor: float


def check_factor(edit: _Scaling) -> None:
    """TypeError / ValueError unless `edit.factor` is a finite number with |factor| <= MAX_FACTOR."""
    name, factor = type(edit).__name__, edit.factor
    if not is_real(factor):
        raise HeadsteerTypeError(f"{name} factor must be a number, got {short_repr(factor)}")
    if not is_number(factor) or not math.isfinite(factor) or abs(factor) > MAX_FACTOR:
        raise HeadsteerValueError(
            f"{name} factor must be finite with |factor| <= {MAX_FACTOR:g}, got {short_repr(factor)}"
        )


@dataclass(eq=False, repr=False)
class HeadOutputEdit(Edit):
    """Function of the heads' outputs `z` (`o_proj` input). Subclasses implement `apply`."""

    site: ClassVar[str] = "head_output"

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """Map `z` `[batch, q_len, n_heads, d_head]` to a tensor of the same shape."""
        raise NotImplementedError


@dataclass(eq=False, repr=False)
class HeadScale(HeadOutputEdit):
    """Multiply the chosen heads' outputs by `factor` (0 = zero ablation; 1 = no-op).

    `positions` restricts the scaling to some query positions; None (default) scales every
    position. A position `p >= 0` is an absolute token position of the (left-padded)
    sequence, the same at prefill and at every decode step with or without a KV cache
    (positions are absolute): with a cache, position `p` of the prompt is scaled once, at prefill, and a
    generated token's position when that token is the new row. A negative `p` counts back
    from the last query row of each forward call: `-1` is the last position of a scoring
    forward, and with a KV cache also every newly generated token (so `-1` alone is not
    cache-invariant during generation). A position no call ever reaches leaves the edit
    unfired (`editing(..., require_fired=True)` then raises `EditNeverFired`).

    Raises:
        TypeError: a factor that is not a number, or positions that are not a list of ints.
        ValueError: a non-finite factor or |factor| > 1e4, or an empty `positions`.
    """

    factor: float = 0.0
    positions: Sequence[int] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        super().validate()
        check_factor(self)
        ps = self.positions
        if ps is None:
            return
        if isinstance(ps, (str, bytes)) or not isinstance(ps, Iterable):
            raise HeadsteerTypeError(f"positions must be a list of ints or None, got {short_repr(ps)}")
        ps = list(ps)
        if any(not is_int(p) for p in ps):
            raise HeadsteerTypeError(f"positions must be ints, got {short_repr(ps)}")
        if not ps:
            raise HeadsteerValueError(
                "positions is empty: the edit would scale nothing (None = every position)"
            )
        self.positions = tuple(int(p) for p in ps)  # a generator or an array, read once

    def is_identity(self) -> bool:
        return self.factor == 1.0

    def _rows(self, call: AttentionCall) -> torch.Tensor:
        """`[q_len]` bool: the call's query rows at the chosen positions (see the class doc)."""
        rows = torch.zeros(call.q_len, dtype=torch.bool)
        for p in self.positions or ():  # called only with positions set
            r = int(p) - call.q_offset if p >= 0 else call.q_len + int(p)
            if 0 <= r < call.q_len:
                rows[r] = True
        return rows

    def acts_on(self, call: AttentionCall) -> bool:
        return self.positions is None or bool(self._rows(call).any())

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        if self.positions is None:
            return z * self.factor
        rows = self._rows(call).to(z.device)[None, :, None, None]
        return torch.where(rows, z * self.factor, z)


@dataclass(eq=False, repr=False)
class QueryEdit(Edit):
    """Function of the heads' queries as attention sees them. Subclasses implement `apply`.

    The engine applies it to the query the attention function receives: after any QK-norm
    (Qwen 3, Gemma 3 per head; OLMo 2 over all heads) and after RoPE, for separate and fused
    QKV projections alike, so a scaled head stays scaled in the logits.
    """

    site: ClassVar[str] = "query"

    def apply(self, q: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """Map `q` `[batch, q_len, n_heads, d_head]` to a tensor of the same shape."""
        raise NotImplementedError


@dataclass(eq=False, repr=False)
class QueryScale(QueryEdit):
    """Multiply the chosen query heads' query slices by `factor` (UA ablation: factor = eps).

    The attention logits of the head become `factor * q.k / sqrt(d_head)`; with factor 0 the
    pattern is exactly uniform over the visible (causal, unpadded, in-window) keys. It acts after
    any QK-norm, which would otherwise undo it; RoPE is linear, so scaling before or after it
    is the same (docs/methods/ablation.md). K and V, shared by a GQA group, are never touched.

    Raises:
        TypeError / ValueError: a factor that is not a finite number.
    """

    factor: float = 0.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        super().validate()
        check_factor(self)

    def is_identity(self) -> bool:
        return self.factor == 1.0

    def apply(self, q: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return q * self.factor


@dataclass(eq=False, repr=False)
class ResidualEdit(Edit):
    """Reads (or replaces) the residual stream entering decoder layer `layer`.

    Runs in a forward pre-hook on the layer at every forward, prefill and each decode step.
    `heads` and `row_heads` do not apply (the residual is not per head). Subclasses implement
    `apply`.
    """

    site: ClassVar[str] = "residual"

    def validate(self) -> None:
        """As `Edit.validate`; also ValueError for `heads` / `row_heads` (not per head here)."""
        super().validate()
        if self.heads is not None or self.row_heads is not None:
            raise HeadsteerValueError(
                f"{type(self).__name__} acts on the whole residual stream: heads / row_heads do not apply"
            )

    def apply(self, x: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
        """Read `x` `[batch, T, d_model]` (the layer's input); return None, or a new tensor of the
        same shape to feed the layer instead.

        `call.q_offset` is the absolute position of `x`'s first row (the number of cached
        positions) and `call.q_len` its length `T`.
        """
        raise NotImplementedError


@dataclass(eq=False, repr=False)
class ResidualRecorder(ResidualEdit):
    """Records the residual stream entering `layer`: `records` gets one `[batch, T, d_model]` copy
    (or `fn(x, call)`) per forward; the stream is not changed."""

    fn: Callable[[torch.Tensor, AttentionCall], object] | None = None
    records: list = field(default_factory=list, init=False)

    def apply(self, x: torch.Tensor, call: AttentionCall) -> None:
        self.records.append(x.detach().clone() if self.fn is None else self.fn(x, call))
        return None


def check_combined_factors(edits: Iterable[Edit], n_heads: int, dtype: torch.dtype) -> None:
    """HeadsteerValueError when the `HeadScale` (or the `QueryScale`) edits that reach one head
    multiply to more than `max_factor(dtype)`: each factor may be in bounds while their product
    overflows (eight `HeadScale(1e4)` on one head give 1e32, whose square in the next norm is not
    finite in float32). Other edits are not looked at.

    Args:
        edits: the edits applied together (one `editing` context, or one request's steering).
        n_heads: query heads per layer (an edit with `heads=None` reaches all of them).
        dtype: the model's dtype.
    """
    bound = max_factor(dtype)
    product: dict[tuple[str, int, int], float] = {}
    for e in edits:
        if not isinstance(e, HeadScale | QueryScale):
            continue
        for h in range(n_heads) if e.heads is None else e.heads:
            key = (type(e).__name__, e.layer, h)
            product[key] = product.get(key, 1.0) * abs(float(e.factor))
            if product[key] > bound:
                name = str(dtype).replace("torch.", "")
                raise HeadsteerValueError(
                    f"the {key[0]} factors on layer {e.layer} head {h} multiply to {product[key]:g}, "
                    f"more than {bound:g} ({name} would overflow): steer each head once, or with a "
                    "smaller factor"
                )
