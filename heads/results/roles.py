"""`RoleScores`: every role detector's `[L, H]` scores, by detector name (`heads.detect_roles`).

A mapping `{name: HeadScores}` (so `scores["induction"]` and iteration keep working) that also
follows the result protocol (`heads.results.protocol.Result`): `head_scores(role)`, a wide
`to_frame()`, `save()` / `load()`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.results.scores import HeadScores
from heads.results.storage import check_geometry, read_result, write_result

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel

__all__ = ["SCHEMA", "SCHEMA_VERSION", "RoleScores"]

SCHEMA = "headsteer/role-scores"
SCHEMA_VERSION = 1


class RoleScores(dict[str, HeadScores]):
    """`{detector name: HeadScores [L, H]}` of one model, in the detectors' order.

    Raises:
        HeadsteerValueError: (when built) a value that is not a `HeadScores`, or scores of
            different geometries.
    """

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    def __init__(self, scores: Mapping[str, HeadScores] | None = None) -> None:
        super().__init__(scores or {})
        shapes = set()
        for name, s in self.items():
            if not isinstance(s, HeadScores):
                raise HeadsteerValueError(f"role {short_repr(name)} holds {type(s).__name__}, not HeadScores")
            shapes.add((s.n_layers, s.n_heads, s.n_kv_heads))
        if len(shapes) > 1:
            raise HeadsteerValueError(f"role scores of different geometries: {sorted(shapes)}")

    def head_scores(self, role: str | None = None) -> HeadScores:
        """`[L, H]` scores of detector `role` (default the first, `"induction"` from `detect_roles`).

        Raises:
            HeadsteerValueError: an unknown role, or no role at all.
        """
        if not self:
            raise HeadsteerValueError("RoleScores holds no role")
        if role is None:
            role = next(iter(self))
        if role not in self:
            raise HeadsteerValueError(f"unknown role {short_repr(role)}; known: {', '.join(self)}")
        return self[role]

    def to_frame(self) -> pd.DataFrame:
        """One row per head: `layer, head, kv_head` and one score column per role."""
        first = self.head_scores()
        df = first.to_frame().drop(columns=["score"])
        for name, s in self.items():
            df[name] = s.scores.flatten().numpy()
        return df

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write every role's scores as JSON (schema `headsteer/role-scores`; NaN as null),
        atomically; returns the path.

        Raises:
            HeadsteerValueError: `path` exists and `overwrite` is False, is a symlink or a folder;
                a score is +-inf.
        """
        payload = {"roles": {name: s.to_json() for name, s in self.items()}}
        return write_result(path, SCHEMA, SCHEMA_VERSION, payload, overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> RoleScores:
        """Read a file `save` wrote, checked against `model`'s geometry when given.

        Raises:
            FileNotFoundError: no such file.
            HeadsteerValueError: not a role-scores file, another schema version, a malformed
                field, a model of another geometry.
        """
        data = read_result(path, SCHEMA, SCHEMA_VERSION, "RoleScores")
        roles: Any = data.get("roles")
        if not isinstance(roles, dict) or not roles:
            raise HeadsteerValueError(f"{short_repr(str(path))}: roles must map each role to its scores")
        out = cls({name: HeadScores._from_json(v, str(path)) for name, v in roles.items()})
        s = out.head_scores()
        check_geometry(path, (s.n_layers, s.n_heads, s.n_kv_heads), model)
        return out

    def __repr__(self) -> str:
        if not self:
            return "RoleScores(no roles)"
        s = self.head_scores()
        shape = f"[{s.n_layers}, {s.n_heads}]"
        return f"RoleScores({s.model or 'model'}: {len(self)} roles {list(self)}, {shape})"
