"""Activation patching (causal tracing) at every site of a kind, in batched sweeps.

Denoising (default; Meng et al. 2022, "causal tracing"): run the corrupted prompt, replace the
activation at one site by its value on the clean prompt, measure the metric. Noising: run the
clean prompt and write the corrupted value. Denoising finds components *sufficient* to restore
the behaviour; noising finds the *necessary* ones (Heimersheim & Nanda 2024, Sec. 2).

Sites (`KINDS`), each scored on a grid:

* `"resid_pre"`: the residual stream entering layer l at position t, `[L, T]`;
* `"attn_out"` / `"mlp_out"`: the attention / MLP block output of layer l at t, `[L, T]`;
* `"head_out"`: head h's output z (its slice of the `o_proj` input, TransformerLens' `hook_z`)
  at every position, `[L, H]`; `"head_out_by_pos"`: at one position, `[L, H, T]`;
* `"q"`: head h's query (all positions) as the attention function reads it, after any QK-norm
  and RoPE (the engine's query site), `[L, H]`; `"k"` / `"v"`: KV head g's columns of the key /
  value projection output (before RoPE / QK-norm, which act per position and head), in every
  fused layout, `[L, G]` (under GQA a KV head feeds a group of query heads; results are per KV
  head). Refused by name where a family has no such site (`PatchRequest.check_config`): `k` / `v` on latent
  attention, `k` where the key norm spans all heads, `mlp_out` where the MLP is not one module or
  a residual multiplier other than 1 scales it;
* `"pattern"`: head h's attention pattern (all positions), `[L, H]`.

Speed (all exact): every (site, pair) is one batch row, `options.max_rows` rows per forward;
each batch starts at the patched layer from the base run's residual stream
(`heads.engine.prefix.starting_at`: layer-prefix reuse); by-position kinds also skip the
positions before the patched one, whose keys and values come from the base run's cache
(position-prefix reuse); `head_out_by_pos` at position p of layer l changes only column p of
layer l's output, so that layer runs on column p alone and the later layers start from it
beside the base run's residual of the columns after p; only the last position is unembedded,
and for a metric that reads a few tokens (`logit_diff`) only their columns (`unembed_only`).
A (site, pair) whose source activation equals the base run's bitwise (e.g. at every position
before the first token where the two prompts differ) patches nothing: it gets the base run's
metric without a forward.
The patches are engine edits (`head_output`, `residual`, `query`, `probs`, `k` / `v`, `mlp_out`
sites; `attn_out` is written as every head's output z, which o_proj turns into the source
attention output bitwise), and the recorded runs read engine sites (`record.record_run`), so a
sweep runs on every backend, acts only on the calling thread's forwards and leaves the model
bitwise unchanged. Each kind equals a one-hook whole-model loop on every family headsteer
accepts, prompts longer than a sliding window included (tests/heads/patching/
test_family_patching.py).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

import torch

from heads._util.files import write_text
from heads._util.progress import progress_callback
from heads._util.validation import is_int, is_number, short_repr
from heads.engine.activations import ActivationEdit
from heads.engine.edits import AttentionCall, Edit, HeadOutputEdit, ProbEdit, QueryEdit, ResidualEdit
from heads.engine.options import SweepOptions
from heads.engine.unembed import unembed_columns
from heads.engine.variants import run_rows
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores
from heads.results.stability import Stability
from heads.results.storage import json_text
from heads.scorers.patching.capture import ForwardStopped, PatchStream, StopAt
from heads.scorers.patching.metrics import DIRECTIONS, Metric, get_metric, normalise, zero_gap
from heads.scorers.patching.pairs import PairBatch, check_pairs_differ, check_vocab
from heads.scorers.patching.record import (
    RunCache,
    _qkv_modules,  # noqa: F401 - importable from here as before
    _qkv_slices,  # noqa: F401 - importable from here as before
    record_run,
)
from heads.scorers.patching.request import BY_POSITION, KINDS, PatchRequest
from heads.scorers.patching.vision import (
    ImagePairBatch,
    check_image_model,
    language_model_inputs,
    replaced_embeddings,
)

__all__ = ["KINDS", "PatchResult", "patch", "run_patch"]
# internal helpers, importable by this module path but not its public API (nor the reference):
# `RunCache`, `record_run` (heads.scorers.patching.record), `unembed_only`, `check_sweep_inputs`,
# `prefix_cache`

# KINDS (the activation-patching site kinds, see the module docstring) and BY_POSITION (the kinds
# scored per position) are defined beside the request (heads.scorers.patching.request)

SCHEMA = "headsteer/patching"
SCHEMA_VERSION = 1


# ------------------------------------------------------------------------------ patch edits
@dataclass(eq=False, repr=False)
class _PatchZ(HeadOutputEdit):
    """Write `source [R, T', H, d]` into the heads of `row_heads`, at the columns of `cols
    [R, T']` (None = all); columns are those of the chunk (after trimming), from the chunk's
    column `start` on (a forward that computes only the columns after a cached prefix needs
    only theirs)."""

    source: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    start: int = 0

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        a = call.q_offset - self.start
        src = cast(torch.Tensor, self.source)[:, a : a + call.q_len].to(z.dtype)
        if self.cols is None:
            return src
        c = self.cols[:, a : a + call.q_len].to(z.device)[:, :, None, None]
        return torch.where(c, src, z)


@dataclass(eq=False, repr=False)
class _PatchQuery(QueryEdit):
    """Write `source [R, T', H, d_q]` (queries after QK-norm and RoPE) into the heads of
    `row_heads`, at every column of the chunk; `source`'s first column is the chunk's column
    `start`."""

    source: torch.Tensor | None = None
    start: int = 0

    def apply(self, q: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        a = call.q_offset - self.start
        return cast(torch.Tensor, self.source)[:, a : a + call.q_len].to(q.dtype)


@dataclass(eq=False, repr=False)
class _PatchResid(ResidualEdit):
    """Replace the residual entering `layer` at the columns `cols [R, T']` by `source [R, T', D]`."""

    source: torch.Tensor | None = None
    cols: torch.Tensor | None = None

    def apply(self, x: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        sl = slice(call.q_offset, call.q_offset + call.q_len)
        src = cast(torch.Tensor, self.source)[:, sl].to(x.dtype)
        c = cast(torch.Tensor, self.cols)[:, sl].to(x.device)[:, :, None]
        return torch.where(c, src, x)


@dataclass(eq=False, repr=False)
class _PatchPattern(ProbEdit):
    """Replace the pattern of the heads in `row_heads` by `source [R, H, T', T']`."""

    source: torch.Tensor | None = None

    def apply(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        src = cast(torch.Tensor, self.source)[:, :, call.q_offset : call.q_offset + call.q_len, : call.k_len]
        mask = self.head_mask(call.batch, call.n_heads, probs.device)[:, :, None, None]
        return torch.where(mask, src.to(probs.dtype), probs)


class _PatchKV(ActivationEdit):
    """Write `source [R, T', G, d]` (a KV site, `k` or `v`) into the KV heads of `row_heads`, at
    every column of the chunk; `source`'s first column is the chunk's column `start`."""

    def __init__(self, site: str, layer: int, row_heads: torch.Tensor, source: torch.Tensor, start: int = 0):
        super().__init__(site, layer, row_heads=row_heads)
        self.source, self.start = source, start

    def apply(self, x: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        a = call.q_offset - self.start
        return cast(torch.Tensor, self.source)[:, a : a + call.q_len].to(x.dtype)


@contextmanager
def unembed_only(model: HeadModel, columns: torch.Tensor | None) -> Iterator[None]:
    """Within the block this thread's row forwards compute only the vocabulary `columns` (`[K]`
    long) of the last position's logits; the other columns are NaN. For metrics that read a few
    tokens (`Metric.columns`, e.g. `logit_diff`): the unembedding of a chunk's last position costs
    `K / V` of the full one. Each computed logit is the same dot product as in the full head,
    then the model's own logit scale and soft-cap (fp32: equal within rounding). A no-op for
    `columns=None`, a backend other than Hugging Face, an LM head that is not a plain `nn.Linear`,
    or more than half the vocabulary. Nothing on the model changes
    (`heads.engine.unembed.unembed_columns`: the LM head runs on no position and the columns
    come from the final normed state); other threads are not affected."""
    with unembed_columns(model, columns):
        yield


# ------------------------------------------------------------------------------ results
@dataclass
class PatchResult:
    """Scores of one activation-patching sweep.

    Attributes:
        kind: the site kind (`KINDS`).
        direction: `"denoising"` or `"noising"`.
        metric: the metric's name.
        raw: `[*grid, N]` fp32 metric of the patched run per site and pair.
        clean: `[N]` metric of the unpatched clean run.
        corrupt: `[N]` metric of the unpatched corrupted run.
        grid: names of the grid axes, e.g. `("layer", "head")`, `("layer", "head", "position")`.
        labels: token strings of the position axis (pair 0's clean tokens, `""` on padding;
            `params["labels_from"]` says so, and notes pairs of different lengths, whose columns
            hold different tokens).
        model: the model id.
        params: other parameters (layers scored, ...).
        stability: the bootstrap over pairs of the head ranking (`patch(stability=B)`,
            `.bootstrap()`), or None.
    """

    kind: str
    direction: str
    metric: str
    raw: torch.Tensor
    clean: torch.Tensor
    corrupt: torch.Tensor
    grid: tuple[str, ...]
    labels: list[str] = field(default_factory=list)
    model: str = ""
    n_kv_heads: int | None = None
    params: dict = field(default_factory=dict)
    stability: Stability | None = None

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    def __repr__(self) -> str:
        """One line: kind, direction, metric, grid and shape, pairs, layers (not the tensors)."""
        ids = self.layer_ids
        lays = f"{ids[0]}..{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 3 else ids
        return (
            f"PatchResult(kind={self.kind!r}, direction={self.direction!r}, metric={self.metric!r}, "
            f"grid={list(self.grid)} {list(self.raw.shape[:-1])}, n_pairs={self.raw.shape[-1]}, "
            f"layers={lays}, model={self.model!r})"
        )

    @property
    def scores(self) -> torch.Tensor:
        """`[*grid, N]` normalised per pair (NaN for zero-gap pairs; `metrics.normalise`)."""
        return normalise(self.raw, self.clean, self.corrupt, self.direction, warn=False)

    @property
    def gap_pairs(self) -> torch.Tensor:
        """`[N]` bool: the pairs whose clean and corrupted metrics differ (`metrics.zero_gap`);
        the others have no scale and are left out of every mean."""
        return ~zero_gap(self.clean, self.corrupt)

    @property
    def mean(self) -> torch.Tensor:
        """`[*grid]` mean normalised score over the pairs with a gap, the same pairs in every cell
        (NaN where no pair has a gap, and in a cell where a kept pair's score is NaN: a cell
        never averages a different set of pairs)."""
        ok = self.gap_pairs
        if not bool(ok.any()):
            return torch.full(self.raw.shape[:-1], math.nan)
        return self.scores[..., ok].mean(-1)

    def interval(self, z: float = 1.96) -> tuple[torch.Tensor, torch.Tensor]:
        """`(low, high)` `[*grid]`: mean +- z standard errors over the pairs with a gap (normal
        approximation; the same pairs as `mean`)."""
        ok = self.gap_pairs
        s = self.scores[..., ok]
        n = max(int(ok.sum()), 1)
        m = self.mean
        var = ((s - m[..., None]) ** 2).sum(-1) / max(n - 1, 1)
        se = (var / n).sqrt()
        return m - z * se, m + z * se

    @property
    def layer_ids(self) -> list[int]:
        """The model layer of each index along the grid's layer axis (`params["layers"]`: a sweep
        of some layers keeps their real numbers; default `0 .. L-1`)."""
        layers = self.params.get("layers")
        n = int(self.raw.shape[0])
        if isinstance(layers, list) and len(layers) == n and all(is_int(la) and la >= 0 for la in layers):
            return [int(la) for la in layers]
        return list(range(n))

    def head_scores(self, reduce: str = "max") -> HeadScores:
        """The mean scores as `HeadScores` `[L, H]` (head kinds; k/v give `[L, G]`) on the model's
        full layer grid: a sweep of some layers (`layers=[...]`) fills its layers at their real
        numbers and NaN elsewhere (never selected by `top` / `ranked`). For `head_out_by_pos` the
        positions are reduced: `"max"` (default: largest |score|, signed) or `"sum"`.

        Raises:
            ValueError: a kind without a head axis (resid_pre, attn_out, mlp_out).
        """
        if reduce not in ("max", "sum"):
            raise HeadsteerValueError(f"reduce must be 'max' or 'sum', got {short_repr(reduce)}")
        m = self.mean
        if self.grid[:2] not in (("layer", "head"), ("layer", "kv_head")):
            raise HeadsteerValueError(f"{short_repr(self.kind)} has no head axis; use .mean ([L, T]) instead")
        if m.ndim == 3:
            if reduce == "sum":
                m = m.nansum(-1)
            elif reduce == "max":
                idx = m.nan_to_num(0).abs().argmax(-1, keepdim=True)
                m = m.gather(-1, idx)[..., 0]
            else:
                raise HeadsteerValueError(f"reduce must be 'max' or 'sum', got {short_repr(reduce)}")
        ids = self.layer_ids
        n_layers = self.params.get("n_layers")
        n_layers = int(n_layers) if is_int(n_layers) and n_layers > max(ids) else max(ids) + 1
        if ids != list(range(n_layers)):  # a sweep of some layers: their real numbers, NaN elsewhere
            full = torch.full((n_layers, *m.shape[1:]), math.nan, dtype=m.dtype)
            full[torch.tensor(ids)] = m
            m = full
        n_kv = m.shape[1] if self.grid[1] == "kv_head" else self.n_kv_heads
        params = {"kind": self.kind, "direction": self.direction, "metric": self.metric, **self.params}
        st = self.stability
        if st is not None and st.params.get("reduce", "max") != reduce:
            st = None
        return HeadScores(
            m, method=f"patching.{self.kind}", params=params, model=self.model, n_kv_heads=n_kv, stability=st
        )

    def bootstrap(self, n_resamples: int = 100, **kwargs: Any) -> Stability:
        """The bootstrap `Stability` of the head ranking over the pairs, from the per-pair scores
        (no forward pass): `heads.scorers.stability.patch_stability` (its keywords: `k`, `seed`,
        `templates`, `by`, `reduce`)."""
        from heads.scorers.stability import patch_stability

        return patch_stability(self, n_resamples, **kwargs)

    def to_frame(self):
        """Tidy table: one row per site, its grid coordinates, `score` (mean normalised),
        `ci_low`, `ci_high`, `raw` (mean raw metric) and `token` for a position axis."""
        import pandas as pd

        m, (lo, hi) = self.mean, self.interval()
        idx = torch.cartesian_prod(*[torch.arange(n) for n in m.shape]).reshape(-1, m.ndim)
        cols: dict[str, Any] = {name: idx[:, j].numpy() for j, name in enumerate(self.grid)}
        cols["layer"] = torch.tensor(self.layer_ids)[idx[:, 0]].numpy()  # the model's layer numbers
        cols.update(
            score=m.flatten().numpy(),
            ci_low=lo.flatten().numpy(),
            ci_high=hi.flatten().numpy(),
            raw=self.raw.mean(-1).flatten().numpy(),
        )
        if "position" in self.grid and self.labels:
            cols["token"] = [self.labels[int(p)] for p in idx[:, self.grid.index("position")]]
        return pd.DataFrame(cols)

    def to_json(self) -> dict:
        def lst(t: torch.Tensor):
            return [
                None if (isinstance(v, float) and not math.isfinite(v)) else v for v in t.flatten().tolist()
            ]

        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "kind": self.kind,
            "direction": self.direction,
            "metric": self.metric,
            "normalisation": (
                "(patched - corrupt) / (clean - corrupt)"
                if self.direction == "denoising"
                else "(patched - clean) / (corrupt - clean)"
            ),
            "grid": list(self.grid),
            "shape": list(self.raw.shape),
            "raw": lst(self.raw),
            "clean": lst(self.clean),
            "corrupt": lst(self.corrupt),
            "labels": self.labels,
            "model": self.model,
            "n_kv_heads": self.n_kv_heads,
            "params": self.params,
            **({} if self.stability is None else {"stability": self.stability.to_json()}),
        }

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write JSON (schema `headsteer/patching` v1, direction and normalisation recorded);
        returns the path."""
        return write_text(path, json_text(self.to_json()), overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> PatchResult:
        """Read a file written by `save`, checked against `model` when given (its layers and
        heads must fit the model's `(n_layers, n_heads, n_kv_heads)`).

        Raises:
            ValueError: a missing file, not UTF-8 JSON (line and column), an integer of more
                than 4300 digits ("a number in '<file>' is too large ..."), not a patching
                result, any field malformed (see `from_json`), or a model the result does not
                fit.
        """
        out = cls._load(path)
        if model is not None:
            out._check_model(os.fspath(path), model)
        return out

    def _check_model(self, where: str, model: HeadModel) -> None:
        """Refuse a model whose geometry the result's layers / heads do not fit."""
        want = (model.n_layers, model.n_heads, model.n_kv_heads)
        layers = [int(la) for la in self.params.get("layers", []) if is_int(la)]
        heads = self.raw.shape[1] if self.grid[1:2] in (("head",), ("kv_head",)) else None
        n = model.n_kv_heads if self.grid[1:2] == ("kv_head",) else model.n_heads
        if (
            (layers and max(layers) >= model.n_layers)
            or (heads is not None and heads != n)
            or (self.n_kv_heads is not None and self.n_kv_heads != model.n_kv_heads)
        ):
            raise HeadsteerValueError(
                f"{where!r}: this patching result does not fit the model's geometry: the model has "
                f"(n_layers, n_heads, n_kv_heads)={want}"
            )

    @classmethod
    def _load(cls, path: str | os.PathLike) -> PatchResult:
        if not os.path.isfile(path):
            raise HeadsteerValueError(f"no patching result at {os.fspath(path)!r}")
        from heads._util.validation import read_json_file

        where = os.fspath(path)
        d = read_json_file(path)  # one line: not JSON (line, column), not UTF-8, a number too large
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise HeadsteerValueError(f"{where!r} is not a {SCHEMA} file")
        return cls.from_json(d, where)

    @classmethod
    def from_json(cls, d: dict, where: str = "patching result") -> PatchResult:
        """The `PatchResult` of a `to_json` dict, every field checked.

        Raises:
            ValueError: `"<where>: <field> ..."` for another schema version, a missing or
                malformed field, an unknown kind / direction, a grid or shape that does not fit
                the kind, raw / clean / corrupt of the wrong length or not numbers.
        """
        version = d.get("schema_version")
        if version != SCHEMA_VERSION or isinstance(version, bool):
            raise HeadsteerValueError(
                f"{where}: schema_version {short_repr(version)}, this headsteer reads {SCHEMA_VERSION}"
            )
        kind = d.get("kind")
        if kind not in (*KINDS, "path"):
            raise HeadsteerValueError(
                f"{where}: kind must be one of {(*KINDS, 'path')}, got {short_repr(kind)}"
            )
        direction = d.get("direction")
        if direction not in DIRECTIONS:
            raise HeadsteerValueError(
                f"{where}: direction must be one of {DIRECTIONS}, got {short_repr(direction)}"
            )
        for key in ("metric", "model"):
            if not isinstance(d.get(key, ""), str):
                raise HeadsteerValueError(f"{where}: {key} must be a string, got {short_repr(d.get(key))}")
        grid = d.get("grid")
        want_grid = ("layer", "head") if kind == "path" else _grid_names(kind)
        if not isinstance(grid, list) or tuple(grid) != want_grid:
            raise HeadsteerValueError(
                f"{where}: grid must be {list(want_grid)} for kind {short_repr(kind)}, got {short_repr(grid)}"
            )
        shape = d.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) != len(want_grid) + 1
            or not all(is_int(x) and x >= 1 for x in shape)
        ):
            raise HeadsteerValueError(
                f"{where}: shape must be {len(want_grid) + 1} positive ints ({', '.join(want_grid)}, pair), "
                f"got {short_repr(shape)}"
            )
        n_pairs = int(shape[-1])

        def numbers(key: str, n: int) -> torch.Tensor:
            v = d.get(key)
            if not isinstance(v, list) or any(a is not None and not is_number(a) for a in v):
                text = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
                raise HeadsteerValueError(f"{where}: {key} must be a list of numbers (or null), got {text}")
            if len(v) != n:
                raise HeadsteerValueError(f"{where}: {key} has {len(v)} values, the shape {shape} needs {n}")
            return torch.tensor([math.nan if a is None else float(a) for a in v], dtype=torch.float32)

        raw = numbers("raw", math.prod(int(x) for x in shape)).reshape([int(x) for x in shape])
        labels = d.get("labels", [])
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            raise HeadsteerValueError(f"{where}: labels must be a list of strings, got {short_repr(labels)}")
        n_kv = d.get("n_kv_heads")
        if n_kv is not None and not (is_int(n_kv) and n_kv >= 1):
            raise HeadsteerValueError(
                f"{where}: n_kv_heads must be a positive int or null, got {short_repr(n_kv)}"
            )
        params = d.get("params", {})
        if not isinstance(params, dict):
            raise HeadsteerValueError(f"{where}: params must be a mapping, got {short_repr(params)}")
        return cls(
            kind,
            direction,
            d.get("metric", ""),
            raw,
            numbers("clean", n_pairs),
            numbers("corrupt", n_pairs),
            tuple(grid),
            labels,
            d.get("model", ""),
            None if n_kv is None else int(n_kv),
            params,
            None
            if d.get("stability") is None
            else Stability.from_json(d["stability"], f"{where}: stability"),
        )


