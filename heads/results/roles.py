"""`RoleScores`: every role detector's `[L, H]` scores, by detector name (`heads.detect_roles`).

It follows the result protocol (`heads.results.protocol.Result`): `head_scores(role)`, a wide
`to_frame()`, `save()` / `load()`; `roles` names the detectors and `as_dict()` gives the plain
`{name: HeadScores}` dict.

It is still a `dict` subclass for one release: the dict-style reads (`scores["induction"]`,
`.get`, `.items()`, `.keys()`, `.values()`, iteration, `in`) work as before but warn
(`DeprecationWarning`, naming the new spelling: `scores.head_scores("induction")`,
`scores.roles`, `scores.as_dict()`); they go in headsteer `REMOVED_IN`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from heads._util.aliases import REMOVED_IN
from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.results.scores import HeadScores
from heads.results.storage import check_geometry, guarded_load, read_result, write_result

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from heads.model.adapter import HeadModel

__all__ = ["SCHEMA", "SCHEMA_VERSION", "RoleScores"]

_get = dict.__getitem__
_items = dict.items


def _deprecated(old: str, new: str) -> None:
    """Warn that the dict-style `old` of `RoleScores` goes, naming `new` (stacklevel: the caller
    of the dict method)."""
    warnings.warn(
        f"RoleScores{old} (dict-style access) is deprecated and goes in headsteer {REMOVED_IN}; use {new}",
        DeprecationWarning,
        stacklevel=3,
    )


SCHEMA = "headsteer/role-scores"
SCHEMA_VERSION = 1


class RoleScores(dict[str, HeadScores]):
    """Every detector's `HeadScores [L, H]` of one model, by detector name, in the detectors' order.

    Read a detector's scores with `head_scores(name)`, the names with `roles`, the whole mapping
    with `as_dict()`. The dict-style reads (`scores[name]`, `.get`, `.items()`, `.keys()`,
    `.values()`, iteration, `in`) still work for one release and warn (`DeprecationWarning`).

    Raises:
        HeadsteerValueError: (when built) a value that is not a `HeadScores`, or scores of
            different geometries.
    """

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    def __init__(self, scores: Mapping[str, HeadScores] | None = None) -> None:
        super().__init__(scores or {})
        shapes = set()
        for name, s in _items(self):
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
        names = self.roles
        if not names:
            raise HeadsteerValueError("RoleScores holds no role")
        if role is None:
            role = names[0]
        if not isinstance(role, str) or role not in names:
            raise HeadsteerValueError(f"unknown role {short_repr(role)}; known: {', '.join(names)}")
        out: HeadScores = _get(self, role)
        return out

    @property
    def roles(self) -> tuple[str, ...]:
        """The detector names, in the detectors' order (`"induction"` first from `detect_roles`)."""
        return tuple(dict.keys(self))

    def as_dict(self) -> dict[str, HeadScores]:
        """`{detector name: HeadScores [L, H]}`, a plain dict (a new one; the scores are shared)."""
        return dict(_items(self))

    # ---- the dict-style reads: kept one release, each warns (DeprecationWarning)
    def __getitem__(self, role: str) -> HeadScores:
        _deprecated(f"[{role!r}]", f"scores.head_scores({role!r})")
        return self.head_scores(role) if role in self.roles else _get(self, role)

    def get(self, role: str, default: Any = None) -> Any:
        _deprecated(f".get({role!r})", f"scores.head_scores({role!r})")
        return _get(self, role) if role in self.roles else default

    def __iter__(self) -> Iterator[str]:
        _deprecated(" iteration", "scores.roles")
        return iter(self.roles)

    def __contains__(self, role: object) -> bool:
        _deprecated(" 'in'", "name in scores.roles")
        return role in self.roles

    def keys(self) -> KeysView[str]:  # type: ignore[override]
        _deprecated(".keys()", "scores.roles")
        return dict.keys(self)

    def values(self) -> ValuesView[HeadScores]:  # type: ignore[override]
        _deprecated(".values()", "scores.head_scores(name) for name in scores.roles")
        return dict.values(self)

    def items(self) -> ItemsView[str, HeadScores]:  # type: ignore[override]
        _deprecated(".items()", "scores.as_dict().items()")
        return dict.items(self)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle and copy through `as_dict()` (not the deprecated `items()`)."""
        return (type(self), (self.as_dict(),))

    def to_frame(self) -> pd.DataFrame:
        """One row per head: `layer, head, kv_head` and one score column per role."""
        first = self.head_scores()
        df = first.to_frame().drop(columns=["score"])
        for name, s in _items(self):
            df[name] = s.scores.flatten().numpy()
        return df

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write every role's scores as JSON (schema `headsteer/role-scores`; NaN as null),
        atomically; returns the path.

        Raises:
            HeadsteerValueError: `path` exists and `overwrite` is False, is a symlink or a folder;
                a score is +-inf.
        """
        payload = {"roles": {name: s.to_json() for name, s in _items(self)}}
        return write_result(path, SCHEMA, SCHEMA_VERSION, payload, overwrite=overwrite)

    @classmethod
    @guarded_load
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
        return f"RoleScores({s.model or 'model'}: {len(self)} roles {list(self.roles)}, {shape})"
