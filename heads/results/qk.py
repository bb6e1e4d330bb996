"""`QKAttribution`: one head's attention logits split into query-side x key-side components.

Written by `heads.scorers.qk.qk_attribution`; see its docstring and docs/methods/qk_attribution.md
for the decomposition. The result keeps each side's component vectors (`q_side`, `k_side`), so
every table, marginal and total is arithmetic on them, not a new forward.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from heads._util.files import write_text
from heads._util.validation import check_int, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.arrays import decode, encode
from heads.results.scores import HeadScores, _read_json
from heads.results.storage import check_schema_version, guarded_load, json_text

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel

__all__ = ["SCHEMA", "SCHEMA_VERSION", "SIDES", "QKAttribution"]

SCHEMA = "headsteer/qk-attribution"
SCHEMA_VERSION = 1
SIDES = ("query", "key")


@dataclass
class QKAttribution:
    """Head (layer, head)'s pre-softmax logits at chosen (query, key) cells, decomposed.

    With `a_i(q)` component i's share of the head's query at position q and `b_j(k)` component
    j's share of its key at k (frozen norm scales, QK-norm and RoPE applied per position; the
    last component `"bias"` is each side's constant), the logit before any soft-cap is

        s(q, k) = scale * sum_{i, j} a_i(q) . b_j(k)

    Attributes:
        model: the model id.
        layer: the head's layer.
        head: the query head.
        kv_head: its KV head (under GQA).
        n_layers: L.
        n_heads: H.
        n_kv_heads: G.
        names: the `C + 1` component names, each side's (`"embed"`, `"pos_embed"`, `"L{l}H{h}"`,
            `"{l}_attn_bias"`, `"{l}_mlp_out"`, `"bias"`).
        queries: `[N, Q]` long, the query positions (token index within each prompt).
        keys: `[N, K]` long, the key positions; -1 where a prompt has no such key.
        q_side: `[N, C + 1, Q, d]` fp32/fp64 the query-side component vectors.
        k_side: `[N, C + 1, K, d]` the key-side component vectors.
        scale: the head's logit scale.
        logits: `[N, Q, K]` the model's own logits (scaled, soft-capped, before the mask); NaN
            on cells that are not (query, key) pairs (key after query, no such key).
        pattern: `[N, Q, K]` the model's attention probabilities at those cells.
        visible: `[N, Q, K]` bool, the keys the query attends to (causal, in the window).
        softcap: `c` of the family's `c tanh(s / c)` on the logits, or None.
        sink: the head's learned sink logit, or None.
        sources: with `by="source_token"`, `{"query" | "key": [N, Q, K, L*H_up, T]}`: each
            upstream head's marginal split over the source positions it read (its pattern
            frozen); else None. `source_heads` names the `L*H_up` heads.
        tokens: per prompt, its tokens as readable text.
        params: how it was computed.
    """

    model: str
    layer: int
    head: int
    kv_head: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    names: list[str]
    queries: torch.Tensor
    keys: torch.Tensor
    q_side: torch.Tensor
    k_side: torch.Tensor
    scale: float
    logits: torch.Tensor
    pattern: torch.Tensor
    visible: torch.Tensor
    softcap: float | None = None
    sink: float | None = None
    sources: dict[str, torch.Tensor] | None = None
    source_heads: list[str] = field(default_factory=list)
    tokens: list[list[str]] = field(default_factory=list)
    params: dict = field(default_factory=dict)

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    # ---------------------------------------------------------------- shape and lookup
    @property
    def n_prompts(self) -> int:
        return int(self.queries.shape[0])

    @property
    def valid(self) -> torch.Tensor:
        """`[N, Q, K]` bool: the cells that are (query, key) pairs (0 <= key <= query)."""
        k = self.keys[:, None, :]
        return (k >= 0) & (k <= self.queries[:, :, None])

    def _cell(self, prompt: int, query: int | None, key: int | None) -> tuple[int, int, int]:
        """Axis indices of the cell at (prompt, query position, key position); None = the first
        query / the last valid key of that query."""
        n = check_int("prompt", prompt, lo=0, hi=self.n_prompts - 1)
        qs = self.queries[n].tolist()
        if query is None:
            qi = 0
        else:
            q = int(check_int("query", query))
            q = q if q >= 0 else len(self.tokens[n]) + q if self.tokens else q
            if q not in qs:
                raise HeadsteerValueError(f"query position {short_repr(query)} is not in this result ({qs})")
            qi = qs.index(q)
        ks = self.keys[n].tolist()
        if key is None:
            ok = [i for i, k in enumerate(ks) if 0 <= k <= qs[qi]]
            if not ok:
                raise HeadsteerValueError(f"query {qs[qi]} of prompt {n} has no key in this result")
            ki = ok[-1]
        else:
            k = int(check_int("key", key))
            if k not in ks:
                raise HeadsteerValueError(
                    f"key position {short_repr(key)} is not in this result ({[x for x in ks if x >= 0]})"
                )
            ki = ks.index(k)
            if k > qs[qi]:
                raise HeadsteerValueError(f"key {k} is after query {qs[qi]}: not a cell of the pattern")
        return n, qi, ki

    # ---------------------------------------------------------------- arithmetic
    def terms(self, prompt: int = 0, query: int | None = None, key: int | None = None) -> torch.Tensor:
        """`[C + 1, C + 1]` the query-component x key-component terms of one cell (query / key are
        token positions; default the first query and its last key); they sum to `score()`."""
        n, qi, ki = self._cell(prompt, query, key)
        return self.q_side[n, :, qi] @ self.k_side[n, :, ki].T * self.scale

    def _totals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(q [N, Q, d], k [N, K, d])`: each side's whole vector (kept after the first call;
        the sides are read-only)."""
        key = (id(self.q_side), id(self.k_side))
        got = self.__dict__.get("_totals_cache")
        if got is None or got[0] != key:
            got = self.__dict__["_totals_cache"] = (key, self.q_side.sum(1), self.k_side.sum(1))
        return got[1], got[2]

    def _masked(self, t: torch.Tensor) -> torch.Tensor:
        v = self.valid
        return torch.where(v.reshape(*v.shape, *([1] * (t.dim() - 3))), t, math.nan)

    def score(self) -> torch.Tensor:
        """`[N, Q, K]` the sum of all terms: the logit before any soft-cap (NaN off the cells)."""
        q, k = self._totals()
        return self._masked(torch.einsum("nqd,nkd->nqk", q, k) * self.scale)

    def capped(self) -> torch.Tensor:
        """`[N, Q, K]` `score()` through the family's soft-cap (the model's logit), or `score()`."""
        s = self.score()
        return s if self.softcap is None else self.softcap * torch.tanh(s / self.softcap)

    def max_error(self) -> float:
        """Largest |capped() - logits| over the cells: how exactly the terms add up to the
        model's own logits (tested <= 1e-5 in fp32 on tiny models)."""
        d = (self.capped().double() - self.logits.double()).abs()[self.valid]
        return float(d.max()) if d.numel() else 0.0

    def query_marginals(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`[N, Q, K, C + 1]`: component i's query share against the whole key,
        `scale * a_i(q) . k(k)` (sums over i to `score()`), in `dtype` (default the sides')."""
        a, (_, k) = self.q_side, self._totals()
        if dtype is not None:
            a, k = a.to(dtype), k.to(dtype)
        return self._masked(torch.einsum("ncqd,nkd->nqkc", a, k) * self.scale)

    def key_marginals(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`[N, Q, K, C + 1]`: the whole query against component j's key share,
        `scale * q(q) . b_j(k)` (sums over j to `score()`), in `dtype` (default the sides')."""
        b, (q, _) = self.k_side, self._totals()
        if dtype is not None:
            b, q = b.to(dtype), q.to(dtype)
        return self._masked(torch.einsum("nqd,nckd->nqkc", q, b) * self.scale)

    def marginals(self, side: str) -> torch.Tensor:
        """`query_marginals()` (side `"query"`) or `key_marginals()` (`"key"`)."""
        if side not in SIDES:
            raise HeadsteerValueError(f"side must be 'query' or 'key', got {short_repr(side)}")
        return self.query_marginals() if side == "query" else self.key_marginals()

    def top_pairs(
        self, k: int = 10, prompt: int = 0, query: int | None = None, key: int | None = None
    ) -> list[tuple[str, str, float]]:
        """The `k` largest terms by |value| of one cell: `(query component, key component, value)`."""
        check_int("k", k, lo=1)
        t = self.terms(prompt, query, key)
        flat = t.flatten()
        idx = flat.abs().argsort(descending=True)[:k].tolist()
        c = t.shape[1]
        return [(self.names[i // c], self.names[i % c], float(flat[i])) for i in idx]

    def top_sources(
        self,
        side: str = "key",
        k: int = 10,
        prompt: int = 0,
        query: int | None = None,
        key: int | None = None,
    ) -> list[tuple[str, int, str, float]]:
        """With `by="source_token"`: the `k` largest (upstream head, source position) terms of one
        cell's `side` marginal: `(head, source position, source token, value)`.

        Raises:
            ValueError: computed without sources, or a bad side / cell."""
        if self.sources is None:
            raise HeadsteerValueError(
                "this attribution has no source split: compute it with by='source_token'"
            )
        if side not in SIDES:
            raise HeadsteerValueError(f"side must be 'query' or 'key', got {short_repr(side)}")
        check_int("k", k, lo=1)
        n, qi, ki = self._cell(prompt, query, key)
        s = self.sources[side][n, qi, ki]  # [U, T]
        flat = s.flatten()
        idx = flat.abs().argsort(descending=True)[:k].tolist()
        t = s.shape[1]
        toks = self.tokens[n] if self.tokens else []
        return [
            (self.source_heads[i // t], i % t, toks[i % t] if i % t < len(toks) else "", float(flat[i]))
            for i in idx
        ]

    def head_scores(self, side: str = "key") -> HeadScores:
        """Mean over the cells of each upstream head's `side` marginal as `HeadScores` `[L, H]`
        (NaN for heads at or after this layer): which heads shape this head's query / key."""
        m = self.marginals(side)[self.valid]  # [cells, C + 1]
        out = torch.full((self.n_layers, self.n_heads), math.nan)
        for c, name in enumerate(self.names):
            if name.startswith("L") and "H" in name:
                la, h = (int(x) for x in name[1:].split("H"))
                out[la, h] = float(m[:, c].mean()) if m.numel() else math.nan
        return HeadScores(
            out,
            method=f"qk_attribution.{side}",
            params={"layer": self.layer, "head": self.head, **self.params},
            model=self.model,
            n_kv_heads=self.n_kv_heads,
        )

    # ---------------------------------------------------------------- tables
    def to_frame(self, kind: str = "marginals") -> pd.DataFrame:
        """A tidy table, one row per value (valid cells only).

        `kind="marginals"` (default): `prompt, query, key, side, component, value`;
        `"pairs"`: `prompt, query, key, query_component, key_component, value` (every term: large);
        `"sources"`: `prompt, query, key, side, head, source, source_token, value` (needs sources).

        Raises:
            ValueError: an unknown kind, or `"sources"` without a source split.
        """
        import pandas as pd

        if kind not in ("marginals", "pairs", "sources"):
            raise HeadsteerValueError(
                f"kind must be 'marginals', 'pairs' or 'sources', got {short_repr(kind)}"
            )
        rows: list[dict[str, Any]] = []
        cells = torch.nonzero(self.valid).tolist()
        if kind == "sources" and self.sources is None:
            raise HeadsteerValueError(
                "this attribution has no source split: compute it with by='source_token'"
            )
        marg = {s: self.marginals(s) for s in SIDES} if kind == "marginals" else {}
        for n, qi, ki in cells:
            base = {"prompt": n, "query": int(self.queries[n, qi]), "key": int(self.keys[n, ki])}
            if kind == "marginals":
                for s in SIDES:
                    for c, name in enumerate(self.names):
                        rows.append(
                            {**base, "side": s, "component": name, "value": float(marg[s][n, qi, ki, c])}
                        )
            elif kind == "pairs":
                t = self.q_side[n, :, qi] @ self.k_side[n, :, ki].T * self.scale
                for i, a in enumerate(self.names):
                    for j, b in enumerate(self.names):
                        rows.append(
                            {**base, "query_component": a, "key_component": b, "value": float(t[i, j])}
                        )
            else:
                toks = self.tokens[n] if self.tokens else []
                for s in SIDES:
                    sp = self.sources[s][n, qi, ki]  # type: ignore[index]
                    for u, name in enumerate(self.source_heads):
                        for src in torch.nonzero(sp[u]).flatten().tolist():
                            tok = toks[src] if src < len(toks) else ""
                            rows.append(
                                {
                                    **base,
                                    "side": s,
                                    "head": name,
                                    "source": src,
                                    "source_token": tok,
                                    "value": float(sp[u, src]),
                                }
                            )
        return pd.DataFrame(rows)

    def __repr__(self) -> str:
        return (
            f"QKAttribution(model={self.model!r}, head=L{self.layer}H{self.head}, prompts={self.n_prompts}, "
            f"cells={int(self.valid.sum())}, components={len(self.names)}, max_error={self.max_error():.2g})"
        )

    # ---------------------------------------------------------------- files
    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "layer": self.layer,
            "head": self.head,
            "kv_head": self.kv_head,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "names": list(self.names),
            "scale": self.scale,
            "softcap": self.softcap,
            "sink": self.sink,
            "source_heads": list(self.source_heads),
            "tokens": self.tokens,
            "params": self.params,
            "tensors": {
                "queries": encode(self.queries.float()),
                "keys": encode(self.keys.float()),
                "q_side": encode(self.q_side),
                "k_side": encode(self.k_side),
                "logits": encode(self.logits),
                "pattern": encode(self.pattern),
                "visible": encode(self.visible),
                **({f"sources_{s}": encode(v) for s, v in self.sources.items()} if self.sources else {}),
            },
        }

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write JSON (schema `headsteer/qk-attribution`, version 1; tensors as base64 float32);
        atomic, refuses an existing file unless `overwrite`, never writes through a symlink.
        Returns the path.

        Raises:
            ValueError: `path` exists (without `overwrite`), is a symlink or a folder.
        """
        text = json_text(self.to_json())
        return write_text(path, text, overwrite=overwrite)

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> QKAttribution:
        """Read a file written by `save` (tensors come back as float32), checked against `model`
        (its geometry) when given.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a QK-attribution file, another schema version, a malformed field, or
                a geometry that is not `model`'s.
        """
        if model is not None and not hasattr(model, "n_kv_heads"):
            raise HeadsteerTypeError(f"model must be a HeadModel, got {type(model).__name__}")
        data = _read_json(path)
        name = str(path)
        if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
            raise HeadsteerValueError(f"{short_repr(name)} is not a headsteer QKAttribution file")
        check_schema_version(name, data.get("schema_version"), SCHEMA_VERSION)
        out = cls._from_json(data, name)
        if model is not None:
            want = (model.n_layers, model.n_heads, model.n_kv_heads)
            got = (out.n_layers, out.n_heads, out.n_kv_heads)
            if want != got:
                raise HeadsteerValueError(
                    f"{short_repr(name)} was computed on (n_layers, n_heads, n_kv_heads)={got}, "
                    f"this model has {want}"
                )
        return out

    @classmethod
    def _from_json(cls, data: Mapping, name: str) -> QKAttribution:
        def bad(msg: str) -> HeadsteerValueError:
            return HeadsteerValueError(f"{name!r}: malformed QKAttribution file: {msg}")

        ints = ("layer", "head", "kv_head", "n_layers", "n_heads", "n_kv_heads")
        for key in ints:
            v = data.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(f"{key!r} must be an int >= 0, got {short_repr(v)}")
        names = data.get("names")
        if not isinstance(names, list) or not names or not all(isinstance(x, str) for x in names):
            raise bad("'names' must be a non-empty list of strings")
        scale = data.get("scale")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise bad(f"'scale' must be a finite number, got {short_repr(scale)}")
        for key in ("softcap", "sink"):
            v = data.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise bad(f"{key!r} must be a number or null")
        t = data.get("tensors")
        if not isinstance(t, Mapping):
            raise bad("'tensors' must be an object")
        try:
            queries = decode(t.get("queries"), "queries", (None, None)).long()
            n, nq = queries.shape
            keys = decode(t.get("keys"), "keys", (n, None)).long()
            nk = keys.shape[1]
            c = len(names)
            q_side = decode(t.get("q_side"), "q_side", (n, c, nq, None))
            k_side = decode(t.get("k_side"), "k_side", (n, c, nk, q_side.shape[-1]))
            logits = decode(t.get("logits"), "logits", (n, nq, nk))
            pattern = decode(t.get("pattern"), "pattern", (n, nq, nk))
            visible = decode(t.get("visible"), "visible", (n, nq, nk)).bool()
            heads = data.get("source_heads") or []
            sources = None
            if "sources_query" in t or "sources_key" in t:
                sources = {
                    s: decode(t.get(f"sources_{s}"), f"sources_{s}", (n, nq, nk, len(heads), None))
                    for s in SIDES
                }
        except HeadsteerValueError as err:
            raise bad(str(err)) from None
        tokens = data.get("tokens") or []
        params = data.get("params") or {}
        if not isinstance(params, Mapping):
            raise bad("'params' must be an object")
        return cls(
            str(data.get("model", "")),
            data["layer"],
            data["head"],
            data["kv_head"],
            data["n_layers"],
            data["n_heads"],
            data["n_kv_heads"],
            list(names),
            queries,
            keys,
            q_side,
            k_side,
            float(scale),
            logits,
            pattern,
            visible,
            data.get("softcap"),
            data.get("sink"),
            sources,
            list(heads),
            [list(map(str, r)) for r in tokens] if isinstance(tokens, list) else [],
            dict(params),
        )