# ------------------------------------------------------------------------------ the sweep
@dataclass(frozen=True)
class _Site:
    layer: int
    index: int  # head / KV head (-1 for block sites)
    pos: int  # padded column (-1 = all positions)


def _check_positions(pairs: PairBatch, positions: Sequence[int] | str | None) -> list[int]:
    T = pairs.width
    if positions is None:
        return list(range(T))
    if isinstance(positions, str) and positions == "image":
        if not isinstance(pairs, ImagePairBatch):
            raise HeadsteerValueError("positions='image' needs vision pairs (encode_image_pairs)")
        return pairs.image_columns()
    if isinstance(positions, (str, bytes)) or not isinstance(positions, Sequence) or not positions:
        raise HeadsteerValueError(
            f"positions must be a non-empty list of columns, got {short_repr(positions)}"
        )
    out = []
    for p in positions:
        if isinstance(p, bool) or not isinstance(p, int):
            raise HeadsteerTypeError(f"position must be an int, got {short_repr(p)}")
        q = p + T if p < 0 else p
        if not 0 <= q < T:
            raise HeadsteerValueError(
                f"position {short_repr(p)} is out of range for padded length {T} (0..{T - 1})"
            )
        out.append(q)
    return sorted(set(out))


def _sites(model: HeadModel, kind: str, layers: list[int], positions: list[int]) -> tuple[list[_Site], tuple]:
    H, G = model.n_heads, model.n_kv_heads
    if kind in ("resid_pre", "attn_out", "mlp_out"):
        return [_Site(la, -1, p) for la in layers for p in positions], (len(layers), len(positions))
    if kind == "head_out_by_pos":
        return [_Site(la, h, p) for la in layers for h in range(H) for p in positions], (
            len(layers),
            H,
            len(positions),
        )
    n = G if kind in ("k", "v") else H
    return [_Site(la, h, -1) for la in layers for h in range(n)], (len(layers), n)


