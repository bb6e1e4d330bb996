"""Shared argument validators: one place for the checks every public function repeats.

Each raises `heads.errors.HeadsteerValueError` (or `HeadsteerTypeError`) with a one-line message
naming the argument and the bad value, and returns the value normalised (a numpy or torch
integer becomes a Python `int`). A `bool` is never accepted as a number (`True` is an `int` in
Python, but `layer=True` is always a mistake).
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from heads.errors import HeadsteerTypeError, HeadsteerValueError

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = [
    "check_bool",
    "check_forwarded",
    "check_int",
    "check_layer_list",
    "check_number",
    "check_shard",
    "int_digits",
    "is_int",
    "is_number",
    "is_real",
    "load_json_body",
    "no_duplicate_keys",
    "parse_json",
    "read_json_file",
    "read_jsonl_file",
    "read_text_file",
    "short_repr",
]

MAX_JSON_INT_DIGITS = 4300
"""Most decimal digits of one integer in JSON a user gives (a request body, a file; Python's own
default limit for `int(str)`, `sys.get_int_max_str_digits()`); a longer one is refused by
`parse_json` with one line, not Python's advice to raise the limit."""


def int_digits(n: int) -> int:
    """How many decimal digits `abs(n)` has (1 for 0), computed from `n.bit_length()`, never
    `str(n)` (which Python refuses over 4300 digits)."""
    m = abs(int(n))
    if m < 10:
        return 1
    d = int((m.bit_length() - 1) * 0.30102999566398120) + 1  # exact or one short
    while d > 1 and m < 10 ** (d - 1):
        d -= 1
    while m >= 10**d:
        d += 1
    return d


def _size_of(value: object) -> str:
    """How `short_repr` names the size of a value it cut: "an int of 5000 digits", "a str of
    1000000 characters", "a list of 1000000 items", "an ndarray of shape (1000, 1000)"."""
    if isinstance(value, int) and not isinstance(value, bool):
        sign = "a negative int" if value < 0 else "an int"
        return f"{sign} of {int_digits(value)} digits"
    name = type(value).__name__
    article = "an" if name[:1].lower() in "aeiou" or name == "ndarray" else "a"
    if isinstance(value, str):
        return f"a str of {len(value)} characters"
    if isinstance(value, (bytes, bytearray)):
        return f"a {name} value of {len(value)} bytes"
    shape: Any = getattr(value, "shape", None)
    if isinstance(shape, tuple) or type(shape).__name__ == "Size":
        return f"{article} {name} of shape {tuple(shape)}"
    try:
        n = len(value)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - no size to name
        return f"{article} {name}"
    return f"{article} {name} of {n} {'key' if isinstance(value, Mapping) else 'item'}{'s' * (n != 1)}"


class _Full(Exception):
    """`_ReprWriter` wrote past its budget."""


