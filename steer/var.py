"""VAR: visual attention redistribution (Kang et al., ICLR 2025, arXiv:2503.03321; docs/methods/var.md),
for images and for a marked text context.

In each edited layer, sinks are the key tokens whose residual state entering the layer has a
massive value in the backbone's sink dims (phi >= tau, `heads.scorers.sink_dims`), flagged at every
forward (prefill and each decode step) per batch row. For every (row, head, query) the
*unmodified* pattern a decides whether the head is image-centric there:

* image mass m = sum_{j in I_v} a_j; skip when m < 0.2 (the floor);
* non-sink image ratio r = sum_{j in I_v minus sinks} a_j / m; select when r >= rho (paper).

In a selected row a fraction p of the mass on **all** sinks (text and image) moves to the
non-sink image keys in proportion to their weights (docs/methods/var.md):
a'_sink = (1 - p) a, a'_j = a_j + p * sum_sinks a * a_j / sum_{k in I_v minus sinks} a_k, every
other key unchanged, so rows still sum to 1.

Query rows: at prefill only rows after the image span of their batch row; at decode every new
row. Cached keys are untouched (only the current rows' weights change). The last layer is
skipped by default. The reference code's complements (rho_code = 1 - rho, p_code = 1 - p) are
accepted by `Var.from_reference`.

Text variant ("VAR-text"): the "image" is the emphasized context passage (`**...**` markup or
`emphasize=`); sink mass moves to non-sink passage tokens in context-centric heads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from heads._util.validation import check_layer_list, check_number, is_number, short_repr
from heads.engine.edits import AttentionCall, Edit, ProbEdit
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.scorers.sink_dims import SinkTracker, sink_dims_for, sink_tau_for
from steer.span_rows import warn_rows_without_span

__all__ = ["Var", "VarEdit", "var_redistribute"]


_STACK_LIMIT = 1 << 22
"""Most elements of the `[B, H, Q, 3, K]` product summed in one op (else three separate sums)."""


def var_redistribute(
    probs: torch.Tensor,
    sink: torch.Tensor,
    region: torch.Tensor,
    eligible: torch.Tensor,
    *,
    rho: float = 0.5,
    p: float = 0.6,
    floor: float = 0.2,
    require_visual_sink: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAR update of one attention call (docs/methods/var.md), vectorised over (row, head, query).

    Args:
        probs: `[B, H, Q, K]` post-softmax pattern (fp32).
        sink: `[B, K]` bool, sink keys.
        region: `[B, K]` bool, image (or context) keys.
        eligible: `[B, Q]` bool, query rows VAR may edit (after the image / decode rows).
        rho: least non-sink image ratio r to select a row (paper semantics; default 0.5).
        p: fraction of the sink mass moved (paper semantics; default 0.6).
        floor: least image mass m to consider a row (default 0.2).
        require_visual_sink: select only rows whose batch row has a sink inside the image.

    Returns:
        `(new_probs, selected)`: `[B, H, Q, K]` and `[B, H, Q]` bool. Unselected rows are
        bitwise `probs`; rows with m = 0, no non-sink image mass or no sink mass are unselected
        (no NaN).

    Only the query rows from the first eligible one on are computed (at prefill the rows
    before the image are skipped); the three masses come from one product when it is small
    (decode steps), which sums the same values in the same order as three separate sums.
    """
    bsz, n_heads, q_len, _ = probs.shape
    none = torch.zeros(bsz, n_heads, q_len, dtype=torch.bool, device=probs.device)
    if q_len > 1:
        rows = eligible.any(0)
        if not bool(rows.any()):
            return probs, none
        q0 = int(rows.to(torch.uint8).argmax())  # first eligible query row of any batch row
    else:
        q0 = 0
    w = probs[:, :, q0:].float()
    free_keys = region & ~sink
    if w.numel() * 3 <= _STACK_LIMIT:
        keys = torch.stack([region, free_keys, sink], dim=1).to(w.dtype)[:, None, None]  # [B,1,1,3,K]
        m, free, sunk = (w.unsqueeze(-2) * keys).sum(-1).unbind(-1)
    else:
        m, free, sunk = ((w * k.to(w.dtype)[:, None, None, :]).sum(-1) for k in (region, free_keys, sink))
    r = free / m.clamp(min=1e-30)
    # free > 0 implies m > 0 (a sum of non-negative terms with a positive one), and r >= rho > 0
    # implies free > 0: the tests that cannot change the result are left out
    sel = (m >= floor) & (r >= rho) & (sunk > 0)
    if rho <= 0:
        sel = sel & (free > 0)
    if not (q_len == 1 and bool(eligible.all())):
        sel = sel & eligible[:, None, q0:]
    if require_visual_sink:
        sel = sel & (sink & region).any(-1)[:, None, None]
    if not bool(sel.any()):
        return probs, none
    gain = (p * sunk / free.clamp(min=1e-30))[..., None]
    sink_k = sink[:, None, None, :]
    new = torch.where(sink_k, w * (1 - p), torch.where(free_keys[:, None, None, :], w + gain * w, w))
    out = torch.where(sel[..., None], new.to(probs.dtype), probs[:, :, q0:])
    if q0 == 0:
        return out, sel
    return torch.cat([probs[:, :, :q0], out], dim=2), torch.cat([none[:, :, :q0], sel], dim=2)