def _grid_names(kind: str) -> tuple[str, ...]:
    if kind in ("resid_pre", "attn_out", "mlp_out"):
        return ("layer", "position")
    if kind == "head_out_by_pos":
        return ("layer", "head", "position")
    return ("layer", "kv_head") if kind in ("k", "v") else ("layer", "head")


def check_sweep_inputs(
    model: HeadModel,
    pairs: object,
    options: SweepOptions | None,
    metric: str | Metric | Callable,
    *,
    what: str,
    images: bool = False,
) -> tuple[Metric, SweepOptions]:
    """The checks every patching sweep makes before any forward: `pairs` a `PairBatch` whose ids
    are in the vocabulary, `options` a `SweepOptions` or None, a local backend (Hugging Face,
    TransformerLens or nnsight without `remote=True`), a metric the pairs can feed. Returns
    `(metric, options)` (default `SweepOptions()`). Vision pairs only with `images=True`, on a
    model `vision.check_image_model` accepts.

    Raises:
        HeadsteerTypeError: pairs not a `PairBatch`, options not a `SweepOptions`.
        HeadsteerValueError: ids outside the vocabulary, nnsight with `remote=True` (named with
            `what`), a metric the pairs cannot feed, a pair that cannot show an effect (same
            prompts, or a counterfactual equal to the answer for a metric that reads it:
            `pairs.check_pairs_differ`), vision pairs without `images=True` or on a text-only /
            unsupported model.
    """
    if not isinstance(pairs, PairBatch):
        raise HeadsteerTypeError(f"pairs must be a PairBatch (encode_pairs), got {type(pairs).__name__}")
    if options is not None and not isinstance(options, SweepOptions):
        raise HeadsteerTypeError(f"options must be a SweepOptions or None, got {short_repr(options)}")
    if pairs.has_images and images:
        check_image_model(model)  # a text-only model named before the vocabulary check
    check_vocab(pairs, model.d_vocab, images=images)
    if getattr(model.backend, "remote", False):
        raise HeadsteerValueError(
            f"{what} cannot run on nnsight with remote=True: its patches are local hooks and edits "
            "that NDIF does not run; use remote=False"
        )
    met = get_metric(metric)
    met.check(pairs)
    check_pairs_differ(pairs, counterfactual=met.needs_counterfactual)
    return met, options or SweepOptions()


