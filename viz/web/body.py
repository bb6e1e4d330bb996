"""Request bodies: read within a byte limit, parsed as one JSON object, checked by a pydantic model.

Every `POST` of the explorer and the server goes through `read_body` (HTTP 413 past the limit:
from `Content-Length` before reading, or as soon as a chunked body passes it; a client gone
mid-body is starlette's `ClientDisconnect`, answered 499), `json_object` (one line: invalid JSON,
an integer too large for Python, nesting too deep, not an object) and `validated` (the request
model's first error as one line naming the field; unknown fields named first, all of them).
"""

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from heads._util.validation import load_json_body, short_repr
from heads.errors import HeadsteerValueError

__all__ = ["BodyTooLarge", "json_object", "one_line", "read_body", "validated"]

M = TypeVar("M", bound=BaseModel)


class BodyTooLarge(Exception):
    """A request body over the limit (HTTP 413)."""


def one_line(exc: BaseException, limit: int = 500) -> str:
    """`exc` as one line of at most `limit` characters (its type when it has no message)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:limit]


async def read_body(request: Any, limit: int, *, what: str = "request body") -> bytes:
    """The body of `request` (a starlette `Request`), refused as soon as it is known to pass
    `limit` bytes.

    Raises:
        BodyTooLarge: a declared `Content-Length` above `limit` (before a byte is read), or a
            body that passes it while it streams in.
        starlette.requests.ClientDisconnect: the client left before the body arrived.
    """
    declared = request.headers.get("content-length")
    d = "" if declared is None else declared.strip()
    if d.isascii() and d.isdigit() and (len(d) > 18 or int(d) > limit):  # 18 digits: no int() limit
        shown = d if len(d) <= 18 else f"{d[:12]}... ({len(d)} digits)"
        raise BodyTooLarge(f"{what} of {shown} bytes is larger than the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"{what} is larger than the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def json_object(raw: bytes, *, not_object: str = "request body must be a JSON object") -> dict:
    """`raw` parsed as a JSON object (`heads._util.validation.load_json_body`).

    Raises:
        HeadsteerValueError: one line: invalid JSON or UTF-8, an integer too large for Python,
            nesting too deep, or a value that is not an object (`not_object`).
    """
    body = load_json_body(raw)
    if not isinstance(body, dict):
        raise HeadsteerValueError(not_object)
    return body


def validated(
    cls: type[M], body: Mapping[str, Any], context: Mapping[str, Any] | None = None, *, known: bool = True
) -> M:
    """`cls.model_validate(body, context=context)`, its failure one line.

    With `known` (default), fields `cls` does not have are named first, all of them ("unknown
    field(s) ['bogus']: this endpoint takes [...]": a typo must never silently run a default);
    then the first failing check in the model's order, with the message its validator raised.

    Raises:
        HeadsteerValueError: as above.
        HeadsteerTypeError: a validator's type error (raised as is).
    """
    unknown = sorted(str(k) for k in body if k not in cls.model_fields) if known else []
    if unknown:
        raise HeadsteerValueError(
            f"unknown field(s) {short_repr(unknown)}: this endpoint takes {sorted(cls.model_fields)}"
        )
    try:
        return cls.model_validate(dict(body), context=dict(context or {}))
    except ValidationError as exc:
        raise HeadsteerValueError(first_error(exc)) from None


def first_error(exc: ValidationError) -> str:
    """The first error of a pydantic `ValidationError` as one line: a validator's own message
    as it raised it, else `"<field>: <pydantic's message>"`."""
    err = exc.errors(include_url=False)[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, BaseException):
        return one_line(cause)
    where = ".".join(str(p) for p in err.get("loc", ())) or "request body"
    return one_line(ValueError(f"{where}: {err.get('msg', 'invalid value')}"))
