"""The file I/O every result shares (`heads.results.protocol` documents the protocol): strict
JSON reading, the header and schema checks of `save` / `load`, and the model-geometry check.

A leaf of `heads.results`: the result classes import it, and the protocol (which names
`HeadScores`) re-exports it, so no module of the package imports another in a cycle.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from heads._util.files import write_text
from heads._util.validation import no_duplicate_keys, read_json_file, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError

if TYPE_CHECKING:  # pragma: no cover
    from heads.model.adapter import HeadModel

__all__ = [
    "check_geometry",
    "check_load_model",
    "check_schema_version",
    "guarded_load",
    "finite_or_none",
    "json_text",
    "nan_for_none",
    "read_json",
    "read_result",
    "write_result",
]


_no_duplicate_keys = no_duplicate_keys  # the name request_base imports


def finite_or_none(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, +-inf) replaced by None, recursively through dicts,
    lists and tuples (tuples become lists): what a JSON file can hold. Other values unchanged."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def nan_for_none(obj: Any) -> Any:
    """The inverse of `finite_or_none` for numeric containers: every None inside a list becomes
    NaN, recursively through dicts and lists; a None value of a dict key stays None (it may mean
    "absent"), unless the whole value is a list."""
    if isinstance(obj, Mapping):
        return {k: nan_for_none(v) if isinstance(v, (Mapping, list)) else v for k, v in obj.items()}
    if isinstance(obj, list):
        return [float("nan") if v is None else nan_for_none(v) for v in obj]
    return obj


def json_text(obj: Any, *, indent: int | None = None) -> str:
    """The JSON text every result file is written with (one writer for all of them): non-finite
    floats (NaN, +-inf) written as null (`finite_or_none`; JSON has no NaN), ending with a newline.
    Loaders read such a null back as NaN where the field holds numbers."""
    return json.dumps(finite_or_none(obj), indent=indent, allow_nan=False) + "\n"


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file strictly (`heads._util.validation.read_json_file`, and a key given twice
    in one object is an error).

    Raises:
        FileNotFoundError: no such file.
        ValueError: one line naming the file: bad JSON text (line and column), a repeated key, an
            integer of more than 4300 digits, or nesting too deep to parse.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"file not found: {str(path)!r}")
    return read_json_file(path, object_pairs_hook=_no_duplicate_keys)


def write_result(
    path: str | os.PathLike, schema: str, version: int, payload: Mapping[str, Any], *, overwrite: bool = False
) -> Path:
    """Write `{"schema", "schema_version", **payload}` as JSON to `path`; returns the path.

    Atomic (temporary file, then rename), missing parent folders created; NaN and +-inf are
    written as null (`json_text`).

    Raises:
        ValueError: `path` exists and `overwrite` is False; `path` is a symlink or a folder.
    """
    body = {"schema": schema, "schema_version": version, **payload}
    return write_text(path, json_text(body, indent=1), overwrite=overwrite)


def read_result(path: str | os.PathLike, schema: str, version: int, what: str) -> Mapping[str, Any]:
    """The JSON object of a file `write_result` wrote with `schema` and `version`.

    Args:
        path: the file.
        schema, version: what the file must declare.
        what: the result's name for messages (`"HeadScores"`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: one line naming the file: not JSON (line and column), a repeated key, not a
            `what` file (another or no schema), or another schema version.
    """
    data = read_json(path)
    name = short_repr(str(path))
    if not isinstance(data, Mapping) or data.get("schema") != schema:
        raise HeadsteerValueError(f"{name} is not a headsteer {what} file")
    check_schema_version(path, data.get("schema_version"), version)
    return data


def check_schema_version(path: str | os.PathLike, got: Any, version: int, what: str = "") -> None:
    """The one schema-version check of every result file: `got` must be an int (not a bool, not
    a float such as 1.0, not missing) equal to `version`.

    Raises:
        ValueError: naming the file and the value found.
    """
    if type(got) is not int or got != version:
        raise HeadsteerValueError(
            f"{short_repr(str(path))} has {what + ' ' if what else ''}schema_version {short_repr(got)}; "
            f"this headsteer reads version {version} (an integer)"
        )


def check_load_model(model: Any) -> None:
    """The model argument of every `load`: None or a `HeadModel`.

    Raises:
        TypeError: anything else, naming its type.
    """
    if model is not None and not all(hasattr(model, a) for a in ("n_layers", "n_heads", "n_kv_heads")):
        raise HeadsteerTypeError(f"model must be a HeadModel or None, got {type(model).__name__}")


_Load = TypeVar("_Load", bound=Callable[..., Any])


def guarded_load(load: _Load) -> _Load:
    """Wrap a result's `load(cls, path, model=None)` (under `@classmethod`) so that every result
    reads files alike: the model argument is checked first (`check_load_model`), and any
    TypeError / ValueError / KeyError / AttributeError / IndexError raised while decoding the
    file's fields (a tampered file: a string where a number belongs, null in a list, ...) becomes
    one `HeadsteerValueError` naming the file and the fault; a headsteer error that does not
    name the file gets it prefixed."""

    @functools.wraps(load)
    def wrapper(cls: Any, path: Any, model: Any = None, *args: Any, **kwargs: Any) -> Any:
        check_load_model(model)
        try:
            return load(cls, path, model, *args, **kwargs)
        except (HeadsteerTypeError, HeadsteerValueError) as exc:
            if not isinstance(path, (str, os.PathLike)):
                raise  # the path argument itself is bad
            where = os.fspath(path)
            named = where in str(exc)
            if named and isinstance(exc, HeadsteerValueError):
                raise
            raise HeadsteerValueError(str(exc) if named else f"{where!r}: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            where = os.fspath(path) if isinstance(path, (str, os.PathLike)) else repr(path)
            detail = f"missing or bad field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise HeadsteerValueError(
                f"{where!r} is not a valid {getattr(cls, '__name__', 'result')} file: a field has "
                f"the wrong type or value ({type(exc).__name__}: {short_repr(detail)})"
            ) from exc

    return cast(_Load, wrapper)


def check_geometry(
    path: str | os.PathLike, got: tuple[int, int, int | None], model: HeadModel | None
) -> None:
    """Check a loaded result's `(n_layers, n_heads, n_kv_heads)` against `model` (None: no check).

    Raises:
        TypeError: `model` is not a `HeadModel`.
        ValueError: the geometries differ (the message names both).
    """
    if model is None:
        return
    if not hasattr(model, "n_kv_heads"):
        raise HeadsteerTypeError(f"model must be a HeadModel, got {type(model).__name__}")
    want = (model.n_layers, model.n_heads, model.n_kv_heads)
    if tuple(got) != want:
        raise HeadsteerValueError(
            f"{short_repr(str(path))} was computed on a model with (n_layers, n_heads, n_kv_heads)="
            f"{tuple(got)}, this model has {want}"
        )