def patch(
    model: HeadModel,
    pairs: PairBatch,
    kind: str = "head_out",
    *,
    metric: str | Metric | Callable = "logit_diff",
    direction: str = "denoising",
    layers: Sequence[int] | None = None,
    positions: Sequence[int] | str | None = None,
    options: SweepOptions | None = None,
    stability: int = 0,
) -> PatchResult:
    """Activation patching of every site of `kind` (see `KINDS`) on the pairs.

    Args:
        model: the `HeadModel` on any local backend (Hugging Face, TransformerLens, nnsight;
            tests/heads/patching/test_backends.py: equal within 1e-5); fp32 recommended.
        pairs: an encoded `PairBatch` (`encode_pairs`), or vision pairs (`ImagePairBatch`,
            `heads.scorers.patching.vision.encode_image_pairs`) on a supported VLM: the
            positions then include the image tokens (labels `"<image k>"`).
        kind: the site kind (default `"head_out"`, all positions).
        metric: `"logit_diff"` (default), `"log_prob"`, `"prob"`, `"kl"`, a `Metric` or a user
            function (`heads.scorers.patching.metrics`), read at the last position.
        direction: `"denoising"` (default: clean values into the corrupted run) or `"noising"`.
        layers: layers to score (default all); the grid's layer axis follows this list
            (`PatchResult.layer_ids`), and `head_scores` / `to_frame` report the real layer numbers.
        positions: padded columns to score for the by-position kinds (default all; negative
            counts from the end), or `"image"` (vision pairs: the image-token columns,
            `ImagePairBatch.image_columns`).
        options: `SweepOptions` (rows per forward, progress); default `SweepOptions()`. Progress
            counts work in token-layers (each forward's rows x the columns it recomputes x the
            layers it runs), not rows: rows patched at an early layer or position cost more.
        stability: bootstrap resamples of the pairs for the head ranking's stability (default 0:
            none; e.g. 100): `result.stability`, from the per-pair scores with no extra forward
            (`PatchResult.bootstrap`; the pairs' template ids give the agreement across templates).

    Returns:
        a `PatchResult` (raw metric per site and pair, the clean/corrupt metrics, normalised
        scores, intervals, `.head_scores()`, `.to_frame()`, `.save()`).

    Warns:
        UserWarning: a by-position kind (`resid_pre`, `attn_out`, `mlp_out`, `head_out_by_pos`)
            on pairs whose clean prompts differ in length (`mixed_lengths_note`): a padded
            column then holds different tokens in different pairs, and the labels are pair 0's.

    Raises:
        TypeError: pairs not a `PairBatch`, options not a `SweepOptions`.
        ValueError: an unknown kind / direction / metric, a kind the family does not have
            (`PatchRequest.check_config`), layers or positions out of range, positions for a kind that patches
            every position, ids outside the vocabulary, a metric that needs counterfactuals the
            pairs lack, a pair that cannot show an effect (`pairs.check_pairs_differ`: names
            it), nnsight with `remote=True`, vision
            pairs on a text-only or unsupported model (`vision.check_image_model`),
            `positions="image"` without vision pairs — all before any forward.
    """
    request = PatchRequest(
        kind=kind, direction=direction, metric=metric, layers=layers, positions=positions, stability=stability
    )
    return run_patch(model, pairs, request, options)


