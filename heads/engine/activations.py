"""Edits of any activation site: `ActivationEdit` (read or replace) and `ActivationRecorder` (keep).

One generic class serves every site of the engine's table that carries a tensor of the forward
(`heads.engine.sites.SITES`: the embeddings, the residual stream at each block boundary, the
attention and MLP outputs, q / k / v per head, the heads' outputs `z`, the final norm's scale).
An edit names its site and layer, and either a function `fn(x, call)` or a subclass's `apply`:

    from heads.engine.activations import ActivationEdit, ActivationRecorder

    patch = ActivationEdit("resid_mid", layer=3, fn=lambda x, call: clean_mid)  # replace
    keep = ActivationRecorder("k", layer=2)                                    # [B, T, G, d]
    with editing(model, [patch, keep]):
        logits = forward(model, enc)
    (k,) = keep.records

`fn` returns None (a read: the tensor flows on unchanged) or a tensor of the same shape, which
replaces the activation for the rows (`rows`) and heads (`heads`, `row_heads`: query heads at
`q` and `head_output`, KV heads at `k` and `v`) the edit selects; the other entries keep their
value bit for bit. Replacements keep the autograd graph (gradients flow through `fn`'s result
and through the entries kept), so attribution methods can differentiate through them; a
recorder keeps a detached copy unless `detach=False`, then the live tensor.

`call` (`heads.engine.edits.AttentionCall`) gives the layer, the batch, and the absolute position
of the call's first row, `call.q_offset` (the KV-cache length): row `t` of `x` is absolute
position `call.q_offset + t`, the same at prefill and at every decode step.

The sites run on every backend (`hf`, `transformer_lens`, `nnsight`: `docs/architecture.md`,
"Sites"); a site the model's family does not have (`resid_mid` in a parallel block,
`pos_embed` with rotary positions, `attn_out_pre_norm` without a post-norm) is a `ValueError` at
`editing()`, before any forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from heads._util.validation import short_repr
from heads.engine.edits import AttentionCall, Edit
from heads.engine.sites import ALIASES, SITES
from heads.engine.state import cast_result
from heads.errors import HeadsteerTypeError, HeadsteerValueError

__all__ = ["ACTIVATION_SITES", "ActivationEdit", "ActivationRecorder", "apply_activation_edits"]

ACTIVATION_SITES = tuple(
    n for n, s in SITES.items() if not s.attention or n in ("query", "rot_k", "attn_scores")
)
"""The sites an `ActivationEdit` may name (every site but the attention pattern and the logit
biases, which have `ProbEdit` / `Recorder` and `LogitBias`), plus the aliases `resid_pre` and `z`."""


@dataclass(eq=False, repr=False, init=False)
class ActivationEdit(Edit):
    """Reads or replaces the activation at `site` in `layer` (see the module docstring).

    Args:
        site: a name of `ACTIVATION_SITES` (or `resid_pre` = `residual`, `z` = `head_output`).
        layer: the block, 0-based; 0 for the model-level sites (`embed`, `pos_embed`,
            `ln_final.scale`).
        fn: `fn(x, call) -> Tensor | None`; None: subclass and override `apply`.
        heads: head indices on the head axis of a per-head site (query heads at `q`, `query`,
            `head_output`; KV heads at `k`, `v`); None = all. Not for stream sites.
        row_heads: `[batch, n]` bool (n the head axis), per row and head.
        rows: batch rows to edit (a list of ints or a `[batch]` bool tensor); None = all rows.

    Raises:
        HeadsteerValueError: an unknown site, heads on a site without a head axis, a
            replacement at a read-only site (raised when the edit returns one), a bad `rows`.
        HeadsteerTypeError: `fn` not callable, a layer that is not an int.
    """

    fn: Callable[[torch.Tensor, AttentionCall], torch.Tensor | None] | None = None
    rows: Sequence[int] | torch.Tensor | None = None

    def __init__(
        self,
        site: str,
        layer: int = 0,
        fn: Callable[[torch.Tensor, AttentionCall], torch.Tensor | None] | None = None,
        *,
        heads: Sequence[int] | None = None,
        row_heads: torch.Tensor | None = None,
        rows: Sequence[int] | torch.Tensor | None = None,
    ):
        if not isinstance(site, str) or ALIASES.get(site, site) not in ACTIVATION_SITES:
            raise HeadsteerValueError(
                f"unknown activation site {short_repr(site)}: one of {', '.join(ACTIVATION_SITES)} "
                "(or resid_pre, z)"
            )
        vars(self)["site"] = ALIASES.get(site, site)  # per instance: the class serves every site
        self.layer = layer
        self.heads = heads
        self.row_heads = row_heads
        self.calls = 0
        self.fn = fn
        self.rows = rows
        self.validate()

    def validate(self) -> None:
        """As `Edit.validate`; also: heads only on a per-head site, `fn` callable, `rows` well formed."""
        super().validate()
        site = SITES[str(self.site)]
        if site.heads is None and (self.heads is not None or self.row_heads is not None):
            raise HeadsteerValueError(
                f"site {short_repr(self.site)} has no head axis: heads / row_heads do not apply (use rows=)"
            )
        if self.fn is not None and not callable(self.fn):
            raise HeadsteerTypeError(
                f"fn must be callable (x, call) -> Tensor | None, got {short_repr(self.fn)}"
            )
        r = self.rows
        if r is not None and not isinstance(r, torch.Tensor):
            if isinstance(r, (str, bytes)) or not isinstance(r, Iterable):
                raise HeadsteerTypeError(
                    f"rows must be a list of ints, a bool tensor or None, got {short_repr(r)}"
                )
            r = tuple(r)
            if not r or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in r):
                raise HeadsteerValueError(
                    f"rows must be non-empty, non-negative row indices, got {short_repr(r)}"
                )
            self.rows = r
        elif isinstance(r, torch.Tensor) and (r.dtype != torch.bool or r.dim() != 1):
            raise HeadsteerValueError(f"rows as a tensor must be [batch] bool, got {short_repr(r)}")

    def apply(self, x: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
        """The replacement for `x` (same shape), or None to leave it unchanged (a read)."""
        if self.fn is None:
            raise NotImplementedError(f"{type(self).__name__}: pass fn= or override apply")
        return self.fn(x, call)

    def row_mask(self, batch: int, device: torch.device) -> torch.Tensor | None:
        """`[batch]` bool of the rows this edit touches, or None for all rows."""
        if self.rows is None:
            return None
        if isinstance(self.rows, torch.Tensor):
            if self.rows.shape[0] != batch:
                raise HeadsteerValueError(
                    f"{self!r}: rows has {self.rows.shape[0]} entries, the call has {batch} rows"
                )
            return self.rows.to(device)
        if max(self.rows) >= batch:
            raise HeadsteerValueError(f"{self!r}: row {max(self.rows)} is beyond the call's {batch} rows")
        mask = torch.zeros(batch, dtype=torch.bool, device=device)
        mask[list(self.rows)] = True
        return mask

    def __repr__(self) -> str:
        who = f", heads={self.heads}" if self.heads is not None else ""
        rows = f", rows={short_repr(self.rows)}" if self.rows is not None else ""
        return f"{type(self).__name__}({self.site!r}, layer={self.layer}{who}{rows})"


@dataclass(eq=False, repr=False, init=False)
class ActivationRecorder(ActivationEdit):
    """Keeps the activation at `site` in `layer`, one entry of `records` per forward call.

    Args:
        site, layer, rows: as `ActivationEdit` (`rows` keeps only those rows).
        detach: keep a detached copy (default True); False keeps the live tensor, in the
            autograd graph, so a loss computed from it backpropagates into the model.
        fn: `fn(x, call)` -> anything: keep that instead of the tensor (e.g. a reduction).
    """

    records: list = field(default_factory=list)
    detach: bool = True

    def __init__(
        self,
        site: str,
        layer: int = 0,
        fn: Callable[[torch.Tensor, AttentionCall], object] | None = None,
        *,
        rows: Sequence[int] | torch.Tensor | None = None,
        detach: bool = True,
    ):
        super().__init__(site, layer, None, rows=rows)
        self.keep = fn
        self.detach = bool(detach)
        self.records = []

    def apply(self, x: torch.Tensor, call: AttentionCall) -> None:
        mask = self.row_mask(x.shape[0], x.device)
        if mask is not None:
            x = x[mask]
        if self.keep is not None:
            self.records.append(self.keep(x, call))
        else:
            self.records.append(x.detach().clone() if self.detach else x)
        return None


def _mask_for(edit: Edit, x: torch.Tensor, head_axis: int | None) -> torch.Tensor | None:
    """Bool mask broadcastable to `x` of the entries `edit` replaces, or None for all of them."""
    batch = x.shape[0]
    rows = edit.row_mask(batch, x.device) if isinstance(edit, ActivationEdit) else None
    heads = None
    if head_axis is not None and (edit.heads is not None or edit.row_heads is not None):
        heads = edit.head_mask(batch, x.shape[head_axis], x.device)  # [B|1, n]
    if rows is None and heads is None:
        return None
    shape = [1] * x.dim()
    shape[0] = batch
    mask = torch.ones(batch, 1, dtype=torch.bool, device=x.device) if rows is None else rows[:, None]
    if heads is not None:
        mask = mask & heads
        shape[head_axis] = x.shape[head_axis]  # type: ignore[index]
    return mask.reshape(shape)


def apply_activation_edits(
    edits: Sequence[Edit], x: torch.Tensor, call: AttentionCall, head_axis: int | None = None
) -> torch.Tensor:
    """`x` after each of `edits` in turn (the engine's one way to run an activation site).

    An edit whose `acts_on(call)` is False is skipped uncounted; otherwise its `calls` count runs
    and its `apply(x, call)` result (None: unchanged) replaces `x` where the edit's rows and heads
    select (`head_axis`: the axis of heads in `x`, None for a stream site).

    Raises:
        HeadsteerTypeError / HeadsteerValueError: a result that is not a tensor of `x`'s shape,
            or a replacement at a read-only site.
    """
    for e in edits:
        if not e.acts_on(call):
            continue
        e.calls += 1
        new = e.apply(x, call)  # type: ignore[attr-defined]
        if new is None:
            continue
        site = SITES.get(str(e.site))
        if site is not None and not site.replace:
            raise HeadsteerValueError(f"{short_repr(e)}: site {e.site!r} is read only; it returned a tensor")
        new = cast_result(e, new, x)
        mask = _mask_for(e, x, head_axis)
        x = new if mask is None else torch.where(mask, new, x)
    return x
