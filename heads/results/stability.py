"""`Stability`: how far a ranking of heads (or circuit edges) holds up under resampling.

A head ranking or a circuit is read from N pairs (or prompts, sequences, gate fits). Would the
same heads come out on other pairs, or other phrasings? The bootstrap answers from the per-pair
values already computed, with no new forward pass (Efron & Tibshirani 1993, percentile
intervals):

* draw B resamples of the N pairs with replacement (seeded); in each, the score of every item is
  the mean of its per-pair values over the drawn pairs (NaN-aware: a pair with no value for an
  item, e.g. a zero-gap pair of activation patching, is left out of that item's mean), then
  whatever reduction the analysis applies (e.g. the max over positions);
* per item: the score interval (2.5 / 97.5 % percentiles), its rank in the full sample and the
  rank interval over resamples, and `p_top_k`, the share of resamples in which it is in the top
  k; per resample: the Jaccard index of its top k with the full sample's top k;
* a head of the full-sample top k is **stable** when `p_top_k >= 0.95`.

Across templates (`templates=`, one id per pair): the pairs of each template give one ranking;
the agreement of every two templates is Kendall's tau-b over the items and their top-k Jaccard;
and with `by="templates"` the bootstrap draws whole templates (a cluster bootstrap: every pair
of a drawn template), which asks whether the ranking holds on *other phrasings*.

Ranking: by descending score (`absolute=False`, as `HeadScores.top`) or by |score| (circuit
edges, DLA); NaN items rank last and never enter a top k.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from heads._util.files import write_text
from heads._util.validation import check_bool, check_int, check_seed, is_number, read_json_file, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.storage import check_schema_version, guarded_load, json_text

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel
    from heads.results.scores import HeadScores

__all__ = [
    "DEFAULT_RESAMPLES",
    "MAX_RESAMPLES",
    "SCHEMA",
    "SCHEMA_VERSION",
    "STABLE_AT",
    "Stability",
    "check_stability",
    "head_names",
    "resample_counts",
    "stability_of",
]

SCHEMA = "headsteer/stability"
SCHEMA_VERSION = 1
DEFAULT_RESAMPLES = 100
"""B, the bootstrap resamples when `stability=True`-like defaults are asked for."""
MAX_RESAMPLES = 10_000
"""The most resamples `stability=` accepts (the arithmetic is `[B, N] @ [N, items]`)."""
STABLE_AT = 0.95
"""A full-sample top-k item is *stable* when it is in the top k of at least this share of resamples."""
BY = ("pairs", "templates")


def check_stability(value: object, name: str = "stability") -> int:
    """`value` as a number of resamples: 0 (off) or an int in 2..MAX_RESAMPLES.

    Raises:
        HeadsteerValueError: a bool, a non-integer, 1, a negative number or more than MAX_RESAMPLES.
    """
    n = check_int(name, value, lo=0, hi=MAX_RESAMPLES, what=f"0 (off) or an int in 2..{MAX_RESAMPLES}")
    if n == 1:
        raise HeadsteerValueError(f"{name} must be 0 (off) or an int in 2..{MAX_RESAMPLES}, got 1")
    return n


def head_names(n_layers: int, n_heads: int) -> list[str]:
    """`["L0.H0", "L0.H1", ...]`: the item names of a `[L, H]` grid, row-major."""
    return [f"L{la}.H{h}" for la in range(n_layers) for h in range(n_heads)]


def _template_ids(templates: Sequence[Any] | torch.Tensor | None, n: int) -> torch.Tensor | None:
    """`[N]` long template index (0..T-1, by first appearance) or None."""
    if templates is None:
        return None
    items = templates.tolist() if isinstance(templates, torch.Tensor) else list(templates)
    if len(items) != n:
        raise HeadsteerValueError(f"templates has {len(items)} ids for {n} pairs")
    if any(t is None for t in items):
        raise HeadsteerValueError("templates: every pair needs a template id (got None for some)")
    order: dict[str, int] = {}
    return torch.tensor([order.setdefault(repr(t), len(order)) for t in items], dtype=torch.long)


def resample_counts(
    n: int, n_resamples: int, seed: int = 0, groups: torch.Tensor | None = None
) -> torch.Tensor:
    """`[B, N]` float: how often each of the N samples is drawn in each bootstrap resample.

    With `groups` (`[N]` long cluster ids), whole clusters are drawn with replacement (a cluster
    bootstrap) and every sample of a drawn cluster counts once per draw.
    """
    gen = torch.Generator().manual_seed(seed)
    if groups is None:
        idx = torch.randint(n, (n_resamples, n), generator=gen)
        return torch.zeros(n_resamples, n).scatter_add_(1, idx, torch.ones(n_resamples, n))
    n_groups = int(groups.max()) + 1
    idx = torch.randint(n_groups, (n_resamples, n_groups), generator=gen)
    per_group = torch.zeros(n_resamples, n_groups).scatter_add_(1, idx, torch.ones(n_resamples, n_groups))
    return per_group[:, groups]


def _weighted_means(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`[R, *S]` NaN-aware weighted means of `values [N, *S]` with weights `counts [R, N]`."""
    flat = values.reshape(values.shape[0], -1).double()
    ok = torch.isfinite(flat)
    w = counts.double()
    sums = w @ torch.where(ok, flat, 0.0)
    dens = w @ ok.double()
    out = torch.where(dens > 0, sums / dens.clamp(min=1e-300), math.nan)
    return out.reshape(counts.shape[0], *values.shape[1:]).float()