def run_patch(
    model: HeadModel, pairs: PairBatch, request: PatchRequest, options: SweepOptions | None = None
) -> PatchResult:
    """Run a `PatchRequest` on `pairs` (what `patch` does once it has built the request: the
    request's values are checked there, its geometry here against `model`; see `patch` for the
    arguments, the result and the errors)."""
    if not isinstance(request, PatchRequest):
        raise HeadsteerTypeError(f"request must be a PatchRequest, got {type(request).__name__}")
    kind, direction, stability = request.kind, request.direction, request.stability
    met, options = check_sweep_inputs(model, pairs, options, request.metric, what="patching", images=True)
    request.check_config(model)  # layers in range, the kind on this family (check_kind's refusals)
    lays = list(range(model.n_layers)) if request.layers is None else list(request.layers)
    by_pos = kind in BY_POSITION
    poss = _check_positions(pairs, request.positions if by_pos else None)
    model.check_length(pairs.width)
    mixed = mixed_lengths_note(pairs) if by_pos else None
    if mixed is not None:
        warnings.warn(f"{kind} patching by position: {mixed}", UserWarning, stacklevel=3)
    if stability:
        from heads.scorers.stability import check_samples

        check_samples(pairs.n, stability)
    sites, shape = _sites(model, kind, lays, poss)

    mask = pairs.attention_mask
    emb: dict[str, torch.Tensor | None] = {"clean": None, "corrupted": None}
    if isinstance(pairs, ImagePairBatch):  # the vision tower runs once per side
        for side in emb:
            emb[side] = language_model_inputs(model, pairs.ids(side), mask, pairs.image_inputs(side))
    rec = {"pattern": kind == "pattern", "query": kind == "q", "keys": kind in ("k", "v")}
    clean = record_run(model, pairs.clean_ids, mask, embeds=emb["clean"], **rec)
    corrupt = record_run(model, pairs.corrupted_ids, mask, embeds=emb["corrupted"], **rec)
    idx = torch.arange(pairs.n)
    m_clean = met(clean.logits, pairs, idx, clean.logits)
    m_corrupt = met(corrupt.logits, pairs, idx, clean.logits)
    base, src = (corrupt, clean) if direction == "denoising" else (clean, corrupt)
    base_ids = pairs.ids("corrupted" if direction == "denoising" else "clean")

    raw = torch.full((len(sites), pairs.n), math.nan)
    lengths = pairs.lengths.tolist()
    width = pairs.width
    # rows (site, pair), grouped by (layer, first recomputed column), chunks of max_rows
    # a row whose source activation equals the base run's bitwise patches nothing: its metric is
    # the base run's (e.g. every position before the first token where the prompts differ)
    m_base = m_corrupt if direction == "denoising" else m_clean
    same = _unchanged(model, kind, base, src, sites, pairs.n)
    raw[same] = m_base.cpu().expand(len(sites), -1)[same]
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for s_i, s in enumerate(sites):
        for i in range(pairs.n):
            if not same[s_i, i]:
                groups.setdefault((s.layer, s.pos if by_pos else 0), []).append((s_i, i))
    chunks = []
    for _, rows in sorted(groups.items()):
        rows.sort(key=lambda r: (lengths[r[1]], r[0]))
        chunks += [rows[a : a + options.max_rows] for a in range(0, len(rows), options.max_rows)]
    # each chunk's forward: its first layer, the left padding it trims and the first column it
    # recomputes (the columns before it come from the base run's cache)
    plan = []
    for chunk in chunks:
        trim = width - max(lengths[i] for _, i in chunk)
        split = trim
        if by_pos:
            split = max(trim, min(sites[chunk[0][0]].pos, width - 1))
        plan.append((chunk, sites[chunk[0][0]].layer, trim, split))
    # progress counts work, not rows: a chunk costs its rows x the columns it recomputes x the
    # layers it runs, so an early layer or position weighs up to L x T times a late one (rows
    # of equal cost would make the ETA swing from minutes to an hour and back)
    work = [len(c) * (width - sp) * (model.n_layers - la) for c, la, _, sp in plan]
    total_work = sum(work)
    columns = met.columns(pairs) if met.columns is not None else None
    with (
        progress_callback(options.progress, f"patching {kind}", "token-layers") as report,
        unembed_only(model, columns),
    ):
        done = 0
        for (chunk, layer, trim, split), cost in zip(plan, work, strict=True):
            si = torch.tensor([s for s, _ in chunk])
            ps = torch.tensor([i for _, i in chunk])
            logits = _run_chunk(
                model,
                kind,
                base,
                src,
                base_ids,
                mask,
                [sites[s] for s in si.tolist()],
                ps,
                layer,
                trim,
                split,
            )
            raw[si, ps] = met(logits, pairs, ps, clean.logits[ps]).cpu()
            done += cost
            if report is not None:
                report(done, total_work)
    result = PatchResult(
        kind,
        direction,
        met.name,
        raw.reshape(*shape, pairs.n),
        m_clean.cpu(),
        m_corrupt.cpu(),
        _grid_names(kind),
        [pairs.position_labels(0)[p] for p in poss] if by_pos else [],
        model.name,
        model.n_kv_heads,
        _params(pairs, lays, poss if by_pos else None, model.n_layers),
    )
    if by_pos:
        result.params["labels_from"] = "pair 0's clean tokens" + ("" if mixed is None else f" ({mixed})")
    if stability:
        from heads.scorers.stability import pair_templates

        result.stability = result.bootstrap(stability, templates=pair_templates(pairs))
    return result


