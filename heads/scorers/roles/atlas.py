"""`HeadAtlas`: one tidy table of every per-head score, and a role label per head.

The atlas gathers the role detectors (`heads.scorers.roles.detectors`) and any other
`HeadScores` a user has (span attention, sink statistics, the best MAPS relation, Ships,
probe accuracy, patching scores of a task, VHD, lens KL), one column each, over
`layer, head, kv_head`. It computes nothing that needs `steer` or `probes` (layering): scores
from there are passed in as `HeadScores` (e.g. `scores={"patching": patch_scores}`).

Role label (Dodrio's head-role overview, Wang et al. 2021): the roles in `thresholds` are
checked in order and the first whose score reaches its threshold is the head's role; `"none"`
when none does. The order puts the more specific mechanism first, because the scores come from
different data and are not comparable: an induction head also copies needles (high retrieval
score) and may park most of its attention on the first token of plain text (high sink mass),
so induction wins over retrieval and sink; sink is the last resort. Default order and
thresholds (`ROLE_THRESHOLDS`), for scores in [0, 1]:

| role | score | threshold |
|---|---|---|
| induction | attention to the token after an earlier occurrence (target rows) | 0.5 |
| successor | succession score (OV, top-1 among the sequence's tokens) | 0.5 |
| duplicate_token | attention to earlier copies of the token | 0.5 |
| previous_token | attention to position t - 1 | 0.5 |
| retrieval | needle copy-paste rate | 0.3 |
| self | attention to the own position | 0.5 |
| sink | attention mass on the first token (`first_token_mass`) | 0.8 |

The induction score is checked with the copying score in mind but not gated by it (the
copying column is there to read).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from heads._util.files import write_text
from heads.engine.context import editing
from heads.engine.edits import Recorder
from heads.engine.forward import forward
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores
from heads.scorers.roles.detectors import detect_roles, repeated_tokens

__all__ = ["ROLE_THRESHOLDS", "HeadAtlas", "head_atlas", "pattern_thumbnails", "role_labels"]

ROLE_THRESHOLDS: dict[str, float] = {
    "induction": 0.5,
    "successor": 0.5,
    "duplicate_token": 0.5,
    "previous_token": 0.5,
    "retrieval": 0.3,
    "self": 0.5,
    "sink": 0.8,
}
"""Default roles in precedence order with their thresholds (see the module docstring); the column
`sink` is the first-token mass."""

ATLAS_SCHEMA = "headsteer/head-atlas"


def role_labels(frame: pd.DataFrame, thresholds: Mapping[str, float] = ROLE_THRESHOLDS) -> pd.Series:
    """One role per row of `frame`: the first role of `thresholds` (in its order) whose column reaches
    its threshold, else `"none"`. Missing columns are skipped."""
    roles = [r for r in thresholds if r in frame.columns]
    out = []
    for _, row in frame.iterrows():
        best = "none"
        for r in roles:
            v, t = row[r], thresholds[r]
            if v is not None and not (isinstance(v, float) and math.isnan(v)) and v >= t:
                best = r
                break
        out.append(best)
    return pd.Series(out, index=frame.index, name="role")


@torch.no_grad()
def pattern_thumbnails(model: HeadModel, *, size: int = 24, seed: int = 0) -> torch.Tensor:
    """`[L, H, s, s]` fp16 attention patterns of every head on one [BOS] + R + R row, average-pooled
    to `size` x `size` (the induction stripe and the previous-token diagonal stay visible)."""
    enc = repeated_tokens(model, n_seqs=1, length=(24, 24), seed=seed)
    recs = [Recorder(layer=la) for la in range(model.n_layers)]
    with editing(model, recs):
        forward(model, enc)
    pats = torch.stack([torch.cat(r.records, dim=2)[0] for r in recs]).float().cpu()  # [L, H, T, T]
    pooled = torch.nn.functional.adaptive_avg_pool2d(pats.flatten(0, 1)[:, None], size)[:, 0]
    return pooled.view(model.n_layers, model.n_heads, size, size).half()


@dataclass
class HeadAtlas:
    """Every head's scores and role.

    Attributes:
        frame: one row per head: `layer, head, kv_head`, one column per score, `role`
            (and `best_relation` when MAPS scores were given).
        model: the model's name.
        thresholds: the role thresholds used.
        sources: per score column, the `method` and `params` of the `HeadScores` behind it.
        thumbnails: optional `[L, H, s, s]` pattern thumbnails (`pattern_thumbnails`).
        lens_tokens: optional `{(layer, head): [tokens]}`, e.g. the top lens tokens of a head.
    """

    frame: pd.DataFrame
    model: str
    thresholds: dict[str, float]
    sources: dict[str, dict] = field(default_factory=dict)
    thumbnails: torch.Tensor | None = None
    lens_tokens: dict[tuple[int, int], list[str]] = field(default_factory=dict)

    @property
    def score_columns(self) -> list[str]:
        return [
            c for c in self.frame.columns if c not in ("layer", "head", "kv_head", "role", "best_relation")
        ]

    def heads_with(self, role: str) -> list[tuple[int, int]]:
        """`(layer, head)` pairs labelled `role`, by descending score of that role."""
        sub = self.frame[self.frame["role"] == role]
        if role in self.frame.columns:
            sub = sub.sort_values(role, ascending=False)
        return [(int(a), int(b)) for a, b in zip(sub["layer"], sub["head"], strict=True)]

    def roles_by_layer(self) -> pd.DataFrame:
        """Count of heads per (layer, role): rows layers, columns roles."""
        return pd.crosstab(self.frame["layer"], self.frame["role"])

    def relabel(self, thresholds: Mapping[str, float]) -> HeadAtlas:
        """The same atlas with roles from other thresholds."""
        t = _check_thresholds(thresholds)
        frame = self.frame.copy()
        frame["role"] = role_labels(frame, t)
        return HeadAtlas(frame, self.model, t, dict(self.sources), self.thumbnails, dict(self.lens_tokens))

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the atlas as JSON (schema `headsteer/head-atlas`; NaN as null), atomically."""
        rows = json.loads(self.frame.to_json(orient="records"))
        data: dict[str, Any] = {
            "schema": ATLAS_SCHEMA,
            "schema_version": 1,
            "model": self.model,
            "thresholds": self.thresholds,
            "sources": self.sources,
            "rows": rows,
            "lens_tokens": [[la, h, toks] for (la, h), toks in self.lens_tokens.items()],
            "thumbnails": None
            if self.thumbnails is None
            else self.thumbnails.float().round(decimals=4).tolist(),
        }
        return write_text(path, json.dumps(data) + "\n", overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike) -> HeadAtlas:
        """Read a file written by `save`.

        Raises:
            FileNotFoundError: no such file. ValueError: not an atlas file.
        """
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"atlas file not found: {str(path)!r}")
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except ValueError as err:
            raise HeadsteerValueError(f"{str(path)!r} is not valid JSON: {err}") from None
        if not isinstance(data, dict) or data.get("schema") != ATLAS_SCHEMA:
            raise HeadsteerValueError(f"{str(path)!r} is not a headsteer head-atlas file")
        thumbs = data.get("thumbnails")
        return cls(
            pd.DataFrame(data["rows"]),
            data["model"],
            dict(data["thresholds"]),
            dict(data.get("sources", {})),
            None if thumbs is None else torch.tensor(thumbs).half(),
            {(int(a), int(b)): list(t) for a, b, t in data.get("lens_tokens", [])},
        )

    def __repr__(self) -> str:
        counts = self.frame["role"].value_counts()
        parts = ", ".join(f"{r}: {n}" for r, n in counts.items() if r != "none")
        return (
            f"HeadAtlas({self.model!r}, {len(self.frame)} heads, {len(self.score_columns)} scores; "
            f"roles {parts or 'none'})"
        )

    def _repr_html_(self) -> str:
        import html

        return f"<b>{html.escape(repr(self))}</b>" + self.frame.head(20).to_html(float_format="%.3f")


