"""`HeadScores` (a score per head, `[L, H]`) and `HeadSet` (a selection of heads).

A `HeadSet` serialises to the JSON shape PASTA users already have,
`{"layer": [heads]}` (layer keys as strings), so a head profile is a `HeadSet`.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from heads._util.validation import check_number, is_int, is_number, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.head_set import (  # noqa: F401 - importable here as before
    HEAD_SCORES_SCHEMA,
    HeadSet,
    HeadSpec,
    _as_int,
    _positive_int,
)
from heads.results.storage import check_geometry, guarded_load, read_json, read_result, write_result

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel

__all__ = ["SCHEMA", "SCHEMA_VERSION", "HeadScores", "HeadSet", "HeadSpec"]

SCHEMA = HEAD_SCORES_SCHEMA
SCHEMA_VERSION = 1


RANK_BY = ("score", "abs", "-score")
"""How `HeadScores.top` / `ranked` / `per_layer` rank heads: by score, by |score|, by -score."""


def _rank_key(scores: torch.Tensor, by: str) -> torch.Tensor:
    """The values ranked in descending order for `by` (one of `RANK_BY`); NaN stays NaN."""
    if by == "score":
        return scores
    if by == "abs":
        return scores.abs()
    if by == "-score":
        return -scores
    raise HeadsteerValueError(f"by must be one of {', '.join(RANK_BY)}, got {short_repr(by)}")


_read_json = read_json  # the strict JSON reader of every result file (heads.results.storage)


@dataclass
class HeadScores:
    """A score for every head: `scores[layer, head]`, plus how it was made.

    Attributes:
        scores: `[L, H]` float tensor (NaN = not scored).
        method: name of the scorer (e.g. `"span_attention"`).
        params: the scorer's parameters (JSON-serialisable).
        model: id of the model scored.
        n_kv_heads: KV heads per layer (for the `kv_head` column).
        seed: random seed, when the method used one.
        stability: the bootstrap `heads.results.stability.Stability` of the ranking, when the
            analysis was asked for one (`stability=`); not saved with the scores.
    """

    scores: torch.Tensor
    method: str
    params: dict = field(default_factory=dict)
    model: str = ""
    n_kv_heads: int | None = None
    seed: int | None = None
    # a `heads.results.stability.Stability` (typed Any: that module builds on this one)
    stability: Any = field(default=None, compare=False, repr=False)

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    def __post_init__(self) -> None:
        self.scores = torch.as_tensor(self.scores, dtype=torch.float32).detach().cpu()
        if self.scores.ndim != 2:
            raise HeadsteerValueError(
                f"scores must be [n_layers, n_heads], got shape {tuple(self.scores.shape)}"
            )
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise HeadsteerValueError(f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}")

    @property
    def n_layers(self) -> int:
        return self.scores.shape[0]

    @property
    def n_heads(self) -> int:
        return self.scores.shape[1]

    @property
    def _n_groups(self) -> int:
        """Query heads per KV head (`n_kv_heads` is set by `__post_init__`)."""
        n_kv = self.n_kv_heads if self.n_kv_heads is not None else self.n_heads
        return self.n_heads // n_kv

    def kv_head(self, head: int) -> int:
        return head // self._n_groups

    def head_scores(self) -> HeadScores:
        """The scores themselves (the result protocol, `heads.results.protocol.Result`)."""
        return self

    # ---------------------------------------------------------------- tables
    def to_frame(self) -> pd.DataFrame:
        """Tidy table: one row per head, columns `layer, head, kv_head, score`."""
        import pandas as pd

        layer, head = torch.meshgrid(torch.arange(self.n_layers), torch.arange(self.n_heads), indexing="ij")
        return pd.DataFrame(
            {
                "layer": layer.flatten().numpy(),
                "head": head.flatten().numpy(),
                "kv_head": (head.flatten() // self._n_groups).numpy(),
                "score": self.scores.flatten().numpy(),
            }
        )

    def _ranked(self, by: str = "score") -> list[tuple[int, int]]:
        """Heads by descending key (`_rank_key`); ties by (layer, head); NaN last and dropped."""
        flat = _rank_key(self.scores, by).flatten()
        order = sorted(
            (i for i in range(flat.numel()) if not math.isnan(flat[i].item())),
            key=lambda i: (-flat[i].item(), i),
        )
        return [divmod(i, self.n_heads) for i in order]

    def ranked(self, k: int | None = None, *, by: str = "score") -> list[tuple[int, int]]:
        """The first `k` heads `(layer, head)` by descending score (ties by (layer, head)); NaN
        dropped.

        `k` is at most: a `k` above the heads with a score (every head less the NaN ones)
        returns them all, as `pandas.Series.nlargest` does (default None: every such head).
        Unlike `top(k)`, which returns a `HeadSet` (ordered by layer and head), this
        keeps the score order. `by` as in `top`.

        Raises:
            ValueError: `k` < 1, an unknown `by`.
        """
        order = self._ranked(by)
        return order if k is None else order[: _positive_int(k)]

    def top(self, k: int, *, by: str = "score") -> HeadSet:
        """The `k` highest-ranked heads (ties broken by (layer, head) order).

        Args:
            k: how many heads, at most: a `k` above the heads with a score (every head less the
                NaN ones) selects them all, as `pandas.Series.nlargest` does.
            by: the ranking: `"score"` (default: the largest scores), `"abs"` (the largest
                |score|: for signed scores such as patching effects, DLA or edge attributions,
                where a strongly negative head matters as much as a positive one) or
                `"-score"` (the most negative scores). NaN scores are never selected.

        Warns (`UserWarning`) when `k` is at least the number of heads [L x H]: every head is
        selected, which is rarely what a top-k meant.

        Raises:
            ValueError: `k` < 1, an unknown `by`.
        """
        k = _positive_int(k)
        order = self._ranked(by)
        n = self.scores.numel()
        if k >= n:
            warnings.warn(
                f"top-k {short_repr(k)} ≥ the model's {n} heads: every head selected",
                UserWarning,
                stacklevel=2,
            )
        return HeadSet(order[:k])

    def per_layer(self, k: int, *, by: str = "score") -> HeadSet:
        """The `k` highest-ranked heads of every layer (`by` as in `top`): at most `k`, every
        head of a layer with fewer than `k` heads with a score (NaN dropped).

        Raises:
            ValueError: `k` < 1, an unknown `by`.
        """
        k = _positive_int(k)
        counts: dict[int, int] = {}
        chosen = []
        for layer, head in self._ranked(by):
            if counts.get(layer, 0) < k:
                counts[layer] = counts.get(layer, 0) + 1
                chosen.append((layer, head))
        return HeadSet(chosen)

    def threshold(self, t: float) -> HeadSet:
        """Every head with score >= `t`."""
        check_number("threshold", t)
        return HeadSet((int(i), int(j)) for i, j in torch.nonzero(self.scores >= t).tolist())

    # ---------------------------------------------------------------- files
    def to_json(self) -> dict:
        rows = [[None if math.isnan(v) else v for v in row] for row in self.scores.tolist()]
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "method": self.method,
            "params": self.params,
            "model": self.model,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "seed": self.seed,
            "scores": rows,
        }

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write JSON (schema `headsteer/head-scores`, version 1; NaN as null); returns the path.

        The write is atomic (`heads._util.files.write_text`); missing parent folders are created.

        Raises:
            ValueError: a score is +-inf (JSON cannot hold it); `path` exists and
                `overwrite` is False; `path` is a symlink or a folder.
        """
        if torch.isinf(self.scores).any():
            raise HeadsteerValueError("scores contain +-inf, which JSON cannot store; replace them first")
        body = self.to_json()
        return write_result(path, body.pop("schema"), body.pop("schema_version"), body, overwrite=overwrite)

    @classmethod
    def from_cache(
        cls,
        cache: Any,
        span: tuple[int, int] | torch.Tensor,
        *,
        query: int = -1,
        model: str = "",
        n_kv_heads: int | None = None,
        tokens: torch.Tensor | None = None,
    ) -> HeadScores:
        """Per-head attention to a span, from a TransformerLens `ActivationCache`.

        The score of head (l, h) is `mean_b sum_{j in span} A[b, l, h, query, j]`, the share of
        query row `query`'s attention on the span (as `heads.span_attention` with
        `query="last"` for `query=-1`), read from the cache's
        `blocks.{l}.attn.hook_pattern` `[batch, n_heads, q, k]`.

        Args:
            cache: `bridge.run_with_cache(tokens)[1]` (it must hold every layer's `hook_pattern`).
            span: a token range `(start, end)` (half-open), or a `[batch, k]` bool mask.
            query: the query position read (default the last).
            model: a model id to record; n_kv_heads: KV heads per layer (GQA), if known.
            tokens: the token ids `[batch, k]` (or `[k]`) the span positions refer to, e.g.
                `encode_prompts(...).input_ids`. The tokens the cache ran on (its `embed.hook_in`,
                a TransformerBridge cache) must equal them. Without `tokens`, a cache whose
                tokens start with the tokenizer's BOS from a bridge that prepends one
                (`bridge.to_tokens(prompt)`) is refused: its positions may be one off from
                the model's own encoding of the prompt (`encode_prompts`, `span_attention`),
                which `tokens` settles.

        Returns:
            HeadScores `[n_layers, n_heads]`, method `"span_attention"`.

        Raises:
            ValueError: the cache lacks some layer's `hook_pattern`; a `query` that is not an
                int position; a span that is empty, out of range, not int / bool, or that the
                query cannot see (in any batch row); the cache ran on other tokens than
                `tokens`, or (without `tokens`) on a BOS the bridge prepended.
            TypeError: `cache` is not a mapping of hook names (an ActivationCache); `model` not
                a string; `n_kv_heads` not an int.
        """
        if not callable(getattr(cache, "keys", None)):
            raise HeadsteerTypeError(
                f"cache must be a TransformerLens ActivationCache, got {type(cache).__name__}"
            )
        if not isinstance(model, str):
            raise HeadsteerTypeError(f"model must be a model id string, got {short_repr(model)}")
        if n_kv_heads is not None and not is_int(n_kv_heads):
            raise HeadsteerTypeError(f"n_kv_heads must be an int or None, got {short_repr(n_kv_heads)}")
        found = sorted(
            int(k.split(".")[1])
            for k in cache.keys()
            if isinstance(k, str)
            and k.startswith("blocks.")
            and k.endswith(".attn.hook_pattern")
            and re.fullmatch(r"0|[1-9][0-9]{0,5}", k.split(".")[1], re.ASCII) is not None
        )
        if not found:
            raise HeadsteerValueError(
                "the cache holds no blocks.{l}.attn.hook_pattern; run_with_cache with patterns"
            )
        n_layers = found[-1] + 1
        missing = sorted(set(range(n_layers)) - set(found))
        if missing or found[0] != 0:
            raise HeadsteerValueError(
                f"the cache lacks hook_pattern for layers {missing}: scores need every layer "
                "(a names_filter dropped them?)"
            )
        patterns = [cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(n_layers)]
        first = patterns[0]
        for layer, p in enumerate(patterns):
            if not isinstance(p, torch.Tensor) or p.ndim != 4 or p.shape != first.shape:
                got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
                raise HeadsteerValueError(
                    f"blocks.{layer}.attn.hook_pattern must be a [batch, n_heads, q, k] tensor shaped "
                    f"like layer 0's, got {got}"
                )
        batch, q_len, k_len = int(first.shape[0]), int(first.shape[-2]), int(first.shape[-1])
        _check_cache_tokens(cache, tokens, batch, k_len)
        if not is_int(query) or not -q_len <= query < q_len:
            raise HeadsteerValueError(
                f"query must be an int position in [-{q_len}, {q_len}), got {short_repr(query)}"
            )
        query = int(query)
        q_abs = query % q_len + (k_len - q_len)  # absolute position of the query row
        if isinstance(span, torch.Tensor):
            if span.dtype != torch.bool:
                raise HeadsteerValueError(f"span mask must be a bool tensor, got {span.dtype}")
            mask = span.cpu()
            if mask.ndim != 2 or mask.shape[-1] != k_len or mask.shape[0] != batch:
                raise HeadsteerValueError(f"span mask must be [batch, {k_len}] bool, got {tuple(mask.shape)}")
            empty = [b for b in range(batch) if not mask[b, : q_abs + 1].any()]
            if empty:
                raise HeadsteerValueError(f"span mask selects no key the query sees in batch rows {empty}")
        else:
            if not isinstance(span, tuple | list) or len(span) != 2:
                raise HeadsteerValueError(
                    f"span must be (start, end) or a [batch, k] bool mask, got {short_repr(span)}"
                )
            if not all(is_int(x) for x in span):
                raise HeadsteerValueError(f"span bounds must be ints, got {short_repr(span)}")
            a, b = (int(x) for x in span)
            if not 0 <= a < b <= k_len:
                raise HeadsteerValueError(
                    f"span {short_repr(span)} is empty or outside the {k_len} cached positions"
                )
            if a > q_abs:
                raise HeadsteerValueError(
                    f"span {short_repr(span)} starts after query position {q_abs}: it sees none of it"
                )
            mask = torch.zeros(batch, k_len, dtype=torch.bool)
            mask[:, a:b] = True
        rows = []
        for layer in range(n_layers):
            pattern = patterns[layer].detach().float().cpu()  # [B, H, q, k]
            row = pattern[:, :, query, :]  # [B, H, k]
            rows.append((row * mask[:, None, :].float()).sum(-1).mean(0))
        return cls(
            torch.stack(rows),
            method="span_attention",
            params={"query": query, "source": "transformer_lens ActivationCache"},
            model=model,
            n_kv_heads=n_kv_heads,
        )

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> HeadScores:
        """Read a file written by `save`, checked against `model` when given.

        Raises:
            ValueError: wrong schema or version, malformed scores, or a geometry
                (n_layers, n_heads, n_kv_heads) that differs from `model`'s.
            FileNotFoundError: no such file.
        """
        data = read_result(path, SCHEMA, SCHEMA_VERSION, "HeadScores")
        name = str(path)
        out = cls._from_json(data, name)
        check_geometry(path, (out.n_layers, out.n_heads, out.n_kv_heads), model)
        if model is not None and out.model and out.model != model.name:
            warnings.warn(f"scores were made on {out.model!r}, loading for {model.name!r}", stacklevel=2)
        return out

    @classmethod
    def _from_json(cls, data: Mapping, name: str) -> HeadScores:
        def bad(msg: str) -> HeadsteerValueError:
            return HeadsteerValueError(f"{name!r}: malformed HeadScores file: {msg}")

        for key, kind in (("method", str), ("model", str), ("n_layers", int), ("n_heads", int)):
            if key not in data:
                raise bad(f"missing {short_repr(key)}")
            if isinstance(data[key], bool) or not isinstance(data[key], kind):
                raise bad(f"{short_repr(key)} must be {kind.__name__}, got {short_repr(data[key])}")
        n_layers, n_heads = data["n_layers"], data["n_heads"]
        n_kv = data.get("n_kv_heads", n_heads)
        if isinstance(n_kv, bool) or not isinstance(n_kv, int):
            raise bad(f"'n_kv_heads' must be int, got {short_repr(n_kv)}")
        seed = data.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise bad(f"'seed' must be int or null, got {short_repr(seed)}")
        params = data.get("params") or {}
        if not isinstance(params, Mapping):
            raise bad(f"'params' must be an object, got {short_repr(params)}")
        rows = data.get("scores")
        if not isinstance(rows, list) or len(rows) != n_layers:
            raise bad(f"'scores' must be a list of {n_layers} rows")
        values = []
        for row in rows:
            if not isinstance(row, list) or len(row) != n_heads:
                raise bad(f"every row of 'scores' must be a list of {n_heads} numbers or null")
            for v in row:
                if v is not None and not is_number(v):
                    raise bad(f"score {short_repr(v)} is not a number")
            values.append([math.nan if v is None else float(v) for v in row])
        try:
            return cls(
                torch.tensor(values, dtype=torch.float32).reshape(n_layers, n_heads),
                method=data["method"],
                params=dict(params),
                model=data["model"],
                n_kv_heads=n_kv,
                seed=seed,
            )
        except ValueError as err:
            raise bad(str(err)) from None

    def _repr_html_(self) -> str:
        """Jupyter view: a colour-scaled layer x head table and the top 5 heads (no plotly needed)."""
        import html

        finite = self.scores[torch.isfinite(self.scores)]
        lo, hi = (finite.min().item(), finite.max().item()) if finite.numel() else (0.0, 1.0)
        span = (hi - lo) or 1.0

        def cell(v: float) -> str:
            if math.isnan(v):
                return "<td style='background:#eee'></td>"
            a = min(1.0, max(0.0, (v - lo) / span))  # +-inf: the ends of the colour scale
            style = f"background:rgba(49,104,142,{0.1 + 0.9 * a:.2f});width:14px"
            return f"<td title='{v:.4f}' style='{style}'></td>"

        head_row = "".join(f"<th>{h}</th>" for h in range(self.n_heads))
        body = "".join(
            f"<tr><th>{la}</th>{''.join(cell(v) for v in self.scores[la].tolist())}</tr>"
            for la in range(self.n_layers)
        )
        top = ", ".join(f"L{la}.H{h} ({self.scores[la, h].item():.3f})" for la, h in self._ranked()[:5])
        return (
            f"<div><b>{html.escape(repr(self))}</b><br>top: {html.escape(top)}"
            f"<table style='border-collapse:collapse;font-size:9px'><tr><th>layer\\head</th>{head_row}</tr>"
            f"{body}</table></div>"
        )

    def __repr__(self) -> str:
        return (
            f"HeadScores(method={self.method!r}, model={self.model!r}, "
            f"[{self.n_layers}, {self.n_heads}], n_kv_heads={self.n_kv_heads})"
        )