def mixed_lengths_note(pairs: PairBatch) -> str | None:
    """None when every pair's clean prompt has one length (one template: a padded column holds
    the same role in every pair); else why a by-position score mixes tokens: the count of pairs
    and lengths, and the advice (one template per call, `pairs.select(...)`)."""
    n_lengths = len(set(pairs.lengths.tolist()))
    if n_lengths <= 1:
        return None
    return (
        f"the {pairs.n} pairs' clean prompts have {n_lengths} different lengths, so a column holds "
        "different tokens in different pairs and its mean mixes them; the position labels are pair "
        "0's tokens. Patch one template per call (e.g. pairs.select([...]) of the pairs of one length)"
    )


def _params(pairs: PairBatch, layers: list[int], positions: list[int] | None, n_layers: int) -> dict:
    """The result's `params`; for vision pairs also `image_positions`: the indices along the
    position axis whose columns are image tokens in pair 0."""
    out: dict[str, Any] = {"layers": layers, "n_layers": n_layers, "positions": positions, "n_pairs": pairs.n}
    if isinstance(pairs, ImagePairBatch):
        cols = set(pairs.image_mask[0].nonzero().flatten().tolist())
        out["image_positions"] = [j for j, p in enumerate(positions or []) if p in cols]
    return out


def _unchanged(
    model: HeadModel, kind: str, base: RunCache, src: RunCache, sites: list[_Site], n: int
) -> torch.Tensor:
    """`[S, N]` bool: site s of pair i reads a source activation bitwise equal to the base
    run's at that site (all its positions / columns), so patching it is the identity."""
    G, d = model.n_kv_heads, model.d_head
    maps: dict[int, torch.Tensor] = {}

    def eq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a == b).cpu()

    def equal_map(la: int) -> torch.Tensor:
        if kind in ("head_out", "head_out_by_pos"):
            m = eq(src.z[la], base.z[la]).all(-1)  # [N, T, H]
            return m if kind == "head_out_by_pos" else m.all(1)
        if kind in ("resid_pre", "attn_out", "mlp_out"):
            a = {"resid_pre": src.residuals, "attn_out": src.attn_out, "mlp_out": src.mlp_out}[kind][la]
            b = {"resid_pre": base.residuals, "attn_out": base.attn_out, "mlp_out": base.mlp_out}[kind][la]
            return eq(a, b).all(-1)  # [N, T]
        if kind == "pattern":
            return eq(cast(list, src.pattern)[la], cast(list, base.pattern)[la]).all(-1).all(-1)  # [N, H]
        if kind == "q":
            return eq(cast(list, src.query)[la], cast(list, base.query)[la]).all(-1).all(1)  # [N, H]
        j = "qkv".index(kind)
        a, b = src.qkv[la][j], base.qkv[la][j]
        return eq(a.reshape(*a.shape[:2], G, d), b.reshape(*b.shape[:2], G, d)).all(-1).all(1)

    out = torch.zeros(len(sites), n, dtype=torch.bool)
    for s_i, s in enumerate(sites):
        if s.layer not in maps:
            maps[s.layer] = equal_map(s.layer)
        m = maps[s.layer]
        if kind == "head_out_by_pos":
            out[s_i] = m[:, s.pos, s.index]
        elif kind in ("resid_pre", "attn_out", "mlp_out"):
            out[s_i] = m[:, s.pos]
        else:
            out[s_i] = m[:, s.index]
    return out