def _check_thresholds(thresholds: Mapping[str, float]) -> dict[str, float]:
    if not isinstance(thresholds, Mapping):
        raise HeadsteerTypeError(f"thresholds must be a {{role: threshold}} mapping, got {thresholds!r}")
    out = {}
    for k, v in thresholds.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise HeadsteerValueError(f"threshold of {k!r} must be a number > 0, got {v!r}")
        out[k] = float(v)
    return out


def head_atlas(
    model: HeadModel,
    *,
    detectors: Mapping[str, HeadScores] | None = None,
    scores: Mapping[str, HeadScores] | None = None,
    sinks: Any = None,
    maps: Any = None,
    lens: Any = None,
    lens_text: str | None = None,
    thresholds: Mapping[str, float] = ROLE_THRESHOLDS,
    thumbnails: bool = True,
    seed: int = 0,
) -> HeadAtlas:
    """Build the atlas of every head of `model`.

    Args:
        detectors: role detector scores (`detect_roles(model)` when None: computed here).
        scores: any other `{column: HeadScores}` (span attention, Ships, probe accuracy,
            patching, VHD, ...), each `[L, H]` of this model.
        sinks: a `heads.scorers.sinks.SinkStats` (columns `sink_mass`, `sink` = first-token mass,
            `n_sinks`).
        maps: a `MapsScores` (columns `best_relation`, `best_relation_score`).
        lens: an `AttentionLens` of this model (column `lens_kl_ratio`; with `lens_text`, the
            top lens token at each position of that text per head, for the report's cards).
        thresholds: role thresholds (default `ROLE_THRESHOLDS`).
        thumbnails: also keep `pattern_thumbnails` (one small forward).

    Raises:
        ValueError: a score of another geometry, a column given twice, bad thresholds.
        TypeError: a score that is not `HeadScores`.
    """
    t = _check_thresholds(thresholds)
    L, H = model.n_layers, model.n_heads
    cols: dict[str, HeadScores] = {}
    det = detect_roles(model, seed=seed) if detectors is None else detectors
    extra = dict(scores or {})
    if sinks is not None:
        extra.setdefault("sink_mass", sinks.sink_mass)
        extra.setdefault("sink", sinks.first_mass)
        extra.setdefault("n_sinks", sinks.n_sinks)
    if lens is not None:
        lens.check_model(model)
        extra.setdefault("lens_kl_ratio", lens.kl_scores("ratio"))
    for source in (det, extra):
        for name, s in source.items():
            if not isinstance(s, HeadScores):
                raise HeadsteerTypeError(f"score {name!r} must be HeadScores, got {type(s).__name__}")
            if (s.n_layers, s.n_heads) != (L, H):
                raise HeadsteerValueError(
                    f"score {name!r} is [{s.n_layers}, {s.n_heads}], the model has [{L}, {H}] heads"
                )
            if name in cols or name in ("layer", "head", "kv_head", "role", "best_relation"):
                raise HeadsteerValueError(f"score column {name!r} given twice or reserved")
            cols[name] = s
    base = HeadScores(torch.zeros(L, H), "atlas", model=model.name, n_kv_heads=model.n_kv_heads).to_frame()
    frame = base.drop(columns=["score"])
    for name, s in cols.items():
        frame[name] = s.scores.flatten().numpy()
    if maps is not None:
        names = maps.names()
        stack = torch.stack([maps.relation[n].scores for n in names])  # [R, L, H]
        best = stack.nan_to_num(-1.0).max(0)
        frame["best_relation"] = [names[i] for i in best.indices.flatten().tolist()]
        frame["best_relation_score"] = best.values.flatten().numpy()
    frame["role"] = role_labels(frame, t)
    sources = {n: {"method": s.method, "params": s.params} for n, s in cols.items()}
    tokens: dict[tuple[int, int], list[str]] = {}
    if lens is not None and lens_text is not None:
        for la, h in lens.heads:
            df = lens.top_tokens(model, lens_text, la, h, k=1)
            tokens[(la, h)] = [r[0] for r in df["lens_tokens"]]
    thumbs = pattern_thumbnails(model, seed=seed) if thumbnails else None
    return HeadAtlas(frame, model.name, t, sources, thumbs, tokens)