def _check_cache_tokens(cache: Any, tokens: torch.Tensor | None, batch: int, k_len: int) -> None:
    """ValueError unless the tokens `cache` ran on are the ones the span was located in
    (`HeadScores.from_cache`, `tokens`)."""
    ran = cache["embed.hook_in"] if "embed.hook_in" in cache.keys() else None
    if not isinstance(ran, torch.Tensor) or ran.dtype.is_floating_point or ran.ndim != 2:
        ran = None  # a HookedTransformer cache keeps no token ids
    if tokens is not None:
        bad = not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point
        if bad or tokens.ndim not in (1, 2):
            raise HeadsteerValueError(
                f"tokens must be a [batch, k] or [k] int tensor, got {short_repr(tokens)}"
            )
        want = (tokens[None] if tokens.ndim == 1 else tokens).cpu()
        if tuple(want.shape) != (batch, k_len):
            raise HeadsteerValueError(
                f"tokens are {tuple(want.shape)}, the cache holds {batch} x {k_len} positions: the cache "
                "ran on other tokens than the span was located in"
            )
        if ran is not None and tuple(ran.shape) != tuple(want.shape):
            raise HeadsteerValueError(
                f"the cache ran on {tuple(ran.shape)} tokens (embed.hook_in), tokens are "
                f"{tuple(want.shape)}: the cache ran on other tokens than the span was located in"
            )
        if ran is not None and not torch.equal(ran.cpu(), want):
            b, p = (int(x) for x in (ran.cpu() != want).nonzero()[0])
            raise HeadsteerValueError(
                f"the cache ran on other tokens than the span was located in (row {b}, position {p}: "
                f"{int(ran[b, p])} vs {int(want[b, p])}); run_with_cache(tokens) on the same ids"
            )
        return
    bridge = getattr(cache, "model", None)
    bos = getattr(getattr(bridge, "tokenizer", None), "bos_token_id", None)
    prepends = bool(getattr(getattr(bridge, "cfg", None), "default_prepend_bos", False))
    if ran is None or bos is None or not prepends or not bool((ran[:, 0] == bos).all()):
        return
    raise HeadsteerValueError(
        f"the cache's tokens start with BOS id {bos}, which TransformerLens' to_tokens prepends: span "
        "positions from the model's own encoding may be one off; pass tokens= (the ids the span was "
        "located in, e.g. enc.input_ids) or use bridge.to_tokens(prompt, prepend_bos=False)"
    )
