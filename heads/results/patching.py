"""`PatchResult`: the scores of one activation-patching sweep (`heads.patch`, `heads.path_patch`),
its table, its `HeadScores` on the model's full layer axis, its bootstrap and its file.

Also the arithmetic the result stands on, which the patching scorers import from here: the site
kinds (`KINDS`) and their grids (`grid_names`), the directions and the normalisation of a
patched metric (`normalise`, `zero_gap`; docs/methods/patching.md), and the
bootstrap of the head ranking over the pairs (`patch_stability`). It imports nothing from
`heads.scorers` (the results sit below the analyses; `tests/test_layering.py`).

Moved from `heads.scorers.patching.result` (that path still imports, with a
`DeprecationWarning`, until 0.3.0).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from heads._util.files import write_text
from heads._util.validation import check_number, is_int, is_number, read_json_file, short_repr
from heads.errors import HeadsteerValueError
from heads.results.resampling import grid_stability, position_reduce
from heads.results.scores import HeadScores
from heads.results.stability import DEFAULT_RESAMPLES, Stability
from heads.results.storage import check_schema_version, guarded_load, json_text

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel

__all__ = [
    "DIRECTIONS",
    "KINDS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "PatchResult",
    "ZeroGapWarning",
    "grid_names",
    "normalise",
    "patch_stability",
    "zero_gap",
]

SCHEMA = "headsteer/patching"
SCHEMA_VERSION = 1

KINDS = ("resid_pre", "attn_out", "mlp_out", "head_out", "head_out_by_pos", "q", "k", "v", "pattern")
"""The activation-patching site kinds (`heads.scorers.patching.activation`)."""

DIRECTIONS = ("denoising", "noising")
"""`direction=` values: denoising patches clean values into the corrupted run (default)."""


def grid_names(kind: str) -> tuple[str, ...]:
    """The grid axes of a sweep of site kind `kind` (`"path"`: path patching's `layer, head`)."""
    if kind in ("resid_pre", "attn_out", "mlp_out"):
        return ("layer", "position")
    if kind == "head_out_by_pos":
        return ("layer", "head", "position")
    return ("layer", "kv_head") if kind in ("k", "v") else ("layer", "head")


_grid_names = grid_names  # the old private name (heads.scorers.patching.activation imports it)


class ZeroGapWarning(UserWarning):
    """Some pairs have M(clean) == M(corrupt): their normalised scores are NaN."""


def zero_gap(clean: torch.Tensor, corrupt: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """`[N]` bool: pairs whose clean and corrupted metrics differ by at most `tol`."""
    return (clean.float() - corrupt.float()).abs() <= tol


def normalise(
    patched: torch.Tensor,
    clean: torch.Tensor,
    corrupt: torch.Tensor,
    direction: str = "denoising",
    *,
    tol: float = 1e-6,
    warn: bool = True,
) -> torch.Tensor:
    """Normalised scores `[..., N]` of raw patched metrics `patched [..., N]`.

    Args:
        clean, corrupt: `[N]` metric of the unpatched clean / corrupted runs.
        direction: `"denoising"`: `(patched - corrupt) / (clean - corrupt)`; `"noising"`:
            `(patched - clean) / (corrupt - clean)`.
        tol: a pair with `|clean - corrupt| <= tol` is flagged: NaN scores, never a division
            by zero (`zero_gap`).
        warn: warn (`ZeroGapWarning`) naming the flagged pairs.

    Raises:
        ValueError: an unknown direction, or shapes that do not end in N.
    """
    if direction not in DIRECTIONS:
        raise HeadsteerValueError(f"direction must be one of {DIRECTIONS}, got {short_repr(direction)}")
    clean, corrupt, patched = clean.float(), corrupt.float(), patched.float()
    if clean.shape != corrupt.shape or clean.ndim != 1 or patched.shape[-1:] != clean.shape:
        raise HeadsteerValueError(
            f"patched {tuple(patched.shape)} must end in N and clean/corrupt be [N]: got "
            f"{tuple(clean.shape)}, {tuple(corrupt.shape)}"
        )
    flagged = zero_gap(clean, corrupt, tol)
    if flagged.any() and warn:
        bad = torch.nonzero(flagged).flatten().tolist()
        warnings.warn(
            f"pairs {bad[:20]}{' ...' if len(bad) > 20 else ''} have M(clean) == M(corrupt) (no gap): "
            "their normalised scores are NaN",
            ZeroGapWarning,
            stacklevel=2,
        )
    if direction == "denoising":
        num, den = patched - corrupt, clean - corrupt
    else:
        num, den = patched - clean, corrupt - clean
    safe = torch.where(flagged, torch.ones_like(den), den)
    return torch.where(flagged, torch.full_like(num, float("nan")), num / safe)


# ------------------------------------------------------------------------------ the result
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

    def interval(self, z: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(low, high)` `[*grid]`: a 95 % interval of the mean over the pairs with a gap (the same
        pairs as `mean`): mean +- q standard errors, q Student's t quantile with n - 1 degrees of
        freedom (default; 12.7 for 2 pairs, 2.26 for 10, 1.98 for 100: few pairs give wide
        intervals) or `z` if given (e.g. 1.96, the normal approximation). NaN with fewer than two
        such pairs: one pair has no standard error.

        Raises:
            ValueError: `z` not a number > 0.
        """
        if z is not None:
            z = check_number("z", z, lo=0, lo_open=True)
        ok = self.gap_pairs
        s = self.scores[..., ok]
        n = int(ok.sum())
        m = self.mean
        if n < 2:
            nan = torch.full_like(m, math.nan)
            return nan, nan.clone()
        var = ((s - m[..., None]) ** 2).sum(-1) / (n - 1)
        se = (var / n).sqrt()
        if z is None:
            from heads.results.evaluation import t_quantile

            z = t_quantile(n)
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
        (no forward pass): `patch_stability` (its keywords: `k`, `seed`,
        `templates`, `by`, `reduce`)."""
        return patch_stability(self, n_resamples, **kwargs)

    def to_frame(self) -> pd.DataFrame:
        """Tidy table: one row per site, its grid coordinates (`layer`: the model's layer number;
        `position`: the padded token column patched, as `positions=` takes it, not an index into
        the position axis), `score` (mean normalised), `ci_low`, `ci_high`, `raw` (mean raw metric)
        and `token` (pair 0's token at that column) for a position axis."""
        import pandas as pd

        m, (lo, hi) = self.mean, self.interval()
        idx = torch.cartesian_prod(*[torch.arange(n) for n in m.shape]).reshape(-1, m.ndim)
        cols: dict[str, Any] = {name: idx[:, j].numpy() for j, name in enumerate(self.grid)}
        cols["layer"] = torch.tensor(self.layer_ids)[idx[:, 0]].numpy()  # the model's layer numbers
        given = self.params.get("positions")
        if (
            "position" in self.grid
            and isinstance(given, list)
            and len(given) == m.shape[self.grid.index("position")]
        ):
            cols["position"] = torch.tensor(given)[
                idx[:, self.grid.index("position")]
            ].numpy()  # token columns
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
        def lst(t: torch.Tensor) -> list:
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
        """Write JSON (schema `headsteer/patching` v1, direction and normalisation recorded; NaN
        as null), atomically; returns the path.

        Raises:
            HeadsteerValueError: `path` exists and `overwrite` is False, is a symlink or a folder.
        """
        return write_text(path, json_text(self.to_json()), overwrite=overwrite)

    @classmethod
    @guarded_load
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
        check_schema_version(where, d.get("schema_version"), SCHEMA_VERSION)
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
        want_grid = ("layer", "head") if kind == "path" else grid_names(kind)
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


def patch_stability(
    result: PatchResult,
    n_resamples: int = DEFAULT_RESAMPLES,
    *,
    k: int = 10,
    seed: int = 0,
    templates: list | None = None,
    by: str = "pairs",
    reduce: str = "max",
) -> Stability:
    """The bootstrap `Stability` of an activation-patching head ranking over its N pairs, from
    the per-pair normalised scores `result.scores` `[*grid, N]` (NaN for zero-gap pairs).

    Args:
        templates: one id per pair (`pair_templates(pairs)`), for the agreement across templates.
        reduce: over positions for `head_out_by_pos` (`"max"` or `"sum"`, as `head_scores`).

    Raises:
        ValueError: a kind without a head axis, fewer than 2 pairs, bad arguments.
    """
    if result.grid[:2] not in (("layer", "head"), ("layer", "kv_head")):
        raise HeadsteerValueError(f"patching kind {result.kind!r} has no head axis to rank")
    per = result.scores.movedim(-1, 0)  # [N, L, H(, T)]
    st = grid_stability(
        per,
        n_resamples,
        k=k,
        seed=seed,
        templates=templates,
        by=by,
        reduce=position_reduce(reduce) if per.ndim == 4 else None,
        method=f"patching.{result.kind}",
        model=result.model,
        params={"direction": result.direction, "metric": result.metric, "reduce": reduce},
    )
    layers = result.params.get("layers")
    if isinstance(layers, list) and len(layers) == per.shape[1]:  # a sweep of some layers: their names
        h = per.shape[2]
        st.names = [f"L{layers[i // h]}.H{i % h}" for i in range(len(st.names))]
    return st
