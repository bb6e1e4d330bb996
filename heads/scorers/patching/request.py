"""The requests of the causal analyses on prompt pairs: activation patching (`PatchRequest`), path
patching (`PathPatchRequest`), direct logit attribution (`DLARequest`), the logit lens
(`LensRequest`) and attention knockout (`KnockoutRequest`).

Pure data (see `heads.scorers.request_base`): each checks its values when built and its geometry
against a model config (`check_config`) before any weight is read; the pairs themselves are the
analysis' input, checked when it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from heads._util.validation import check_number, short_repr
from heads.errors import HeadsteerValueError
from heads.results.patching import KINDS
from heads.results.stability import check_stability
from heads.scorers.patching.metrics import DIRECTIONS, Metric, get_metric
from heads.scorers.request_base import (
    Geometry,
    Request,
    check_choice,
    check_head_pairs,
    check_layers,
    check_positions,
)

__all__ = [
    "ATTRIBUTION_KINDS",
    "BY_POSITION",
    "KINDS",
    "KNOCKOUT_PER",
    "METHODS",
    "MLP_MODES",
    "RECEIVER_INPUTS",
    "WHICH",
    "DLARequest",
    "KnockoutRequest",
    "LensRequest",
    "PatchRequest",
    "PathPatchRequest",
    "check_kind_family",
]


BY_POSITION = ("resid_pre", "attn_out", "mlp_out", "head_out_by_pos")
"""The kinds scored per position (the ones that take `positions`)."""

METHODS = ("activation", "attribution")
"""`PatchRequest.method`: activation patching (one forward per site) or its first-order
estimate, attribution patching (`heads.scorers.patching.attribution`)."""

ATTRIBUTION_KINDS = ("resid_pre", "attn_out", "mlp_out", "head_out", "head_out_by_pos")
"""The kinds `method="attribution"` estimates (q / k / v / pattern: refused by name)."""

RECEIVER_INPUTS = ("q", "k", "v")
"""The inputs of a receiver head that path patching can patch."""

MLP_MODES = ("recompute", "frozen")
"""How path patching treats the MLPs between sender and receiver."""

WHICH = ("clean", "corrupted")
"""Which prompt of each pair DLA, the lens and knockout run."""

KNOCKOUT_PER = ("all", "layer", "head")
"""How knockout cuts its layers x heads: one cell, each layer alone, each head alone."""

MetricArg = str | Metric | Callable[..., Any]


def _metric(value: object) -> Any:
    """A metric name, `Metric` or function, checked by `get_metric` (an unknown name is named)."""
    get_metric(value)  # type: ignore[arg-type]
    return value


def check_kind_family(family: Any, kind: str, residual_multiplier: float | None = None) -> None:
    """Refuse a patching site kind the model family does not have (from the family entry and
    the config's residual multiplier alone: `Geometry`).

    Raises:
        HeadsteerValueError: `mlp_out` on a family whose MLP is not one module (OPT, BioGPT);
            `mlp_out` where a residual multiplier other than 1 scales it (Granite, HyperCLOVA X,
            MiniCPM3: the engine's site refuses it);
            `k` / `v` on multi-head latent attention (keys and values come from a shared latent);
            `k` where the key norm spans all heads (OLMo 2: a head's key-projection columns are
            not that head's key).
    """
    if family is None:
        return
    name = short_repr(family.model_type)
    if kind == "mlp_out" and family.mlp is None:
        raise HeadsteerValueError(
            f"kind='mlp_out' is not available on {name}: its MLP is not one module (the layers sit in the "
            "decoder block); patch 'resid_pre', 'attn_out' or heads instead"
        )
    if kind == "mlp_out" and residual_multiplier is not None:
        raise HeadsteerValueError(
            f"kind='mlp_out' is not available on {name} with a residual multiplier other than 1: its MLP "
            "output is scaled before it joins the stream, which the engine's mlp_out site does not "
            "reproduce; patch 'resid_pre', 'attn_out' or heads instead"
        )
    if kind in ("k", "v") and family.latent:
        raise HeadsteerValueError(
            f"kind={short_repr(kind)} is not available on {name} (multi-head latent attention: keys and "
            "values come from a shared latent, there is no per-KV-head projection); patch 'q', "
            "'head_out' or 'pattern' instead"
        )
    if kind == "k" and family.qk_norm == "all_heads":
        raise HeadsteerValueError(
            f"kind='k' is not available on {name}: its key norm spans all KV heads, so a head's key "
            "projection columns are not that head's key; patch 'q', 'v', 'head_out' or 'pattern' instead"
        )


def _check_int_positions(geometry: Geometry, name: str, positions: object) -> None:
    if isinstance(positions, tuple):
        for p in positions:
            if isinstance(p, int):
                geometry.check_position(name, p)


@dataclass(frozen=True)
class PatchRequest(Request):
    """Activation patching of every site of `kind` (`heads.patch`).

    Attributes:
        kind: the site kind, one of `KINDS` (default `"head_out"`).
        direction: `"denoising"` (default: clean values into the corrupted run) or `"noising"`.
        metric: `"logit_diff"` (default), `"log_prob"`, `"prob"`, `"kl"`, a `Metric` or a function
            (a function cannot be written as JSON).
        layers: layers to score (default None: all), kept sorted without repeats.
        positions: padded columns for the by-position kinds (`BY_POSITION`; negative counts from
            the end) or `"image"` (vision pairs' image tokens); default None: all.
        stability: bootstrap resamples of the pairs for the head ranking (0: none; 2..10000).
        method: `"activation"` (default: one patched forward per site and pair) or
            `"attribution"` (attribution patching, AtP: the first-order estimate of every site
            from one backward per run, `heads.scorers.patching.attribution`; kinds
            `ATTRIBUTION_KINDS`).

    Raises:
        HeadsteerValueError: an unknown kind / direction / metric / method, positions for a kind
            that patches every position, stability on a kind without heads, a kind
            `method="attribution"` does not estimate (q, k, v, pattern); `check_config`: layers or
            positions out of range, a kind the family does not have (`check_kind_family`),
            `attn_out` with `method="attribution"` where a residual multiplier scales it.
    """

    NAME = "patch"

    kind: str = "head_out"
    direction: str = "denoising"
    metric: MetricArg = "logit_diff"
    layers: Sequence[int] | None = None
    positions: Sequence[int] | str | None = None
    stability: int = 0
    method: str = "activation"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise HeadsteerValueError(f"unknown patching kind {short_repr(self.kind)}; use one of {KINDS}")
        check_choice("method", self.method, METHODS)
        if self.method == "attribution" and self.kind not in ATTRIBUTION_KINDS:
            raise HeadsteerValueError(
                f"method='attribution' does not estimate kind={short_repr(self.kind)} (attribution "
                f"patching covers {ATTRIBUTION_KINDS}); use method='activation' for it"
            )
        check_choice("direction", self.direction, DIRECTIONS)
        _metric(self.metric)
        if self.method == "attribution" and self.direction == "noising" and self.metric == "kl":
            raise HeadsteerValueError(
                "method='attribution' with metric='kl' and direction='noising': KL(clean || run) is "
                "minimal at the clean run, so its gradient there is 0 and every estimate is 0; use "
                "direction='denoising', another metric, or method='activation'"
            )
        object.__setattr__(self, "layers", check_layers("layers", self.layers))
        positions = check_positions("positions", self.positions, names=("image",))
        if positions is not None and self.kind not in BY_POSITION:
            raise HeadsteerValueError(
                f"positions are only taken by the by-position kinds {BY_POSITION}, not "
                f"kind={short_repr(self.kind)} (it patches every position)"
            )
        object.__setattr__(self, "positions", positions)
        stability = check_stability(self.stability)
        if stability and self.kind in ("resid_pre", "attn_out", "mlp_out"):
            raise HeadsteerValueError(f"stability ranks heads; kind={short_repr(self.kind)} has no head axis")
        object.__setattr__(self, "stability", stability)

    def check_geometry(self, geometry: Geometry) -> None:
        check_kind_family(geometry.family, self.kind, geometry.residual_multiplier)
        if (
            self.method == "attribution"
            and self.kind == "attn_out"
            and geometry.residual_multiplier is not None
        ):
            raise HeadsteerValueError(
                "method='attribution' does not estimate kind='attn_out' with a residual multiplier other "
                "than 1: the engine's attn_out site (the gradient's site) does not reproduce the scaling; "
                "estimate 'head_out' or 'resid_pre', or use method='activation'"
            )
        for la in self.layers or ():
            geometry.check_layer("layers", la)
        _check_int_positions(geometry, "positions", self.positions)


@dataclass(frozen=True)
class PathPatchRequest(Request):
    """Path patching from sender heads to receivers (`heads.path_patch`).

    Attributes:
        senders: sender heads (`(layer, head)` pairs or `{layer: [heads]}`); default None: every
            head, one at a time.
        receivers: `"logits"` (default: the residual stream read by the unembedding) or receiver
            heads (KV heads when `inputs` are k / v).
        inputs: the receiver inputs patched: `"q"` (default), `"k"`, `"v"` or a list of them.
        mlp: `"recompute"` (default: MLPs see the patched heads) or `"frozen"`.
        direction: `"noising"` (default) or `"denoising"`.
        metric: as `PatchRequest.metric`.
        positions: padded query columns the senders' paths are patched at (default None: all).

    Raises:
        HeadsteerValueError: an unknown input / mlp mode / direction / metric; inputs other than q
            with `receivers="logits"`; no sender or receiver heads; `check_config`: heads out of
            range, q mixed with k / v on a GQA model, k / v the family does not have per KV head,
            `mlp="frozen"` where the MLP output is not one site (no MLP module, a residual multiplier).
    """

    NAME = "path_patch"

    senders: Sequence[tuple[int, int]] | None = None
    receivers: Sequence[tuple[int, int]] | str = "logits"
    inputs: Sequence[str] | str = "q"
    mlp: str = "recompute"
    direction: str = "noising"
    metric: MetricArg = "logit_diff"
    positions: Sequence[int] | None = None

    def __post_init__(self) -> None:
        check_choice("direction", self.direction, DIRECTIONS)
        check_choice("mlp", self.mlp, MLP_MODES)
        _metric(self.metric)
        inputs = self.inputs
        if isinstance(inputs, str):
            comps: tuple[str, ...] = (inputs,)
        elif isinstance(inputs, Sequence) and inputs and all(isinstance(c, str) for c in inputs):
            comps = tuple(dict.fromkeys(inputs))
        else:
            raise HeadsteerValueError(
                f"inputs must be one of {RECEIVER_INPUTS} or a list of them, got {short_repr(inputs)}"
            )
        for c in comps:
            if c not in RECEIVER_INPUTS:
                raise HeadsteerValueError(
                    f"unknown receiver input {short_repr(c)}; use one of {RECEIVER_INPUTS}"
                )
        object.__setattr__(self, "inputs", comps)
        if isinstance(self.receivers, str) and self.receivers == "logits":
            if comps != ("q",):
                raise HeadsteerValueError(
                    f"inputs={short_repr(inputs)} needs receiver heads; receivers='logits' patches the "
                    "residual stream"
                )
        else:
            if isinstance(self.receivers, str) and not self.receivers.endswith(".json"):
                raise HeadsteerValueError(
                    f"receivers must be 'logits' or a head selection, got {short_repr(self.receivers)}"
                )
            recv = check_head_pairs("receivers", self.receivers)
            if not recv:
                raise HeadsteerValueError("no receiver heads selected")
            object.__setattr__(self, "receivers", recv)
        senders = check_head_pairs("senders", self.senders)
        if senders is not None and not senders:
            raise HeadsteerValueError("no sender heads selected (senders=None is every head)")
        object.__setattr__(self, "senders", senders)
        pos = check_positions("positions", self.positions)
        object.__setattr__(self, "positions", pos)

    def check_geometry(self, geometry: Geometry) -> None:
        family = geometry.family
        if (
            self.mlp == "frozen"
            and family is not None
            and (family.mlp is None or geometry.residual_multiplier is not None)
        ):
            raise HeadsteerValueError(
                f"mlp='frozen' is not available on {short_repr(family.model_type)}: its MLP output is "
                "not one site (no MLP module, or a residual_multiplier other than 1); use mlp='recompute'"
            )
        kv = any(c in ("k", "v") for c in self.inputs)
        if self.receivers != "logits":
            for c in self.inputs:
                check_kind_family(geometry.family, c)
            if kv and "q" in self.inputs and geometry.n_kv_heads != geometry.n_heads:
                raise HeadsteerValueError(
                    "receiver inputs mix q (query heads) with k/v (KV heads) on a GQA model; patch them "
                    "in separate calls"
                )
            for la, h in cast("tuple[tuple[int, int], ...]", self.receivers):
                geometry.check_head("receivers", la, h, kv=kv)
        for la, h in self.senders or ():
            geometry.check_head("senders", la, h)
        _check_int_positions(geometry, "positions", self.positions)


def position_columns(positions: Sequence[int] | None, width: int) -> Any:
    """`[P]` long tensor: the padded columns of `positions` (negative counted from the end) in a
    batch `width` columns wide, or None for every column.

    Raises:
        HeadsteerValueError: a position outside the width, or two positions naming the same
            column (e.g. 3 and -8 of 11), named."""
    import torch

    if positions is None:
        return None
    seen: dict[int, int] = {}
    for p in positions:
        if not -width <= p < width:
            raise HeadsteerValueError(
                f"positions: {short_repr(p)} is outside the pairs' {width} positions (-{width}..{width - 1})"
            )
        if p % width in seen:
            raise HeadsteerValueError(
                f"positions: {seen[p % width]} and {p} name the same column {p % width} of {width}"
            )
        seen[p % width] = p
    return torch.tensor([p % width for p in positions], dtype=torch.long)


@dataclass(frozen=True)
class DLARequest(Request):
    """Direct logit attribution of every head's output to the logit difference
    (`heads.direct_logit_attribution`).

    Attributes:
        which: `"clean"` (default) or `"corrupted"`: the prompts run.
        stability: bootstrap resamples of the pairs for the head ranking at the last position
            read (0: none).
        positions: padded columns to attribute at (ints, negative counting from the end, kept
            in the given order without repeats); default None: every position. Within the
            pairs' width, checked when it runs (before the forward).

    Raises:
        HeadsteerValueError: `which` not clean / corrupted, a bad stability, positions that are
            not a non-empty list; `check_config`: a position beyond the model's context.
        HeadsteerTypeError: a position that is not an int.
    """

    NAME = "direct_logit_attribution"

    which: str = "clean"
    stability: int = 0
    positions: Sequence[int] | None = None

    def __post_init__(self) -> None:
        check_choice("which", self.which, WHICH)
        object.__setattr__(self, "stability", check_stability(self.stability))
        object.__setattr__(self, "positions", check_positions("positions", self.positions))

    def check_geometry(self, geometry: Geometry) -> None:
        _check_int_positions(geometry, "positions", self.positions)

    def check_pairs(self, pairs: Any) -> Any:
        """The columns `positions` name in `pairs` (a `PairBatch`; None: every column), checked
        against their width (`position_columns`) with the tokenizer's encoding alone, before any
        weight or forward."""
        return position_columns(self.positions, int(pairs.width))


@dataclass(frozen=True)
class LensRequest(Request):
    """The logit lens at every layer boundary (`heads.logit_lens`).

    Attributes:
        which: `"clean"` (default) or `"corrupted"`.
        k: top tokens kept per layer (default 5; at most the vocabulary, checked when it runs).
        positions: padded columns to read the lens at (ints, negative counting from the end,
            kept in the given order without repeats); default None: the last position only
            (the result's fields are then `[N, L + 1]`, else `[N, L + 1, P]`).

    Raises:
        HeadsteerValueError: `which` not clean / corrupted, `k` not a positive int, positions
            that are not a non-empty list; `check_config`: a position beyond the model's context.
        HeadsteerTypeError: a position that is not an int.
    """

    NAME = "logit_lens"

    which: str = "clean"
    k: int = 5
    positions: Sequence[int] | None = None

    def __post_init__(self) -> None:
        from heads._util.validation import check_int

        check_choice("which", self.which, WHICH)
        object.__setattr__(self, "k", check_int("k", self.k, lo=1))
        object.__setattr__(self, "positions", check_positions("positions", self.positions))

    def check_geometry(self, geometry: Geometry) -> None:
        from heads._util.validation import check_int

        if geometry.d_vocab is not None:
            check_int("k", self.k, lo=1, hi=geometry.d_vocab)
        _check_int_positions(geometry, "positions", self.positions)

    def check_pairs(self, pairs: Any) -> Any:
        """As `DLARequest.check_pairs`, and no column may be padding in a pair: the lens reads a
        token's residual (DLA gives such a column zeros).

        Raises:
            HeadsteerValueError: the first padding (position, pair) named, with the column where
                that pair's prompt starts."""
        cols = position_columns(self.positions, int(pairs.width))
        if cols is not None:
            mask = pairs.attention_mask.bool()
            pad = ~mask[:, cols]
            if bool(pad.any()):
                row, j = (int(v) for v in pad.nonzero()[0])
                raise HeadsteerValueError(
                    f"positions: {cast('tuple[int, ...]', self.positions)[j]} (column {int(cols[j])}) is "
                    f"padding in pair {row}, whose prompt starts at column {int((~mask[row]).sum())}: "
                    "choose positions every pair has (negative positions count from the shared end)"
                )
        return cols


@dataclass(frozen=True)
class KnockoutRequest(Request):
    """Attention knockout on prompt pairs (`heads.knockout`): block attention from query
    positions to key positions in chosen layers / heads and measure the logit difference.

    Attributes:
        keys: the key positions blocked, as position names of the pairs (`"IO"`, `"S1"`) or ints
            (negative from the end); a list blocks them together. A mapping `{label: positions}`
            runs one condition per label. Required.
        queries: the query positions whose attention is cut (default `("END",)`: the last token).
        layers: layers whose attention is cut (default None: all).
        heads: query heads in those layers (default None: all).
        per: `"all"` (default: one cell, every chosen layer and head at once), `"layer"` (each
            layer alone) or `"head"` (each head alone).
        factor: 0 (default) blocks (logit -inf); > 0 multiplies those attention probabilities and
            renormalises (Ortu et al. 2024's modification).
        which: `"clean"` (default) or `"corrupted"`: the prompts run.
        level: confidence level of the intervals, in (0, 1) (default 0.95).

    Raises:
        HeadsteerValueError: no keys, a bad position, `per` unknown, a negative or non-finite
            factor, `level` outside (0, 1); `check_config`: layers / heads out of range.
    """

    NAME = "knockout"

    keys: Any = None
    queries: int | str | Sequence[int | str] = ("END",)
    layers: Sequence[int] | None = None
    heads: Sequence[int] | None = None
    per: str = "all"
    factor: float = 0.0
    which: str = "clean"
    level: float = 0.95

    def __post_init__(self) -> None:
        if self.keys is None:
            raise HeadsteerValueError("keys is required: the key positions to block (e.g. 'IO' or [3])")
        if isinstance(self.keys, Mapping):
            if not self.keys:
                raise HeadsteerValueError("keys must name at least one condition, got {}")
            conds: dict[str, Any] = {}
            for label, spec in self.keys.items():
                if not isinstance(label, str) or not label:
                    raise HeadsteerValueError(
                        f"keys labels must be non-empty strings, got {short_repr(label)}"
                    )
                conds[label] = check_positions(
                    f"keys[{label!r}]", [spec] if isinstance(spec, str) else spec, allow_names=True
                )
            object.__setattr__(self, "keys", conds)
        else:
            spec = [self.keys] if isinstance(self.keys, (str, int)) else self.keys
            object.__setattr__(self, "keys", check_positions("keys", spec, allow_names=True))
        queries = [self.queries] if isinstance(self.queries, (str, int)) else self.queries
        object.__setattr__(self, "queries", check_positions("queries", queries, allow_names=True))
        object.__setattr__(self, "layers", check_layers("layers", self.layers))
        if self.heads is not None:
            from heads._util.validation import check_int

            if isinstance(self.heads, (str, bytes)) or not isinstance(self.heads, Sequence) or not self.heads:
                raise HeadsteerValueError(
                    f"heads must be a non-empty list of head indices, got {short_repr(self.heads)}"
                )
            object.__setattr__(
                self,
                "heads",
                tuple(sorted({check_int("heads", h, lo=0, what="head indices >= 0") for h in self.heads})),
            )
        check_choice("per", self.per, KNOCKOUT_PER)
        object.__setattr__(
            self,
            "factor",
            check_number("factor", self.factor, lo=0, what="a finite number >= 0 (0 = knockout)"),
        )
        check_choice("which", self.which, WHICH)
        object.__setattr__(
            self, "level", check_number("level", self.level, lo=0, hi=1, lo_open=True, hi_open=True)
        )

    def conditions(self) -> dict[str, tuple[int | str, ...]]:
        """`{label: key positions}`: one condition per label (a single key list is `"knockout"`)."""
        if isinstance(self.keys, Mapping):
            return dict(self.keys)
        return {"knockout": self.keys}

    def check_geometry(self, geometry: Geometry) -> None:
        for la in self.layers or ():
            geometry.check_layer("layers", la)
        for h in self.heads or ():
            geometry.check_head("heads", 0, h)
        for label, spec in self.conditions().items():
            _check_int_positions(geometry, f"keys[{label!r}]", spec)
        _check_int_positions(geometry, "queries", self.queries)
