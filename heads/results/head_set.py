"""`HeadSet`: an ordered, duplicate-free selection of heads, and `HeadSpec`, every form a head
selection is given in.

A `HeadSet` serialises to the JSON shape PASTA users already have, `{"layer": [heads]}` (layer
keys as strings), so a head profile is a `HeadSet`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias, Union

from heads._util.files import write_text
from heads._util.validation import check_int, is_int, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.storage import json_text, read_json

__all__ = ["HeadSet", "HeadSpec"]

HEAD_SCORES_SCHEMA = "headsteer/head-scores"
"""The schema of a `HeadScores` file (`heads.results.scores.SCHEMA`): not a head selection."""


def _as_int(value: Any, what: str, *, allow_str: bool = False) -> int:
    """An int from an int-like value (or, with `allow_str`, a decimal string: JSON keys).

    Raises:
        ValueError: a bool, float (also NaN and whole floats such as 3.0), None, a
            string (unless `allow_str` and decimal) or any other non-integer; the
            message names `what` and the value.
    """
    if is_int(value):
        return int(value)
    if allow_str and isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
        digits = len(value.strip().lstrip("-"))
        if digits > _MAX_DIGITS:  # int() refuses > 4300 digits with a message about Python, not the key
            raise HeadsteerValueError(
                f"{what} {value.strip()[:12]}... has {digits} digits: not a {what} index"
            )
        return int(value)
    text = repr(value)
    raise HeadsteerValueError(f"{what} must be an int, got {text if len(text) <= 80 else text[:77] + '...'}")


_MAX_DIGITS = 18
"""Longest decimal layer key read as an int (anything longer is no index of any model)."""


def _positive_int(k: Any, what: str = "k") -> int:
    check_int(what, k, lo=1)
    return int(k)


HeadSpec: TypeAlias = Union[
    "HeadSet",
    Mapping[int, Iterable[int]],
    Mapping[str, Iterable[int]],
    Sequence[tuple[int, int]],
    Sequence[Sequence[int]],
    Sequence[int],
    str,
    os.PathLike[str],
]
"""A head selection, in any form `HeadSet.parse` accepts.

* a `HeadSet` (e.g. a `HeadScores` selection: `scores.top(k)`, `.per_layer(k)`,
  `.threshold(t)`);