def _ranks(scores: torch.Tensor, absolute: bool) -> torch.Tensor:
    """`[R, I]` long ranks (1 = best) of each row; ties by item order; NaN last."""
    key = scores.abs() if absolute else scores
    key = torch.nan_to_num(key, nan=-math.inf)
    order = torch.argsort(-key, dim=-1, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(1, key.shape[-1] + 1).expand_as(order).contiguous())
    return ranks


def _top_mask(scores: torch.Tensor, k: int, absolute: bool) -> torch.Tensor:
    """`[R, I]` bool: the top k of each row (NaN items never; fewer when fewer are finite)."""
    return (_ranks(scores, absolute) <= k) & ~torch.isnan(scores)


def _jaccard(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    inter = (a & b).sum(-1).double()
    union = (a | b).sum(-1).double()
    return torch.where(union > 0, inter / union.clamp(min=1), 1.0).float()


def _kendall(a: torch.Tensor, b: torch.Tensor) -> float:
    from scipy.stats import kendalltau

    ok = ~(torch.isnan(a) | torch.isnan(b))
    if int(ok.sum()) < 2:
        return math.nan
    return float(kendalltau(a[ok].numpy(), b[ok].numpy()).statistic)


def _template_agreement(
    values: torch.Tensor,
    ids: torch.Tensor,
    reduce: Callable[[torch.Tensor], torch.Tensor],
    k: int,
    absolute: bool,
) -> dict:
    """Per-template rankings and the agreement of every two templates."""
    n_t = int(ids.max()) + 1
    counts = torch.stack([(ids == t).float() for t in range(n_t)])  # [T, N]
    per = reduce(_weighted_means(values, counts))  # [T, I]
    key = per.abs() if absolute else per
    tops = _top_mask(per, k, absolute)
    rows = []
    for i in range(n_t):
        for j in range(i + 1, n_t):
            rows.append([i, j, _kendall(key[i], key[j]), float(_jaccard(tops[i], tops[j]))])
    taus = [r[2] for r in rows if not math.isnan(r[2])]
    return {
        "n_templates": n_t,
        "pairs_per_template": [int(c) for c in counts.sum(1).tolist()],
        "kendall_tau": sum(taus) / len(taus) if taus else math.nan,
        "jaccard": sum(r[3] for r in rows) / len(rows) if rows else math.nan,
        "pairwise": rows,
    }


def stability_of(
    values: torch.Tensor,
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    k: int = 10,
    seed: int = 0,
    absolute: bool = False,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    names: Sequence[str] | None = None,
    shape: Sequence[int] | None = None,
    templates: Sequence[Any] | torch.Tensor | None = None,
    by: str = "pairs",
    select: Callable[[torch.Tensor], torch.Tensor] | None = None,
    method: str = "",
    model: str = "",
    params: dict | None = None,
) -> Stability:
    """The bootstrap `Stability` of the ranking made from per-sample `values`.

    Args:
        values: `[N, *S]` per-sample (pair, prompt, sequence, fit) values; NaN = no value.
        n_resamples: B, in 2..MAX_RESAMPLES (default 100).
        k: the top-k size (clipped to the number of items).
        seed: seeds the resamples (0..2**32 - 1).
        absolute: rank by |score| (default False: by score).
        reduce: maps `[R, *S]` means to `[R, I]` item scores (default: flatten `*S`).
        names: the I item names (default `head_names` for a `[L, H]` S, else `"0", "1", ...`).
        shape: the grid the items fill (e.g. `[L, H]`), recorded for `head_scores()`.
        templates: one template id per sample (any hashable JSON value) for the agreement
            across templates and `by="templates"`.
        by: `"pairs"` (default: draw samples) or `"templates"` (draw whole templates).
        select: maps one resample's `[I]` scores to `[I]` bool membership (e.g. a circuit's
            edges after pruning); its mean over resamples is `inclusion`.
        method, model, params: recorded.

    Raises:
        ValueError: fewer than 2 samples, a bad B / k / seed / by, templates of the wrong length
            or with a missing id, `by="templates"` without at least 2 templates.
        TypeError: values not a tensor.
    """
    if not isinstance(values, torch.Tensor):
        raise HeadsteerTypeError(f"values must be a [N, ...] tensor, got {type(values).__name__}")
    if values.ndim < 2 or values.shape[0] < 2:
        raise HeadsteerValueError(
            f"stability needs per-sample values [N >= 2, ...], got shape {tuple(values.shape)}"
        )
    b = check_stability(n_resamples, "n_resamples")
    if b == 0:
        raise HeadsteerValueError("n_resamples must be an int in 2..10000, got 0")
    k = check_int("k", k, lo=1)
    seed = check_seed("seed", seed)
    check_bool("absolute", absolute)
    if by not in BY:
        raise HeadsteerValueError(f"by must be one of {BY}, got {short_repr(by)}")
    values = values.detach().float().cpu()
    n = values.shape[0]
    ids = _template_ids(templates, n)
    if by == "templates" and (ids is None or int(ids.max()) < 1):
        raise HeadsteerValueError("by='templates' needs template ids with at least 2 distinct templates")
    red = reduce if reduce is not None else (lambda m: m.reshape(m.shape[0], -1))
    counts = torch.cat([torch.ones(1, n), resample_counts(n, b, seed, ids if by == "templates" else None)])
    scores = red(_weighted_means(values, counts))  # [1 + B, I]
    point, boot = scores[0], scores[1:]
    n_items = point.numel()
    k = min(k, max(1, int((~torch.isnan(point)).sum())))
    ranks = _ranks(scores, absolute).float()
    top = _top_mask(scores, k, absolute)
    lo, hi = torch.nanquantile(boot, torch.tensor([0.025, 0.975]), dim=0)
    r_lo = torch.quantile(ranks[1:], 0.025, dim=0, interpolation="lower")
    r_hi = torch.quantile(ranks[1:], 0.975, dim=0, interpolation="higher")
    grid = list(shape) if shape is not None else (list(values.shape[1:]) if values.ndim == 3 else None)
    if names is None:
        names = head_names(*grid) if grid is not None and len(grid) == 2 else [str(i) for i in range(n_items)]
    if len(names) != n_items:
        raise HeadsteerValueError(f"names has {len(names)} entries for {n_items} items")
    agreement = _template_agreement(values, ids, red, k, absolute) if ids is not None else None
    inclusion = None
    if select is not None:
        inclusion = torch.stack([select(row).bool() for row in boot]).float().mean(0)
    nan = torch.isnan(point)
    return Stability(
        names=list(names),
        score=point,
        low=torch.where(nan, math.nan, lo),
        high=torch.where(nan, math.nan, hi),
        rank=ranks[0].long(),
        rank_low=r_lo.long(),
        rank_high=r_hi.long(),
        p_top_k=top[1:].float().mean(0),
        in_top_k=top[0],
        jaccard=_jaccard(top[1:], top[0].expand_as(top[1:])),
        k=k,
        n_samples=n,
        n_resamples=b,
        seed=seed,
        absolute=absolute,
        by=by,
        shape=grid if grid is not None and len(grid) == 2 and grid[0] * grid[1] == n_items else None,
        templates=agreement,
        inclusion=inclusion,
        method=method,
        model=model,
        params=dict(params or {}),
    )


@dataclass
class Stability:
    """Bootstrap stability of one ranking (see the module docstring). Arrays are over the I items.

    Attributes:
        names: `[I]` item names (`"L3.H1"` for heads, `"a0.h1->logits"` for edges).
        score: `[I]` the full-sample score; `low` / `high`: its 95 % percentile interval.
        rank: `[I]` the full-sample rank (1 = top); `rank_low` / `rank_high`: its 95 % interval.
        p_top_k: `[I]` share of resamples with the item in the top k.
        in_top_k: `[I]` bool, in the full-sample top k.
        jaccard: `[B]` top-k Jaccard of each resample with the full-sample top k.
        k: the top-k size; `n_samples`: N, the pairs (or templates) resampled; `n_resamples`:
            B; `seed`; `absolute`: ranked by |score|; `by`: `"pairs"` or `"templates"`.
        shape: `[L, H]` when the items are the heads of a model, else None.
        templates: the agreement across templates (`n_templates`, `pairs_per_template`,
            `kendall_tau` and `jaccard` means, `pairwise` rows `[i, j, tau, jaccard]`), or None.
        inclusion: `[I]` share of resamples whose selection (a circuit: top n edges, pruned)
            holds the item, or None.
        method: the method whose ranking this is.
        model: the model's name.
        params: the method's parameters.
    """

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    names: list[str]
    score: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    rank: torch.Tensor
    rank_low: torch.Tensor
    rank_high: torch.Tensor
    p_top_k: torch.Tensor
    in_top_k: torch.Tensor
    jaccard: torch.Tensor
    k: int
    n_samples: int
    n_resamples: int
    seed: int = 0
    absolute: bool = False
    by: str = "pairs"
    shape: list[int] | None = None
    templates: dict | None = None
    inclusion: torch.Tensor | None = None
    method: str = ""
    model: str = ""
    params: dict = field(default_factory=dict)

    # ---------------------------------------------------------------- views
    @property
    def stable(self) -> torch.Tensor:
        """`[I]` bool: in the full-sample top k and in the top k of >= 95 % of resamples."""
        return self.in_top_k & (self.p_top_k >= STABLE_AT)

    def stable_top(self) -> list[str]:
        """Names of the stable items, best first."""
        idx = torch.nonzero(self.stable).flatten().tolist()
        return [self.names[i] for i in sorted(idx, key=lambda i: int(self.rank[i]))]

    def summary(self) -> dict:
        """`{"k", "n_samples", "n_resamples", "by", "jaccard_mean", "jaccard_low", "jaccard_high",
        "n_stable", "stable", "kendall_tau_templates", "jaccard_templates"}` (JSON-ready)."""
        j = self.jaccard.double()
        lo, hi = torch.quantile(j, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
        t = self.templates or {}
        return {
            "k": self.k,
            "n_samples": self.n_samples,
            "n_resamples": self.n_resamples,
            "by": self.by,
            "jaccard_mean": float(j.mean()),
            "jaccard_low": lo,
            "jaccard_high": hi,
            "n_stable": int(self.stable.sum()),
            "stable": self.stable_top(),
            "kendall_tau_templates": t.get("kendall_tau"),
            "jaccard_templates": t.get("jaccard"),
        }

    def to_frame(self) -> pd.DataFrame:
        """One row per item, best first: `item, score, low, high, rank, rank_low, rank_high,
        p_top_k, in_top_k, stable` (plus `layer, head` for head rankings)."""
        import pandas as pd

        cols: dict[str, Any] = {"item": self.names}
        if self.shape is not None:
            h = self.shape[1]
            cols["layer"] = [i // h for i in range(len(self.names))]
            cols["head"] = [i % h for i in range(len(self.names))]
        for name in ("score", "low", "high", "rank", "rank_low", "rank_high", "p_top_k", "in_top_k"):
            cols[name] = getattr(self, name).numpy()
        cols["stable"] = self.stable.numpy()
        if self.inclusion is not None:
            cols["inclusion"] = self.inclusion.numpy()
        return pd.DataFrame(cols).sort_values("rank", kind="stable").reset_index(drop=True)

    def head_scores(self, what: str = "p_top_k") -> HeadScores:
        """`[L, H]` `HeadScores` of `what` (`"p_top_k"` default, `"score"`, `"low"`, `"high"`,
        `"rank"`, `"rank_low"`, `"rank_high"`).

        Raises:
            ValueError: items that are not the heads of a model (edges), or an unknown `what`.
        """
        from heads.results.scores import HeadScores

        if self.shape is None:
            raise HeadsteerValueError("these items are not a [n_layers, n_heads] grid of heads")
        allowed = ("p_top_k", "score", "low", "high", "rank", "rank_low", "rank_high")
        if what not in allowed:
            raise HeadsteerValueError(f"what must be one of {allowed}, got {short_repr(what)}")
        grid = getattr(self, what).float().reshape(self.shape)
        params = {"k": self.k, "n_resamples": self.n_resamples, "by": self.by, "of": self.method}
        return HeadScores(grid, f"stability_{what}", params, self.model, seed=self.seed)

    def __repr__(self) -> str:
        s = self.summary()
        t = ""
        if self.templates:
            t = (
                f"; {self.templates['n_templates']} templates: tau {s['kendall_tau_templates']:.2f}, "
                f"top-{self.k} Jaccard {s['jaccard_templates']:.2f}"
            )
        what = f"{self.n_samples} pairs"
        if self.by == "templates" and self.templates:
            what = f"{self.templates['n_templates']} templates ({self.n_samples} pairs)"
        return (
            f"Stability({self.method or 'ranking'}: {self.n_resamples} resamples of {what}; "
            f"top-{self.k} Jaccard {s['jaccard_mean']:.2f} "
            f"[{s['jaccard_low']:.2f}, {s['jaccard_high']:.2f}]; {s['n_stable']} of {self.k} stable{t})"
        )

    def _repr_html_(self) -> str:
        from heads.results.views import html_view

        f = self.to_frame().head(max(self.k, 10))
        rows = [
            (
                r.item,
                f"{r.score:.3g} [{r.low:.3g}, {r.high:.3g}]",
                f"{r.rank} [{r.rank_low}, {r.rank_high}]",
                f"{r.p_top_k:.2f}",
                "stable" if r.stable else "",
            )
            for r in f.itertuples()
        ]
        return html_view(repr(self), rows, ("item", "score [95%]", "rank [95%]", f"P(top {self.k})", ""))

    # ---------------------------------------------------------------- files
    def to_json(self) -> dict:
        def lst(t: torch.Tensor) -> list:
            return [None if isinstance(v, float) and not math.isfinite(v) else v for v in t.tolist()]

        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "method": self.method,
            "model": self.model,
            "params": self.params,
            "k": self.k,
            "n_samples": self.n_samples,
            "n_resamples": self.n_resamples,
            "seed": self.seed,
            "absolute": self.absolute,
            "by": self.by,
            "shape": self.shape,
            "names": self.names,
            **{
                f: lst(getattr(self, f))
                for f in ("score", "low", "high", "rank", "rank_low", "rank_high", "p_top_k", "jaccard")
            },
            "in_top_k": self.in_top_k.tolist(),
            "inclusion": None if self.inclusion is None else lst(self.inclusion),
            "templates": _clean_json(self.templates),
        }

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write JSON (schema `headsteer/stability`, version 1; NaN as null) atomically; returns
        the path.

        Raises:
            ValueError: `path` exists and `overwrite` is False, or is a symlink / folder.
        """
        return write_text(path, json_text(self.to_json()), overwrite=overwrite)

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> Stability:
        """Read a file written by `save`; with `model`, check a head grid against its geometry.

        Raises:
            ValueError: a missing file, not JSON, another schema or version, a malformed field,
                or a `[L, H]` grid that is not `model`'s.
        """
        where = os.fspath(path)
        if not os.path.isfile(path):
            raise HeadsteerValueError(f"no stability file at {where!r}")
        out = cls.from_json(read_json_file(path), repr(where))
        if model is not None and out.shape is not None and out.shape != [model.n_layers, model.n_heads]:
            raise HeadsteerValueError(
                f"{where}: ranks heads of a {out.shape[0]} x {out.shape[1]} model, this model is "
                f"{model.n_layers} x {model.n_heads}"
            )
        return out

    @classmethod
    def from_json(cls, d: Any, where: str = "stability") -> Stability:
        """The `Stability` of a `to_json` dict, every field checked.

        Raises:
            ValueError: `"<where>: ..."` for another schema or version, or a malformed field.
        """
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise HeadsteerValueError(f"{where} is not a {SCHEMA} object")
        check_schema_version(where, d.get("schema_version"), SCHEMA_VERSION)
        names = d.get("names")
        if not isinstance(names, list) or not names or not all(isinstance(x, str) for x in names):
            raise HeadsteerValueError(f"{where}: names must be a non-empty list of strings")
        n_items = len(names)

        def numbers(key: str, n: int = n_items) -> torch.Tensor:
            v = d.get(key)
            if not isinstance(v, list) or len(v) != n or any(a is not None and not is_number(a) for a in v):
                raise HeadsteerValueError(f"{where}: {key} must be a list of {n} numbers (or null)")
            return torch.tensor([math.nan if a is None else float(a) for a in v], dtype=torch.float32)

        ints = {}
        for key in ("k", "n_samples", "n_resamples", "seed"):
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise HeadsteerValueError(f"{where}: {key} must be an int >= 0, got {short_repr(v)}")
            ints[key] = v
        jac = d.get("jaccard")
        if not isinstance(jac, list) or len(jac) != ints["n_resamples"]:
            raise HeadsteerValueError(f"{where}: jaccard must be a list of n_resamples numbers")
        top = d.get("in_top_k")
        if not isinstance(top, list) or len(top) != n_items or not all(isinstance(x, bool) for x in top):
            raise HeadsteerValueError(f"{where}: in_top_k must be a list of {n_items} booleans")
        shape = d.get("shape")
        if shape is not None and not (
            isinstance(shape, list)
            and len(shape) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shape)
            and shape[0] * shape[1] == n_items
        ):
            raise HeadsteerValueError(f"{where}: shape must be null or [n_layers, n_heads] of the items")
        if d.get("by") not in BY or not isinstance(d.get("absolute"), bool):
            raise HeadsteerValueError(f"{where}: by must be one of {BY} and absolute a bool")
        for key in ("method", "model"):
            if not isinstance(d.get(key, ""), str):
                raise HeadsteerValueError(f"{where}: {key} must be a string")
        if not isinstance(d.get("params", {}), dict) or not isinstance(d.get("templates") or {}, dict):
            raise HeadsteerValueError(f"{where}: params and templates must be objects (or null templates)")
        return cls(
            names=names,
            score=numbers("score"),
            low=numbers("low"),
            high=numbers("high"),
            rank=numbers("rank").long(),
            rank_low=numbers("rank_low").long(),
            rank_high=numbers("rank_high").long(),
            p_top_k=numbers("p_top_k"),
            in_top_k=torch.tensor(top, dtype=torch.bool),
            jaccard=numbers("jaccard", ints["n_resamples"]),
            k=ints["k"],
            n_samples=ints["n_samples"],
            n_resamples=ints["n_resamples"],
            seed=ints["seed"],
            absolute=d["absolute"],
            by=d["by"],
            shape=shape,
            templates=d.get("templates"),
            inclusion=None if d.get("inclusion") is None else numbers("inclusion"),
            method=d.get("method", ""),
            model=d.get("model", ""),
            params=d.get("params", {}),
        )


def _clean_json(value: Any) -> Any:
    """`value` with non-finite floats replaced by None (JSON cannot hold them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean_json(v) for v in value]
    return value
