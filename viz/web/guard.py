"""The cross-site guard of `headsteer explore` and `headsteer serve`: an ASGI middleware.

A web page of another site can still reach a server on the user's own machine: it can send a
`POST` whose body is `text/plain` without asking first (no CORS preflight), and a page of a
domain the attacker controls can re-point that domain at 127.0.0.1 (DNS rebinding) and read
the answers under its own name. `CrossSiteGuard` refuses, in this order:

1. a `Host` header that names neither one of `hosts` nor a loopback IP literal: HTTP 403
   (on a loopback bind; `hosts=None` turns the check off, for a non-loopback bind);
2. a request without `Authorization: Bearer <api_key>` when an API key is set: HTTP 401;
3. a `POST` / `PUT` / `PATCH` whose `Content-Type` is not `application/json`: HTTP 415 (a
   cross-site page can only send JSON after a preflight, which these servers never answer).

Host names are compared case-insensitively, without a trailing dot and without the port
(`LOCALHOST.:8765` is `localhost`), an IPv6 address without its brackets.
"""

import ipaddress
import secrets
from collections.abc import Callable, Collection, Iterable
from typing import Any

from heads._util.validation import short_repr

__all__ = ["LOOPBACK_HOSTS", "CrossSiteGuard", "host_name", "is_loopback_address", "loopback_hosts"]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""The `Host` names a server on a loopback address always accepts (with the `--host` given and
the address bound)."""

Render = Callable[[int, str, str], Any]
"""`render(status, message, code)` -> the ASGI response of a refusal (each server's error format)."""


def host_name(value: str) -> str:
    """The host of a `Host` header or a `--host` value, as compared: lower case, without the
    port, the brackets of an IPv6 address or a trailing dot (`"[::1]:8000"` -> `"::1"`,
    `"LOCALHOST.:80"` -> `"localhost"`)."""
    name = value.strip().lower()
    if name.startswith("["):
        name = name[1 : name.index("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    return name.rstrip(".")


def is_loopback_address(address: str) -> bool:
    """True for an IP address literal in 127.0.0.0/8 or ::1 (an IPv6 zone `%...` ignored); False
    for a name or anything else."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def loopback_hosts(*names: str) -> tuple[str, ...]:
    """`LOOPBACK_HOSTS` plus `names` (the `--host` given, the address bound), normalised by
    `host_name`, without repeats."""
    out: list[str] = []
    for n in (*LOOPBACK_HOSTS, *names):
        h = host_name(n)
        if h and h not in out:
            out.append(h)
    return tuple(out)


class CrossSiteGuard:
    """ASGI middleware refusing cross-site requests (see the module docstring).

    Args:
        app: the ASGI app to guard.
        hosts: the `Host` names accepted (normalised with `host_name`); a loopback IP literal is
            always accepted; None (default): any `Host`.
        api_key: the key every request must send as `Authorization: Bearer <key>` (default
            None: none needed). Compared in constant time.
        render: builds the refusal response from `(status, message, code)`.
    """

    def __init__(
        self,
        app: Any,
        *,
        hosts: Collection[str] | None = None,
        api_key: str | None = None,
        render: Render,
    ):
        self.app = app
        self.hosts = None if hosts is None else frozenset(host_name(h) for h in hosts)
        self.api_key = api_key
        self.render = render

    def refusal(self, method: str, headers: Iterable[tuple[bytes, bytes]]) -> tuple[int, str, str] | None:
        """`(status, message, code)` of the refusal of a request, or None to let it through."""
        h = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
        if self.hosts is not None:
            name = host_name(h.get("host", ""))
            if name not in self.hosts and not is_loopback_address(name):
                return (
                    403,
                    f"Host {short_repr(name)} is not this server's: open it at its own address",
                    "forbidden_host",
                )
        if self.api_key is not None:
            scheme, _, given = h.get("authorization", "").partition(" ")
            ok = scheme.lower() == "bearer" and secrets.compare_digest(
                given.strip().encode("utf-8", "replace"), self.api_key.encode("utf-8")
            )
            if not ok:
                return 401, "missing or wrong API key: send Authorization: Bearer <key>", "invalid_api_key"
        if method in ("POST", "PUT", "PATCH"):
            kind = h.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return (
                    415,
                    f"a request body must be application/json, got {short_repr(kind or None)}",
                    "unsupported_media_type",
                )
        return None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refused = self.refusal(scope["method"], scope.get("headers", ()))
            if refused is not None:
                await self.render(*refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)