def _run_chunk(
    model: HeadModel,
    kind: str,
    base: RunCache,
    src: RunCache,
    base_ids: torch.Tensor,
    mask: torch.Tensor,
    sites: list[_Site],
    ps: torch.Tensor,
    layer: int,
    trim: int,
    split: int,
) -> torch.Tensor:
    """One forward of a chunk of rows (site, pair) from `layer` and column `split`; `[R, V]` logits."""
    R, H = len(sites), model.n_heads
    dev = model.device
    ids, m = base_ids[ps, split:], mask[ps, trim:]
    residual = base.residuals[layer][ps, split:] if layer else None
    past = None
    if split > trim:
        past = prefix_cache(base, ps, trim, split, layer)
    cols = torch.zeros(R, mask.shape[1] - trim, dtype=torch.bool)
    for r, s in enumerate(sites):
        if s.pos >= trim:
            cols[r, s.pos - trim] = True
    offset = split - trim
    edits: list[Edit] = []
    if base.embeds is not None:  # vision pairs: the base run's image features
        edits.append(replaced_embeddings(model, base.embeds[ps.to(base.embeds.device), split:]))
    if kind in ("head_out", "head_out_by_pos"):
        rh = torch.zeros(R, H, dtype=torch.bool)
        for r, s in enumerate(sites):
            rh[r, s.index] = True
        edits.append(
            _PatchZ(
                layer=layer,
                row_heads=rh,
                source=src.z[layer][ps, trim:].to(dev),
                cols=cols if kind == "head_out_by_pos" else None,
            )
        )
    elif kind == "resid_pre":
        edits.append(_PatchResid(layer=layer, source=src.residuals[layer][ps, trim:].to(dev), cols=cols))
    elif kind == "pattern":
        rh = torch.zeros(R, H, dtype=torch.bool)
        for r, s in enumerate(sites):
            rh[r, s.index] = True
        edits.append(
            _PatchPattern(
                layer=layer, row_heads=rh, source=src.pattern[layer][ps][:, :, trim:, trim:].to(dev)
            )
        )  # type: ignore[index]
    elif kind == "attn_out":
        # the block's attention output is o_proj of every head's output z, one position at a time:
        # writing every head's source z at the columns gives the source attention output there,
        # bitwise, on every family (also where a residual multiplier scales it afterwards)
        rh = torch.ones(R, H, dtype=torch.bool)
        edits.append(_PatchZ(layer=layer, row_heads=rh, source=src.z[layer][ps, trim:].to(dev), cols=cols))
    elif kind == "mlp_out":
        source = src.mlp_out[layer][ps, trim:].to(dev)
        edits.append(PatchStream(kind, layer, source, cols.to(dev)))
    elif kind == "q":  # the query heads as attention reads them (after QK-norm and RoPE)
        rh = torch.zeros(R, H, dtype=torch.bool)
        for r, s in enumerate(sites):
            rh[r, s.index] = True
        edits.append(
            _PatchQuery(layer=layer, row_heads=rh, source=cast(list, src.query)[layer][ps, trim:].to(dev))
        )
    else:  # k / v: one KV head's key / value (before RoPE / QK-norm), all positions
        rg = torch.zeros(R, model.n_kv_heads, dtype=torch.bool)
        for r, s in enumerate(sites):
            rg[r, s.index] = True
        j = "qkv".index(kind)
        source = src.qkv[layer][j][ps, trim:].to(dev)  # [R, T', G * d] head-major
        source = source.reshape(*source.shape[:2], model.n_kv_heads, -1)
        edits.append(_PatchKV(kind, layer, row_heads=rg, source=source))
    one_column = base.embeds is None  # vision pairs: the embeddings hook covers every column
    if (
        one_column
        and kind == "head_out_by_pos"
        and layer < model.n_layers - 1
        and trim <= split < mask.shape[1] - 1
    ):
        # the patch changes only column `split` of layer `layer`'s output (the later columns'
        # keys, values and queries in that layer are the base run's): run that one column
        # through `layer`, then layers `layer + 1 ..` on columns `split ..` from its output
        # beside the base run's residual of the later columns
        entering = _one_column_output(model, ids[:, :1], m[:, : offset + 1], edits, layer, residual, past)
        later = base.residuals[layer + 1][ps, split + 1 :].to(entering.device, entering.dtype)
        residual = torch.cat([entering, later], dim=1)
        out = run_rows(model, ids, m, [], start=layer + 1, residual=residual, past=past)
    else:
        out = run_rows(model, ids, m, edits, start=layer, residual=residual, past=past)
    return out.logits[:, -1].float()