* a `{layer: [heads]}` mapping, layer keys ints or decimal strings (PASTA's JSON shape);
* a sequence of `(layer, head)` pairs (tuples or 2-lists);
* a sequence of layers, meaning every head of each (needs `n_heads`);
* a path (`str` or `os.PathLike`) to a JSON file of the mapping shape.

A `HeadScores` itself is not a selection (`HeadSet.parse` raises `TypeError`).
"""


class HeadSet:
    """An ordered, duplicate-free set of `(layer, head)` pairs.

    Build one with `HeadSet.parse(spec)` from: a `{"layer": [heads]}` dict (keys may
    be strings, as in PASTA's JSON files), a list of layers (all heads of each), a
    list of `(layer, head)` pairs, another `HeadSet`, or a path to a JSON file of
    the dict shape.
    """

    def __init__(self, heads: Iterable[tuple[int, int]] = ()):
        pairs = set()
        for x in heads:
            if not isinstance(x, (tuple, list)) or len(x) != 2:
                raise HeadsteerValueError(f"expected a (layer, head) pair, got {short_repr(x)}")
            pairs.add((_as_int(x[0], "layer"), _as_int(x[1], "head")))
        self.heads: tuple[tuple[int, int], ...] = tuple(sorted(pairs))

    # ---------------------------------------------------------------- parsing
    @classmethod
    def parse(
        cls,
        spec: HeadSpec,
        n_layers: int | None = None,
        n_heads: int | None = None,
    ) -> HeadSet:
        """Parse a head selection and check it against `n_layers` x `n_heads`.

        `spec` is a `HeadSpec` (see there for the forms). Layer keys of a dict may be
        decimal strings (JSON keys); every head, and every layer given in a list, must
        be an int (bool, float, NaN, null and strings are refused).

        Raises:
            ValueError: unknown layer or head (named); a layer or head that is not an
                int; a file that is not a `{"layer": [heads]}` JSON object, repeats a
                key, or is nested too deeply. An empty selection is valid.
            TypeError: a `HeadScores` (call `.top(k)` first) or another type.
            FileNotFoundError: a path that does not exist.
        """
        if hasattr(spec, "scores") and hasattr(spec, "top") and not isinstance(spec, HeadSet):  # HeadScores
            raise HeadsteerTypeError("pass a selection of a HeadScores, e.g. scores.top(30), not the scores")
        if isinstance(spec, (str, os.PathLike)):
            try:
                is_file = Path(spec).is_file()
            except (OSError, ValueError):  # a name too long for the file system, a NUL byte
                is_file = False
            if not is_file:
                shown = str(spec) if len(str(spec)) <= 80 else str(spec)[:77] + "..."
                raise FileNotFoundError(f"head file not found: {shown!r}")
            data = read_json(spec)
            if isinstance(data, Mapping) and data.get("schema") == HEAD_SCORES_SCHEMA:
                raise HeadsteerValueError(f"{str(spec)!r} holds HeadScores; load it and call .top(k)")
            if not isinstance(data, Mapping):
                raise HeadsteerValueError(f'{str(spec)!r} must hold a {{"layer": [heads]}} JSON object')
            spec = data
        if isinstance(spec, HeadSet):
            out = cls(spec.heads)
        elif isinstance(spec, Mapping):
            pairs: list[tuple[int, int]] = []
            for layer, hs in spec.items():
                layer = _as_int(layer, "layer", allow_str=True)
                if isinstance(hs, (str, bytes, Mapping)) or not isinstance(hs, Iterable):
                    raise HeadsteerValueError(
                        f"heads of layer {short_repr(layer)} must be a list of ints, got {short_repr(hs)}"
                    )
                pairs.extend((layer, _as_int(h, "head")) for h in hs)
            out = cls(pairs)
        elif isinstance(spec, Sequence):
            if all(not isinstance(x, (list, tuple)) for x in spec):
                if n_heads is None:
                    raise HeadsteerValueError("a list of layers needs n_heads")
                out = cls((_as_int(la, "layer"), h) for la in spec for h in range(n_heads))
            else:
                pairs = []
                for x in spec:
                    if not isinstance(x, (list, tuple)) or len(x) != 2:
                        raise HeadsteerValueError(f"expected a (layer, head) pair, got {short_repr(x)}")
                    pairs.append((_as_int(x[0], "layer"), _as_int(x[1], "head")))
                out = cls(pairs)
        else:
            raise HeadsteerTypeError(f"cannot read a head selection from {type(spec).__name__}")
        out.check(n_layers, n_heads)
        return out

    def check(self, n_layers: int | None, n_heads: int | None) -> None:
        """Raise `ValueError` naming the first head outside `n_layers` x `n_heads`."""
        for layer, head in self.heads:
            if n_layers is not None and not 0 <= layer < n_layers:
                raise HeadsteerValueError(
                    f"unknown layer {short_repr(layer)}: the model has layers 0..{n_layers - 1}"
                )
            if n_heads is not None and not 0 <= head < n_heads:
                raise HeadsteerValueError(
                    f"unknown head {short_repr(head)} in layer {short_repr(layer)}: the model has heads "
                    f"0..{n_heads - 1}"
                )

    # ---------------------------------------------------------------- views
    def by_layer(self) -> dict[int, list[int]]:
        """`{layer: [heads]}` with int keys, layers ascending."""
        out: dict[int, list[int]] = {}
        for layer, head in self.heads:
            out.setdefault(layer, []).append(head)
        return out

    def to_dict(self) -> dict[str, list[int]]:
        """The PASTA JSON shape `{"layer": [heads]}` (string keys)."""
        return {str(k): v for k, v in self.by_layer().items()}

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write `to_dict()` as JSON atomically (`heads._util.files.write_text`); returns the path.

        Missing parent folders are created.

        Raises:
            ValueError: `path` exists and `overwrite` is False, or is a symlink or a folder.
        """
        return write_text(path, json_text(self.to_dict(), indent=1), overwrite=overwrite)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.heads)

    def __len__(self) -> int:
        return len(self.heads)

    def __contains__(self, item: object) -> bool:
        return item in self.heads

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HeadSet) and self.heads == other.heads

    def __repr__(self) -> str:
        """`HeadSet(3 heads: {20: [0], 24: [4, 7]})`: layers as ints (`to_dict` keeps PASTA's
        string keys for JSON)."""
        return f"HeadSet({len(self)} heads: {self.by_layer()})"