@dataclass(eq=False, repr=False)
class VarEdit(ProbEdit):
    """VAR in one layer (a probabilities edit, run by the engine in edited layers).

    Attributes:
        region: `[B, P]` bool image / context columns (padded prompt coordinates).
        start: `[B]` long, first prompt query position edited per row (the end of its last
            span; rows without a span never reach it).
        rho: see `var_redistribute`.
        p: see `var_redistribute`.
        floor: see `var_redistribute`.
        require_visual_sink: see `var_redistribute`.
        tracker: the `SinkTracker` that flags this layer's sinks.
        selected: `[H]` long, query rows selected so far per head (for the head map; None
            before the first call).
        considered: `[H]` long, eligible query rows seen so far per head.
    """

    region: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, dtype=torch.bool))
    start: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.long))
    rho: float = 0.5
    p: float = 0.6
    floor: float = 0.2
    require_visual_sink: bool = False
    tracker: SinkTracker | None = None
    # per-row running counts on the call's device: [B, H] selected rows, [B] eligible rows
    _sel_rows: torch.Tensor | None = field(default=None, init=False)
    _elig_rows: torch.Tensor | None = field(default=None, init=False)
    _dev: dict = field(default_factory=dict, init=False)  # device -> (region buffer, start)

    def is_identity(self) -> bool:
        return self.p == 0 or not bool(self.region.any())

    @property
    def selected(self) -> torch.Tensor | None:
        if self._sel_rows is None:
            return None
        mask = self.head_mask(self._sel_rows.shape[0], self._sel_rows.shape[1], self._sel_rows.device)
        return (self._sel_rows * mask).sum(0).cpu()

    @property
    def considered(self) -> torch.Tensor | None:
        if self._elig_rows is None or self._sel_rows is None:
            return None
        mask = self.head_mask(self._sel_rows.shape[0], self._sel_rows.shape[1], self._elig_rows.device)
        return (self._elig_rows[:, None] * mask).sum(0).cpu()

    def _on(self, dev: torch.device, k_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`([B, k_len] region columns, [B] start)` on `dev`, from a buffer that grows by doubling."""
        buf, start = self._dev.get(dev, (None, None))
        if buf is None or start is None or buf.shape[1] < k_len:
            width = max(k_len, self.region.shape[1], 2 * (0 if buf is None else buf.shape[1]))
            buf = torch.zeros(self.region.shape[0], width, dtype=torch.bool, device=dev)
            n = min(width, self.region.shape[1])
            buf[:, :n] = self.region[:, :n].to(dev)
            start = self.start.to(dev)
            self._dev[dev] = (buf, start)
        return buf[:, :k_len], start

    def apply(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        if self.region.shape[0] != call.batch:
            built = self.region.shape[0]
            raise HeadsteerValueError(f"VAR was built for {built} prompts, the call has {call.batch} rows")
        dev = probs.device
        assert self.tracker is not None  # set by Var.edits
        sink = self.tracker.mask(self.layer, call.k_len, dev)
        region, start = self._on(dev, call.k_len)
        if call.q_len == 1:
            eligible = (start <= call.q_offset)[:, None]  # [B, 1]
        else:
            eligible = call.query_positions[None, :] >= start[:, None]  # [B, Q]
        new, sel = var_redistribute(
            probs,
            sink,
            region,
            eligible,
            rho=self.rho,
            p=self.p,
            floor=self.floor,
            require_visual_sink=self.require_visual_sink,
        )
        n_sel, n_elig = sel.sum(-1), eligible.sum(-1)
        if self._sel_rows is None or self._elig_rows is None or self._sel_rows.device != dev:
            self._sel_rows, self._elig_rows = n_sel, n_elig
        else:
            self._sel_rows = self._sel_rows + n_sel
            self._elig_rows = self._elig_rows + n_elig
        return new


_KEYS = (
    "rho",
    "p",
    "tau",
    "floor",
    "layers",
    "skip_last",
    "sink_dims",
    "target",
    "sinks_from_prefill_only",
    "require_visual_sink",
    "enabled",
)


def _unit(name: str, x: object) -> float:
    if not is_number(x) or not math.isfinite(x):
        raise HeadsteerValueError(f"{name} must be a number in [0, 1], got {short_repr(x)}")
    if not 0 <= float(x) <= 1:
        raise HeadsteerValueError(f"{name} must be a number in [0, 1], got {short_repr(x)}")
    return float(x)


@dataclass(frozen=True)
class Var:
    """Visual attention redistribution (VAR), for an image or a marked text context.

    Args:
        rho: least non-sink image ratio of a selected (image-centric) row, paper semantics
            (default 0.5; the paper quotes 0.8 general, 0.5 hallucination, 0.9 vision-centric).
        p: fraction of the sink mass moved to the image, paper semantics (default 0.6).
        tau: sink threshold on phi (default `heads.scorers.sink_dims.sink_tau_for`: calibrated for
            known backbones, else 20 sqrt(D/4096)).
        floor: least image mass of a considered row (default 0.2).
        layers: edited layers (default every layer; with `skip_last`, every layer but the
            last, the paper's rule, for images and text alike). The reference code flags sinks
            only from layer 2 on; the measured VAR-text results use this default, so it is
            kept: pass `layers=range(2, L - 1)` for the reference's range.
        skip_last: never edit the last layer (default True, the paper's rule).
        sink_dims: the backbone's sink dimensions (default: `heads.scorers.sink_dims.KNOWN_SINK_DIMS`
            by config; an unknown backbone raises).
        target: `"image"`, `"text"` (the emphasized context passage) or `"auto"` (image spans
            where the batch has any, else the emphasized text; default).
        sinks_from_prefill_only: flag sinks only among prompt tokens (the reference's rule;
            default False: generated tokens too).
        require_visual_sink: edit a row only if its image holds a sink in that layer (the
            reference's rule; default False).
        enabled: False gives no edits at all (bitwise baseline).

    Raises:
        ValueError: a parameter out of range or an unknown target (at construction); unknown
            sink dims for the backbone, or no span in any prompt (when applied).

    Source: Kang et al. 2025, §4 (Eq. 4-6); reference code seilk/VisAttnSink (issue #5).
    """

    rho: float = 0.5
    p: float = 0.6
    tau: float | None = None
    floor: float = 0.2
    layers: tuple[int, ...] | None = None
    skip_last: bool = True
    sink_dims: tuple[int, ...] | None = None
    target: Literal["auto", "image", "text"] = "auto"
    sinks_from_prefill_only: bool = False
    require_visual_sink: bool = False
    enabled: bool = True
    last: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        _unit("rho", self.rho)
        _unit("p", self.p)
        _unit("floor", self.floor)
        if self.tau is not None:
            check_number("tau", self.tau, lo=0, lo_open=True, what="a positive number")
        if self.target not in ("auto", "image", "text"):
            raise HeadsteerValueError(
                f"unknown target {short_repr(self.target)}: use 'auto', 'image' or 'text'"
            )
        for name in ("skip_last", "sinks_from_prefill_only", "require_visual_sink", "enabled"):
            if not isinstance(getattr(self, name), bool):
                raise HeadsteerValueError(f"{name} must be a bool, got {short_repr(getattr(self, name))}")
        if self.layers is not None:
            check_layer_list("layers", self.layers)

    @classmethod
    def from_config(cls, config: Mapping) -> Var:
        """A `Var` from a dict of its arguments; unknown keys (e.g. the reference README's
        `beta`) are rejected (docs/methods/var.md).

        Raises:
            ValueError: an unknown key or a bad value.
        """
        unknown = sorted(set(config) - set(_KEYS))
        if unknown:
            raise HeadsteerValueError(f"unknown VAR config keys {unknown}: allowed are {', '.join(_KEYS)}")
        kw = dict(config)
        for k in ("layers", "sink_dims"):
            if isinstance(kw.get(k), list):
                kw[k] = tuple(kw[k])
        return cls(**kw)

    @classmethod
    def from_reference(cls, rho_code: float, p_code: float, **kwargs: Any) -> Var:
        """A `Var` from the reference code's complements: rho = 1 - rho_code (it tests visual-sink
        mass / m <= rho_code), p = 1 - p_code (its `p` is the fraction kept)
        (docs/methods/var.md; the reference's issue #5)."""
        return cls(rho=1 - _unit("rho_code", rho_code), p=1 - _unit("p_code", p_code), **kwargs)

    def spans(self, enc: EncodedPrompts) -> list[list[tuple[int, int]]]:
        """Per row, the image (or context) spans VAR redistributes towards (see `target`)."""
        return enc.select_spans(self.target)

    def edit_layers(self, model: HeadModel) -> list[int]:
        """The edited layers on `model` (the last one dropped when `skip_last`)."""
        layers = range(model.n_layers) if self.layers is None else [int(x) for x in self.layers]
        for la in layers:
            model.check_head(la, 0)
        return sorted({la for la in layers if not (self.skip_last and la == model.n_layers - 1)})

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> list[Edit]:
        """One `VarEdit` per edited layer for the batch `enc`, then the `residual`-site reads of a
        fresh `SinkTracker` (so nothing carries over from an earlier batch) that flag the sinks
        entering each edited layer (`SinkTracker.edits`; apply all of them in one `editing()`).
        The tracker's state is in `self.last["tracker"]` for inspection.

        Raises:
            ValueError: unknown sink dims for this backbone (pass `sink_dims=`), no span in
                any prompt, or an unknown layer.
        """
        if not self.enabled:
            return []
        dims = sink_dims_for(model, self.sink_dims)
        layers = self.edit_layers(model)
        spans = self.spans(enc)
        if not any(spans):
            raise HeadsteerValueError("VAR needs an image or a marked context passage (**...** / emphasize=)")
        warn_rows_without_span(enc, "VAR", spans=spans)
        if not layers:
            return []
        region = torch.zeros(enc.batch, enc.length, dtype=torch.bool)
        start = torch.full((enc.batch,), torch.iinfo(torch.long).max, dtype=torch.long)
        for b, row in enumerate(spans):
            for t0, t1 in row:
                region[b, t0:t1] = True
            if row:
                start[b] = max(t1 for _, t1 in row)
        tau = sink_tau_for(model) if self.tau is None else float(self.tau)
        prefill_only = self.sinks_from_prefill_only
        tracker = SinkTracker(dims, tau, layers, prefill_only=prefill_only, prefill_len=enc.length)
        self.last["tracker"] = tracker
        edits: list[Edit] = [
            VarEdit(
                layer=la,
                region=region,
                start=start,
                tracker=tracker,
                rho=self.rho,
                p=self.p,
                floor=self.floor,
                require_visual_sink=self.require_visual_sink,
            )
            for la in layers
        ]
        return [*edits, *tracker.edits()]  # the residual reads that flag the sinks