def prefix_cache(
    base: RunCache, ps: torch.Tensor, trim: int, split: int, start: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer `(keys, values)` of the base run at columns `trim:split` for the rows of pairs
    `ps` (`[R, G, split - trim, d]`), for a forward that starts at layer `start`. The layers
    below `start` are never computed, so they get pair `ps[0]`'s slice alone (`[1, G, ...]`):
    the cache reads only their length, and the rows are not copied for nothing."""
    rows = ps[:1]
    return [
        (k[ps if la >= start else rows, :, trim:split], v[ps if la >= start else rows, :, trim:split])
        for la, (k, v) in enumerate(base.kv)
    ]


def _one_column_output(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    edits: list[Edit],
    layer: int,
    residual: torch.Tensor | None,
    past: list[tuple[torch.Tensor, torch.Tensor]] | None,
) -> torch.Tensor:
    """`[R, 1, D]`: the output of decoder layer `layer` at the one column `ids [R, 1]` (after
    `past`, `mask` up to that column) with `edits`, from `residual` (its slice at that column,
    or None for layer 0); the forward stops there (`StopAt` the block's `resid_post`)."""
    stop = StopAt("resid_post", layer)
    try:
        run_rows(
            model,
            ids,
            mask,
            [*edits, stop],
            start=layer,
            residual=None if residual is None else residual[:, :1],
            past=past,
        )
    except ForwardStopped:
        pass
    if stop.seen is None:  # pragma: no cover - the edit always fires on a decoder layer
        raise HeadsteerValueError(f"layer {layer} did not run")
    return stop.seen