class _ReprWriter:
    """`repr(value)` written piece by piece up to `budget` characters (never building the repr of
    a huge value whole); `exact` turns False where it wrote a stand-in (a huge int)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.parts: list[str] = []
        self.size = 0
        self.exact = True
        self.stack: set[int] = set()

    def put(self, text: str) -> None:
        self.parts.append(text)
        self.size += len(text)
        if self.size > self.budget:
            raise _Full

    def write(self, value: object) -> None:
        t = type(value)
        if t is int:
            if int_digits(value) > self.budget:  # type: ignore[arg-type]
                self.exact = False
                self.put(f"<{_size_of(value)}>")
            else:
                self.put(repr(value))
        elif t in (str, bytes, bytearray):
            self.put(repr(value[: self.budget + 2]))  # type: ignore[index]
            if len(value) > self.budget + 2:  # type: ignore[arg-type]
                raise _Full
        elif t in (list, tuple, set, frozenset, dict):
            self.write_container(value)
        else:
            text = repr(value)
            if "\n" in text:  # numpy / torch reprs: one line
                text = " ".join(text.split())
            self.put(text)

    def write_container(self, value: Any) -> None:
        t = type(value)
        if id(value) in self.stack:
            self.put("{...}" if t is dict else "[...]")
            return
        if not value:
            empty: dict[type, str] = {
                list: "[]",
                tuple: "()",
                set: "set()",
                frozenset: "frozenset()",
                dict: "{}",
            }
            self.put(empty[t])
            return
        self.stack.add(id(value))
        try:
            brackets: dict[type, tuple[str, str]] = {
                list: ("[", "]"),
                tuple: ("(", ")"),
                set: ("{", "}"),
                frozenset: ("frozenset({", "})"),
                dict: ("{", "}"),
            }
            opener, closer = brackets[t]
            self.put(opener)
            for i, item in enumerate(value.items() if t is dict else value):
                if i:
                    self.put(", ")
                if t is dict:
                    self.write(item[0])
                    self.put(": ")
                    self.write(item[1])
                else:
                    self.write(item)
            self.put("," + closer if t is tuple and len(value) == 1 else closer)
        finally:
            self.stack.discard(id(value))


def short_repr(value: object, limit: int = 80) -> str:
    """`repr(value)` for a one-line message, cut to `limit` characters.

    A value whose repr fits is given whole (the exact `repr`). A longer one is cut to `limit`
    characters with "..." and its size named, so that a huge value never floods the error line:
    `"'aaaa...' (a str of 1000000 characters)"`, `"[0, 1, 2, ...] (a list of 1000000 items)"`,
    `"an int of 5000 digits"`. The repr is written piece by piece (a 10^6-item list is never
    turned into one string) and an int too large for `str()` (Python's 4300-digit limit) never
    raises: its digits are counted from its bit length.
    """
    limit = max(int(limit), 8)
    if isinstance(value, int) and not isinstance(value, bool) and int_digits(value) > limit:
        return _size_of(value)
    writer = _ReprWriter(limit)
    try:
        writer.write(value)
    except _Full:
        text = "".join(writer.parts)[: limit - 3]
        return f"{text}... ({_size_of(value)})"
    except Exception:  # noqa: BLE001 - a repr that raises must not hide the real error
        return f"<{_size_of(value)}>"
    text = "".join(writer.parts)
    return text if writer.exact else f"{text} ({_size_of(value)})"


def is_int(value: object) -> TypeIs[int]:
    """True for an integer that is not a bool (Python, numpy or torch scalar integers)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int_phrase(lo: int | None, hi: int | None) -> str:
    """How a message names the allowed ints: "a positive int", "an int in 1..12", "an int >= 0"."""
    if lo is not None and hi is not None:
        return f"an int in {lo}..{hi}"
    if lo == 1:
        return "a positive int"
    if lo is not None:
        return f"an int >= {lo}"
    if hi is not None:
        return f"an int <= {hi}"
    return "an int"


def check_int(
    name: str,
    value: object,
    *,
    lo: int | None = None,
    hi: int | None = None,
    what: str | None = None,
    type_error: bool = False,
) -> int:
    """`value` as an `int` in `[lo, hi]` (either bound optional).

    Args:
        name: the argument's name, first word of the message.
        value: the value to check (Python, numpy or torch integer; never a bool).
        lo, hi: inclusive bounds (default None: unbounded).
        what: how the message names the allowed values (default from the bounds:
            `"a positive int"` for `lo=1`, `"an int in 1..12"`, `"an int >= 0"`, `"an int"`).
        type_error: raise `HeadsteerTypeError` (not `HeadsteerValueError`) for a value that is
            not an integer at all (default False); an integer out of range is always a value error.

    Raises:
        HeadsteerValueError: `"<name> must be <what>, got <value>"` for a non-integer (bools
            included; `HeadsteerTypeError` with `type_error`) or a value out of range.
    """
    v = int(value) if is_int(value) else None
    if v is None or (lo is not None and v < lo) or (hi is not None and v > hi):
        error = HeadsteerTypeError if (v is None and type_error) else HeadsteerValueError
        raise error(f"{name} must be {what or _int_phrase(lo, hi)}, got {short_repr(value)}")
    return v


def is_real(value: object) -> bool:
    """True for a real number of any size that is not a bool: the type check of a number
    argument (a `TypeError` otherwise); `is_number` also asks that a float can hold it."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_number(value: object) -> TypeIs[float]:
    """True for a real number that is not a bool (Python, numpy or torch scalars) and that a
    float can hold: an int such as `10**400`, which `float()` refuses (OverflowError), is not
    a number here (NaN and inf are: `check_number` refuses them)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    if isinstance(value, float):
        return True
    try:
        float(value)
    except (OverflowError, ValueError, TypeError):
        return False
    return True


def check_number(
    name: str,
    value: object,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    finite: bool = True,
    what: str | None = None,
) -> float:
    """`value` as a `float` in `[lo, hi]` (`(lo, ...` with `lo_open`, `..., hi)` with `hi_open`),
    finite unless `finite=False`.

    Args:
        what: how the message names the allowed values (default from the bounds:
            `"a number in [0, 1]"`, `"a number > 0"`, `"a finite number"`, ...).

    Raises:
        HeadsteerValueError: `"<name> must be <what>, got <value>"` for a non-number (bools
            included), NaN / inf (with `finite`), or a value out of range.
    """
    if what is None:
        if lo is not None and hi is not None:
            what = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        elif lo is not None:
            what = f"a {'finite ' if finite else ''}number {'>' if lo_open else '>='} {lo:g}"
        elif hi is not None:
            what = f"a {'finite ' if finite else ''}number {'<' if hi_open else '<='} {hi:g}"
        else:
            what = "a finite number" if finite else "a number"
    bad = not is_number(value)
    if not bad:
        v = float(value)  # type: ignore[arg-type]
        bad = (
            (finite and not math.isfinite(v))
            or math.isnan(v)
            or (lo is not None and (v < lo or (lo_open and v == lo)))
            or (hi is not None and (v > hi or (hi_open and v == hi)))
        )
    if bad:
        raise HeadsteerValueError(f"{name} must be {what}, got {short_repr(value)}")
    return float(value)  # type: ignore[arg-type]


def check_bool(name: str, value: object, *, what: str = "True or False") -> bool:
    """`value` if it is a Python `bool`.

    Raises:
        HeadsteerTypeError: `"<name> must be <what>, got <value>"` for anything else (`0`, `1`,
            `"yes"`, None).
    """
    if not isinstance(value, bool):
        raise HeadsteerTypeError(f"{name} must be {what}, got {short_repr(value)}")
    return value


def check_layer_list(name: str, value: object) -> None:
    """Refuse anything but a non-empty list, tuple or range of ints (layer indices) for `name`.

    Raises:
        HeadsteerValueError: `"<name> must be a non-empty list of layer indices, got ..."` for a
            string, another type or an empty list; `"<name> must be ints, got ..."` for a non-int
            entry (bools included).
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, range)) or not value:
        raise HeadsteerValueError(
            f"{name} must be a non-empty list of layer indices, got {short_repr(value)}"
        )
    if any(not is_int(x) for x in value):
        raise HeadsteerValueError(f"{name} must be ints, got {short_repr(value)}")


def check_forwarded(where: str, kwargs: Mapping[str, object], target: Callable) -> None:
    """Refuse, before any work, a keyword in `kwargs` that `target` (which `where` forwards them
    to) does not take, or one of its positional parameters.

    Raises:
        HeadsteerTypeError: `"<where>() got an unexpected keyword argument '<name>'"`.
    """
    params = inspect.signature(target).parameters
    taken = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    unknown = sorted(set(kwargs) - taken)
    if unknown:
        raise HeadsteerTypeError(f"{where}() got an unexpected keyword argument {short_repr(unknown[0])}")


def check_shard(shard: object) -> tuple[int, int] | None:
    """`shard` as `(i, n)` with `0 <= i < n`, or None.

    Raises:
        HeadsteerValueError: anything else.
    """
    if shard is None:
        return None
    if (
        isinstance(shard, (str, bytes))
        or not isinstance(shard, Sequence)
        or len(shard) != 2
        or not all(is_int(x) for x in shard)
    ):
        raise HeadsteerValueError(f"shard must be a pair (i, n) of ints, got {short_repr(shard)}")
    i, n = int(shard[0]), int(shard[1])
    if not 0 <= i < n:
        raise HeadsteerValueError(f"shard must be (i, n) with 0 <= i < n, got {short_repr(shard)}")
    return i, n


# ---------------------------------------------------------------- added for the head-role scorers
__all__ += ["MAX_SEED", "check_path", "check_seed"]

MAX_SEED = 2**32 - 1
"""The largest seed `check_seed` accepts (the range every `torch.Generator` seed here is drawn from)."""


def check_seed(name: str, value: object) -> int:
    """`value` as an `int` seed in `0..MAX_SEED` (Python, numpy or torch integer; never a bool).

    Raises:
        HeadsteerValueError: `"<name> must be an int in 0..4294967295, got <value>"` otherwise
            (negative seeds included, so that every seeded function accepts the same seeds).
    """
    return check_int(name, value, lo=0, hi=MAX_SEED)


def check_path(name: str, value: object) -> str:
    """`value` as a non-empty path string (a `str` or an `os.PathLike` of one).

    Raises:
        HeadsteerTypeError: `"<name> must be a file path (str or os.PathLike), got <value>"` for
            anything else (None, bytes, a number) or an empty string.
    """

    p = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(p, str) or not p.strip():
        raise HeadsteerTypeError(f"{name} must be a file path (str or os.PathLike), got {short_repr(value)}")
    return p


class _NumberTooLarge(ValueError):
    """An integer of more than `MAX_JSON_INT_DIGITS` digits (its digit count in `digits`)."""

    def __init__(self, digits: int) -> None:
        super().__init__(digits)
        self.digits = digits


def _json_int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_JSON_INT_DIGITS:
        raise _NumberTooLarge(digits)
    return int(text)


def parse_json(
    text: bytes | str,
    where: str,
    *,
    line: int | None = None,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """The JSON value of `text`, every failure one line naming `where`.

    The one JSON parser for what a user gives headsteer: request bodies (`load_json_body`),
    JSON files (`read_json_file`: head files, saved results, atlases, model configs) and JSONL
    lines (`read_jsonl_file`: pairs / task files, prompt files).

    Args:
        text: the JSON text (UTF-8 bytes or str).
        where: what the text is, as the messages name it (`"the request body"`, `"'h.json'"`,
            `"'pairs.jsonl' line 3"`).
        line: the text is line `line` of a JSONL file (default None: a whole document); the
            position of a syntax error is then given as a column only.
        object_pairs_hook: as `json.loads` (default None: plain dicts); a `ValueError` it raises
            (e.g. a duplicate key) becomes `"<where> is not valid JSON: <its message>"`.

    Raises:
        HeadsteerValueError: one line, never Python's advice to call
            `sys.set_int_max_str_digits()`:
            `"a number in <where> is too large: an integer of N digits, more than the limit of
            4300"` (`MAX_JSON_INT_DIGITS`: Python's own `int(str)` limit);
            `"<where> is not valid JSON: <reason> (line L, column C)"` (`(column C)` with `line`);
            `"<where> is not valid JSON: nested too deeply to parse"`;
            `"<where> is not valid JSON: not valid UTF-8 text"`.
    """
    import json

    try:
        return json.loads(text, parse_int=_json_int, object_pairs_hook=object_pairs_hook)
    except _NumberTooLarge as exc:
        raise HeadsteerValueError(
            f"a number in {where} is too large: an integer of {exc.digits} digits, "
            f"more than the limit of {MAX_JSON_INT_DIGITS}"
        ) from None
    except RecursionError:
        raise HeadsteerValueError(f"{where} is not valid JSON: nested too deeply to parse") from None
    except UnicodeDecodeError:
        raise HeadsteerValueError(f"{where} is not valid JSON: not valid UTF-8 text") from None
    except json.JSONDecodeError as exc:
        at = f"column {exc.colno}" if line is not None else f"line {exc.lineno}, column {exc.colno}"
        raise HeadsteerValueError(f"{where} is not valid JSON: {exc.msg} ({at})") from None
    except ValueError as exc:  # the hook's own check (a duplicate key), one line of it
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise HeadsteerValueError(f"{where} is not valid JSON: {first}") from None


def read_json_file(
    path: str | os.PathLike,
    *,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """The JSON value of the file at `path` (read whole), parsed by `parse_json`.

    Args:
        path: the file (the caller has checked it exists and is a file).
        object_pairs_hook: as `parse_json` (default None).

    Raises:
        HeadsteerValueError: as `parse_json`, `where` the path's repr (`"'h.json' is not valid
            JSON: Expecting value (line 1, column 5)"`).
        OSError: the file cannot be read (FileNotFoundError for a missing one).
    """
    from heads._util.files import short_path

    with open(path, "rb") as f:
        raw = f.read()
    return parse_json(raw, short_path(os.fspath(path), 200), object_pairs_hook=object_pairs_hook)


def read_text_file(path: str | os.PathLike) -> str:
    """The text of the UTF-8 file at `path` (read whole).

    Raises:
        HeadsteerValueError: the file is not UTF-8 text, one line naming it and the first bad
            byte (`"'p.txt' is not valid UTF-8 text: byte 0xff at offset 0"`).
        OSError: the file cannot be read (FileNotFoundError for a missing one).
    """
    from heads._util.files import short_path

    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeadsteerValueError(
            f"{short_path(os.fspath(path), 200)} is not valid UTF-8 text: "
            f"byte 0x{raw[exc.start]:02x} at offset {exc.start}"
        ) from None


def read_jsonl_file(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """`(line number, JSON value)` of each non-blank line of the JSONL file at `path`, read line
    by line (never whole), numbered from 1.

    Raises:
        HeadsteerValueError: as `parse_json`, `where` `"'<path>' line N"` (`"'p.jsonl' line 3 is
            not valid JSON: Expecting value (column 1)"`, `"a number in 'p.jsonl' line 3 is too
            large: ..."`, `"'p.jsonl' line 2 is not valid JSON: not valid UTF-8 text"`).
        OSError: the file cannot be opened (FileNotFoundError for a missing one).
    """
    from heads._util.files import short_path

    shown = short_path(os.fspath(path), 200)
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield n, parse_json(raw, f"{shown} line {n}", line=n)


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """`json` `object_pairs_hook`: a key given twice in one object is an error, not "the last
    one wins" (request files, result files, HTTP request bodies).

    Raises:
        ValueError: `"duplicate key 'k'"`.
    """
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise HeadsteerValueError(f"duplicate key {short_repr(key)}")
        out[key] = value
    return out


def load_json_body(raw: bytes | str) -> object:
    """The JSON value of an HTTP request body (`headsteer serve`, `headsteer explore`).

    Args:
        raw: the body (UTF-8 bytes or text; empty: None).

    Returns:
        the parsed value (any JSON type; the caller checks it is an object).

    Raises:
        ValueError: one line (`parse_json`, `where` "the request body"): an integer of more
            than `MAX_JSON_INT_DIGITS` digits ("a number in the request body is too large ...";
            Python's `int` refuses to convert it), a nesting too deep to parse, or any other
            invalid JSON / UTF-8 ("the request body is not valid JSON: <reason> (line L,
            column C)"), or a key given twice in one object ("... duplicate key 'layer'").
    """
    if not raw:
        return None
    return parse_json(raw, "the request body", object_pairs_hook=no_duplicate_keys)
