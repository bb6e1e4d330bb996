"""`HeadAtlas`: one tidy table of every per-head score, and a role label per head (`heads.head_atlas`
builds it; `heads.scorers.roles.atlas`).

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
| sink | attention mass on the first token (column `first_token_mass`) | 0.8 |

Every role but `sink` is read from the column of its own name. With sink statistics the atlas has
two sink columns side by side: `first_token_mass` (the share of attention on the first token,
which the `sink` role reads, `ROLE_COLUMNS`) and `sink_mass` (the share on every token that
`sink_stats` flags as a sink, the first token or not). Atlas files of earlier versions named the
first-token column `sink`; they load with it renamed.

The induction score is checked with the copying score in mind but not gated by it (the
copying column is there to read). Thresholds may also name any other score column of the atlas
(e.g. `{"patching": 0.2}`), which then becomes a role; a threshold must be a finite number > 0.

NaN scores (a head a detector could not score, e.g. no row of its sequences had a target) are
never silently read as "below the threshold": walking the roles in order, a NaN score on a role
before any role is reached labels the head `"nan"` (its role cannot be decided in that order).
`"none"` therefore always means every role score was a number below its threshold.

It follows the result protocol (`heads.results.protocol.Result`). Moved from
`heads.scorers.roles.atlas`, which still imports every name from here.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd
import torch

from heads._util.files import write_text
from heads._util.validation import check_bool, check_number, check_path, is_int, read_json_file, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.scores import HeadScores
from heads.results.storage import check_geometry, check_schema_version, guarded_load, json_text

if TYPE_CHECKING:  # pragma: no cover
    from heads.model.adapter import HeadModel

__all__ = [
    "ATLAS_SCHEMA",
    "ATLAS_SCHEMA_VERSION",
    "ROLE_COLUMNS",
    "ROLE_THRESHOLDS",
    "HeadAtlas",
    "role_labels",
]

ROLE_THRESHOLDS: dict[str, float] = {
    "induction": 0.5,
    "successor": 0.5,
    "duplicate_token": 0.5,
    "previous_token": 0.5,
    "retrieval": 0.3,
    "self": 0.5,
    "sink": 0.8,
}
"""Default roles in precedence order with their thresholds (`heads.scorers.roles.atlas`)."""

ROLE_COLUMNS: dict[str, str] = {"sink": "first_token_mass"}
"""The score column a role reads when it is not the role's own name: the `sink` role is the
attention mass on the first token (`first_token_mass`), not `sink_mass` (the mass on every flagged
sink). A frame with a column named after the role itself reads that column."""

ATLAS_SCHEMA = "headsteer/head-atlas"
ATLAS_SCHEMA_VERSION = 1

_RESERVED = ("layer", "head", "kv_head", "role", "best_relation")
"""Atlas columns that are not scores (no score or role may take these names)."""
_LABELS = ("none", "nan")
"""Labels that are not roles."""


def _is_nan(v: object) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _role_column(role: str, columns: Iterable[str]) -> str | None:
    """The column `role` reads in a frame with `columns`: its own name, else `ROLE_COLUMNS`; None
    when the frame has neither."""
    cols = set(columns)
    if role in cols:
        return role
    source = ROLE_COLUMNS.get(role)
    return source if source in cols else None


def role_labels(frame: pd.DataFrame, thresholds: Mapping[str, float] = ROLE_THRESHOLDS) -> pd.Series:
    """One role per row of `frame`: the first role of `thresholds` (in its order) whose column reaches
    its threshold; `"nan"` when a role's score is NaN (or None) before any role is reached; else
    `"none"`. A role reads the column of its name, the `sink` role `first_token_mass`
    (`ROLE_COLUMNS`); roles without a column in `frame` are skipped.

    Args:
        frame: an atlas frame (one row per head, numeric score columns).
        thresholds: `{role: threshold}` in precedence order (default `ROLE_THRESHOLDS`); each role a
            known role or a column of `frame`, each threshold a finite number > 0.

    Returns:
        Series `role` (str) on `frame`'s index.

    Raises:
        HeadsteerTypeError: `frame` not a DataFrame, `thresholds` not a mapping.
        HeadsteerValueError: a bad threshold, a role neither known nor a column, a non-numeric
            role column.
    """
    if not isinstance(frame, pd.DataFrame):
        raise HeadsteerTypeError(f"frame must be a pandas DataFrame, got {type(frame).__name__}")
    thresholds = _check_thresholds(thresholds, frame.columns)
    roles = [(r, c) for r in thresholds if (c := _role_column(r, frame.columns)) is not None]
    for _, c in roles:
        if not (pd.api.types.is_numeric_dtype(frame[c]) or frame[c].map(_is_nan).all()):
            raise HeadsteerValueError(f"role column {short_repr(c)} is not numeric ({frame[c].dtype})")
    out = []
    for _, row in frame.iterrows():
        best = "none"
        for r, c in roles:
            v, t = row[c], thresholds[r]
            if _is_nan(v):
                best = "nan"
                break
            if v >= t:
                best = r
                break
        out.append(best)
    return pd.Series(out, index=frame.index, name="role", dtype=object)


@dataclass
class HeadAtlas:
    """Every head's scores and role.

    Attributes:
        frame: one row per head (`L * H` rows): `layer, head, kv_head`, one float column per
            score (NaN = not scored), `role` (a role of `thresholds`, `"none"` or `"nan"`, see
            `role_labels`) and `best_relation` when MAPS scores were given.
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

    SCHEMA: ClassVar[str] = ATLAS_SCHEMA
    SCHEMA_VERSION: ClassVar[int] = ATLAS_SCHEMA_VERSION

    @property
    def geometry(self) -> tuple[int, int, int]:
        """`(n_layers, n_heads, n_kv_heads)` of the model, read from the rows."""
        f = self.frame
        return int(f["layer"].max()) + 1, int(f["head"].max()) + 1, int(f["kv_head"].max()) + 1

    def head_scores(self, score: str | None = None) -> HeadScores:
        """`[L, H]` one score column of the atlas (default the first of `score_columns`), NaN
        where a head was not scored.

        Raises:
            HeadsteerValueError: an unknown column, or an atlas without score columns.
        """
        cols = self.score_columns
        if score is None:
            if not cols:
                raise HeadsteerValueError("this atlas holds no score column")
            score = cols[0]
        if score not in cols:
            raise HeadsteerValueError(f"unknown score {short_repr(score)}; this atlas has {cols}")
        L, H, kv = self.geometry
        grid = torch.full((L, H), math.nan)
        vals = torch.tensor(self.frame[score].to_numpy(dtype=float), dtype=torch.float32)
        grid[torch.tensor(self.frame["layer"].to_numpy()), torch.tensor(self.frame["head"].to_numpy())] = vals
        src = self.sources.get(score, {})
        return HeadScores(
            grid,
            method=str(src.get("method", score)),
            params=dict(src.get("params", {})),
            model=self.model,
            n_kv_heads=kv,
        )

    def to_frame(self) -> pd.DataFrame:
        """A copy of `frame`: one row per head (`layer, head, kv_head`, the scores, `role`)."""
        return self.frame.copy()

    @property
    def score_columns(self) -> list[str]:
        """The score columns of `frame` (all but `layer, head, kv_head, role, best_relation`)."""
        return [c for c in self.frame.columns if c not in _RESERVED]

    def heads_with(self, role: str) -> list[tuple[int, int]]:
        """`(layer, head)` pairs labelled `role` (also `"none"` or `"nan"`), by descending score of
        that role; `[]` when no head has it.

        Raises:
            HeadsteerTypeError: `role` not a string.
        """
        if not isinstance(role, str):
            raise HeadsteerTypeError(f"role must be a string, got {short_repr(role)}")
        sub = self.frame[self.frame["role"] == role]
        column = _role_column(role, self.frame.columns)
        if column is not None:
            sub = sub.sort_values(column, ascending=False)
        return [(int(a), int(b)) for a, b in zip(sub["layer"], sub["head"], strict=True)]

    def roles_by_layer(self) -> pd.DataFrame:
        """Count of heads per (layer, role): rows layers, columns roles."""
        return pd.crosstab(self.frame["layer"], self.frame["role"])

    def relabel(self, thresholds: Mapping[str, float]) -> HeadAtlas:
        """The same atlas with roles from other thresholds (see `role_labels`; the atlas itself is
        left unchanged).

        Raises:
            HeadsteerValueError / HeadsteerTypeError: bad thresholds (see `role_labels`).
        """
        t = _check_thresholds(thresholds, self.frame.columns)
        frame = self.frame.copy()
        frame["role"] = role_labels(frame, t)
        return HeadAtlas(frame, self.model, t, dict(self.sources), self.thumbnails, dict(self.lens_tokens))

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the atlas as JSON (schema `headsteer/head-atlas`; NaN as null), atomically; returns
        the path.

        Raises:
            HeadsteerValueError: `path` exists without `overwrite`, is a folder or a symlink.
            HeadsteerTypeError: `path` not a path, `overwrite` not a bool.
        """
        path = check_path("path", path)
        check_bool("overwrite", overwrite)
        rows = json.loads(self.frame.to_json(orient="records"))
        data: dict[str, Any] = {
            "schema": ATLAS_SCHEMA,
            "schema_version": ATLAS_SCHEMA_VERSION,
            "model": self.model,
            "thresholds": self.thresholds,
            "sources": self.sources,
            "rows": rows,
            "lens_tokens": [[la, h, toks] for (la, h), toks in self.lens_tokens.items()],
            "thumbnails": None
            if self.thumbnails is None
            else self.thumbnails.float().round(decimals=4).tolist(),
        }
        return write_text(path, json_text(data), overwrite=overwrite)

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> HeadAtlas:
        """Read a file written by `save`; every field is checked (schema and version, model, rows
        with `layer, head, kv_head, role`, thresholds, sources, lens tokens, thumbnails of the
        rows' geometry), and the rows' geometry against `model`'s when given.

        Raises:
            FileNotFoundError: no such file.
            HeadsteerValueError: not UTF-8 JSON (line and column) or an integer of more than 4300
                digits ("a number in '<file>' is too large ..."), not an atlas file, another
                schema version, or a field missing or malformed (the message names it).
            HeadsteerTypeError: `path` not a path.
        """
        shown = check_path("path", path)
        p = Path(shown)
        if p.is_dir():
            raise HeadsteerValueError(f"{shown!r} is a folder, not a head-atlas file")
        if not p.is_file():
            raise FileNotFoundError(f"atlas file not found: {shown!r}")
        data = read_json_file(p)  # one line: not JSON (line, column), not UTF-8, a number too large
        if not isinstance(data, dict) or data.get("schema") != ATLAS_SCHEMA:
            raise HeadsteerValueError(f"{shown!r} is not a headsteer head-atlas file")
        out = cls(*_check_atlas_data(data, shown))
        check_geometry(shown, out.geometry, model)
        return out

    def __repr__(self) -> str:
        counts = self.frame["role"].value_counts()
        parts = ", ".join(f"{r}: {n}" for r, n in counts.items() if r != "none")
        return (
            f"HeadAtlas({self.model!r}, {len(self.frame)} heads, {len(self.score_columns)} scores; "
            f"roles {parts or 'none'})"
        )

    def _repr_html_(self) -> str:
        import html

        table: str = self.frame.head(20).to_html(float_format="%.3f")
        return f"<b>{html.escape(repr(self))}</b>" + table


def _check_thresholds(thresholds: object, columns: Iterable[str] | None = None) -> dict[str, float]:
    """`{role: float}`: each role a string, known (`ROLE_THRESHOLDS`) or one of `columns` when
    given, not a reserved column or label; each threshold a finite number > 0 (numpy too)."""
    if not isinstance(thresholds, Mapping):
        raise HeadsteerTypeError(
            f"thresholds must be a {{role: threshold}} mapping, got {short_repr(thresholds)}"
        )
    cols = None if columns is None else set(columns)
    out = {}
    for k, v in thresholds.items():
        if not isinstance(k, str) or not k or k in _RESERVED or k in _LABELS:
            raise HeadsteerValueError(f"role {short_repr(k)} in thresholds is not a role name")
        if cols is not None:
            _check_role(k, cols)
        out[k] = check_number(f"threshold of {k!r}", v, lo=0.0, lo_open=True)
    return out


def _check_role(role: str, columns: Iterable[str]) -> None:
    """Refuse a role that is neither known (`ROLE_THRESHOLDS`) nor one of `columns`."""
    if role not in ROLE_THRESHOLDS and role not in columns:
        raise HeadsteerValueError(
            f"unknown role {short_repr(role)} in thresholds: use one of {list(ROLE_THRESHOLDS)} or a "
            "score column"
        )


def _check_atlas_data(data: dict, path: str) -> tuple:
    """The `HeadAtlas` fields of a loaded atlas file, each checked."""

    def bad(what: str) -> HeadsteerValueError:
        return HeadsteerValueError(f"{path!r} is not a valid head-atlas file: {what}")

    check_schema_version(path, data.get("schema_version"), ATLAS_SCHEMA_VERSION, "head-atlas")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad(f"model must be a non-empty name, got {short_repr(model)}")
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise bad("rows must be a non-empty list of objects")
    for r in rows:
        if not all(is_int(r.get(k)) and r.get(k) >= 0 for k in ("layer", "head", "kv_head")):
            raise bad(f"a row lacks int layer, head, kv_head: {str(r)[:80]}")
        if not isinstance(r.get("role"), str):
            raise bad(f"a row lacks its role: {str(r)[:80]}")
    frame = pd.DataFrame(rows)
    try:
        thresholds = _check_thresholds(data.get("thresholds"), frame.columns)
    except (HeadsteerValueError, HeadsteerTypeError) as err:
        raise bad(str(err)) from None
    sources = data.get("sources", {})
    if not isinstance(sources, dict):
        raise bad("sources must be an object")
    old = sources.get("sink")
    if "sink" in frame.columns and isinstance(old, dict) and old.get("method") == "first_token_mass":
        # an atlas of an earlier version: its first-token column was named `sink`
        if "first_token_mass" not in frame.columns:
            frame = frame.rename(columns={"sink": "first_token_mass"})
            sources = {("first_token_mass" if k == "sink" else k): v for k, v in sources.items()}
    tokens = {}
    lens_tokens = data.get("lens_tokens", [])
    if not isinstance(lens_tokens, list):
        raise bad("lens_tokens must be a list of [layer, head, tokens]")
    for item in lens_tokens:
        if (
            not isinstance(item, list)
            or len(item) != 3
            or not (is_int(item[0]) and is_int(item[1]))
            or not isinstance(item[2], list)
            or not all(isinstance(t, str) for t in item[2])
        ):
            raise bad(f"lens_tokens entry {str(item)[:80]} is not [layer, head, [tokens]]")
        tokens[(int(item[0]), int(item[1]))] = list(item[2])
    thumbs = data.get("thumbnails")
    if thumbs is not None:
        L, H = int(frame["layer"].max()) + 1, int(frame["head"].max()) + 1
        try:
            thumbs = torch.tensor(thumbs, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise bad("thumbnails must be an [L, H, s, s] array of numbers") from None
        if thumbs.ndim != 4 or tuple(thumbs.shape[:2]) != (L, H) or thumbs.shape[2] != thumbs.shape[3]:
            raise bad(f"thumbnails are {tuple(thumbs.shape)}, want [{L}, {H}, s, s]")
        thumbs = thumbs.half()
    return frame, model, thresholds, dict(sources), thumbs, tokens
