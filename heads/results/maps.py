"""`MapsScores`: static MAPS relation and suppression scores of every head, per relation
(`heads.maps_scores`; docs/methods/maps.md).

It follows the result protocol (`heads.results.protocol.Result`) and is re-exported from its old
home, `heads.scorers.maps.static`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from heads._util.validation import check_int, is_int, short_repr
from heads.errors import HeadsteerValueError
from heads.results.scores import HeadScores
from heads.results.storage import check_geometry, guarded_load, read_result, write_result
from heads.results.views import html_view, top_heads_text

if TYPE_CHECKING:  # pragma: no cover
    from heads.model.adapter import HeadModel

__all__ = ["IMPLEMENTS_THRESHOLD", "SCHEMA", "SCHEMA_VERSION", "MapsScores"]

SCHEMA = "headsteer/maps-scores"
SCHEMA_VERSION = 1

IMPLEMENTS_THRESHOLD = 0.15
"""A head "implements" a relation when its relation score is >= 0.15 (docs/methods/maps.md)."""


@dataclass
class MapsScores:
    """Relation and suppression `HeadScores` per relation, plus provenance."""

    relation: dict[str, HeadScores]
    suppression: dict[str, HeadScores]
    params: dict = field(default_factory=dict)

    SCHEMA: ClassVar[str] = SCHEMA
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    def names(self) -> list[str]:
        return list(self.relation)

    def head_scores(self, relation: str | None = None) -> HeadScores:
        """`[L, H]` relation scores of `relation`, or by default each head's best relation score
        (`best_relation()[0]`).

        Raises:
            HeadsteerValueError: an unknown relation, or no relation at all.
        """
        if relation is None:
            return self.best_relation()[0]
        if relation not in self.relation:
            raise HeadsteerValueError(f"unknown relation {short_repr(relation)}; known: {self.names()}")
        return self.relation[relation]

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the scores as JSON (schema `headsteer/maps-scores`; NaN as null), atomically;
        returns the path.

        Raises:
            HeadsteerValueError: `path` exists and `overwrite` is False, is a symlink or a folder;
                a score is +-inf.
        """
        payload = {
            "params": self.params,
            "relations": {
                n: {"relation": self.relation[n].to_json(), "suppression": self.suppression[n].to_json()}
                for n in self.names()
            },
        }
        return write_result(path, SCHEMA, SCHEMA_VERSION, payload, overwrite=overwrite)

    @classmethod
    @guarded_load
    def load(cls, path: str | os.PathLike, model: HeadModel | None = None) -> MapsScores:
        """Read a file `save` wrote, checked against `model`'s geometry when given.

        Raises:
            FileNotFoundError: no such file.
            HeadsteerValueError: not a MAPS file, another schema version, a malformed field, a
                model of another geometry.
        """
        data = read_result(path, SCHEMA, SCHEMA_VERSION, "MapsScores")
        rels = data.get("relations")
        if not isinstance(rels, dict) or not all(
            isinstance(v, dict) and set(v) == {"relation", "suppression"} for v in rels.values()
        ):
            raise HeadsteerValueError(
                f"{short_repr(str(path))} is not a valid MapsScores file: relations must map each name "
                "to its relation and suppression scores"
            )
        relation: dict[str, HeadScores] = {}
        suppression: dict[str, HeadScores] = {}
        for n, v in rels.items():
            relation[n] = HeadScores._from_json(v["relation"], str(path))
            suppression[n] = HeadScores._from_json(v["suppression"], str(path))
            s = relation[n]
            check_geometry(path, (s.n_layers, s.n_heads, s.n_kv_heads), model)
        params: Any = data.get("params") or {}
        return cls(relation, suppression, dict(params))

    def __repr__(self) -> str:
        tops = "; ".join(f"{n}: {top_heads_text(self.relation[n], 1)}" for n in self.names())
        return f"MapsScores({len(self.relation)} relations, top head per relation: {tops})"

    def _repr_html_(self) -> str:
        rows = []
        for n in self.names():
            s = self.relation[n]
            rows.append((n, top_heads_text(s, 3), int((s.scores >= IMPLEMENTS_THRESHOLD).sum())))
        header = ("relation", "top heads (relation score)", f"heads >= {IMPLEMENTS_THRESHOLD}")
        return html_view(f"MapsScores: {len(rows)} relations", rows, header)

    def best_relation(self) -> tuple[HeadScores, list[list[str]]]:
        """Each head's strongest relation: its highest relation score over the relations
        (`HeadScores` `[L, H]`, method `"maps_best_relation"`; NaN scores count as -1) and that
        relation's name per head (`[L][H]`, ties to the first relation in `names()` order).

        This is the atlas' `best_relation_score` / `best_relation` columns.

        Raises:
            ValueError: no relation.
        """
        names = self.names()
        if not names:
            raise HeadsteerValueError("MapsScores holds no relation")
        first = self.relation[names[0]]
        stack = torch.stack([self.relation[n].scores for n in names])  # [R, L, H]
        best = stack.nan_to_num(-1.0).max(0)
        which = [[names[i] for i in row] for row in best.indices.tolist()]
        scores = HeadScores(
            best.values,
            "maps_best_relation",
            {**self.params, "relations": names},
            model=first.model,
            n_kv_heads=first.n_kv_heads,
        )
        return scores, which

    def to_frame(self):
        """Tidy table: `relation, layer, head, kv_head, relation_score, suppression_score`."""
        import pandas as pd

        frames = []
        for name in self.names():
            f = self.relation[name].to_frame().rename(columns={"score": "relation_score"})
            f["suppression_score"] = self.suppression[name].to_frame()["score"]
            f.insert(0, "relation", name)
            frames.append(f)
        return pd.concat(frames, ignore_index=True)

    def describe(
        self, layer: int, head: int, *, threshold: float = IMPLEMENTS_THRESHOLD, top: int = 3
    ) -> str:
        """One line on what head (layer, head) does, from its relation and suppression scores.

        Lists the relations it implements (score >= `threshold`), else its strongest
        ones, and the relations it suppresses most (ties by name). No external LLM is used.

        Raises:
            ValueError: unknown layer or head, or `top` < 1.
        """
        any_scores = next(iter(self.relation.values()))
        n_layers, n_heads = any_scores.n_layers, any_scores.n_heads
        for what, v, n in (("layer", layer, n_layers), ("head", head, n_heads)):
            if not is_int(v) or not 0 <= v < n:
                raise HeadsteerValueError(
                    f"unknown {what} {short_repr(v)}: there are {n} ({what}s 0..{n - 1})"
                )
        top = check_int("top", top, lo=1)

        def order(table: dict[str, HeadScores]) -> list[tuple[float, str]]:
            pairs = [(table[n].scores[layer, head].item(), n) for n in self.names()]
            return sorted(pairs, key=lambda x: (-x[0], x[1]))

        rel, sup = order(self.relation), order(self.suppression)
        fmt = lambda xs: ", ".join(f"{n} ({v:.2f})" for v, n in xs)  # noqa: E731
        impl = [x for x in rel if x[0] >= threshold]
        parts = [f"L{layer}.H{head}"]
        if impl:
            parts.append(f"implements {fmt(impl[:top])}")
        else:
            parts.append(f"implements no relation at >= {threshold:.2f}; strongest {fmt(rel[:top])}")
        strong_sup = [x for x in sup if x[0] >= threshold]
        if strong_sup:
            parts.append(f"suppresses {fmt(strong_sup[:top])}")
        return "; ".join(parts)
