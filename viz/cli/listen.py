"""The listening socket of `headsteer serve` and `headsteer explore`, bound before the model loads.

The socket is bound and put in listening state first (a port in use, or one the user may not
bind, is a one-line error, exit 2, before the slow model load), held while the model loads
(no other process can take the port in between), and handed to uvicorn as is
(`uvicorn.Server.run(sockets=[sock])`). With `--port 0` the system picks a free port; `url_of`
gives the address actually bound (an IPv6 host in brackets: `http://[::1]:8000`).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from typing import Any

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError

__all__ = [
    "bind_report",
    "bound_to_loopback",
    "host_port",
    "listen_socket",
    "resolves_to_loopback",
    "run_uvicorn",
    "url_of",
]

BACKLOG = 2048
"""Pending connections the socket queues (uvicorn's own default backlog)."""


def host_port(host: str, port: int) -> str:
    """`host:port` as a URL writes it: an IPv6 address in brackets (`[::1]:8000`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolvable(host: str) -> str:
    """`host` as it is looked up: a name under `localhost` in any case, with or without a trailing
    dot (`LOCALHOST.`, `app.localhost`) is the system's `localhost`, as RFC 6761 reserves it for
    loopback (a resolver without DNS may not know `localhost.`); any other host as given."""
    name = host.strip().rstrip(".").lower()
    return "localhost" if name == "localhost" or name.endswith(".localhost") else host


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `(host, port)` and listening (port 0: a free port the system picks).

    SO_REUSEADDR is set, as uvicorn does, so a port left in TIME_WAIT by a stopped server is
    not refused; a port another socket listens on is.

    Raises:
        HeadsteerValueError: one line naming `--port` / `--host`: a port outside 0..65535, a host
            that does not resolve, or a bind that fails (`"--port 8000 cannot be bound on
            127.0.0.1:8000: Address already in use"`).
    """
    if not 0 <= port <= 65535:
        raise HeadsteerValueError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(resolvable(host), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise HeadsteerValueError(f"--host {short_repr(host)} does not resolve: {exc}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise HeadsteerValueError(
            f"--port {port} cannot be bound on {host_port(str(addr[0]), port)}: {exc.strerror or exc}"
        ) from None
    sock.set_inheritable(True)
    return sock


def resolves_to_loopback(host: str) -> bool:
    """True when every address `host` resolves to is a loopback address (`localhost`,
    `LOCALHOST.`, `127.1`, `::1`, a name the hosts file maps to 127.0.1.1, ...): decided by the
    resolved addresses, never by the spelling. False for a host that does not resolve."""
    from viz.web.guard import is_loopback_address

    try:
        infos = socket.getaddrinfo(resolvable(host), None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(is_loopback_address(str(info[4][0])) for info in infos)


def bound_to_loopback(sock: socket.socket) -> bool:
    """True when `sock` is bound to a loopback address (127.0.0.0/8, ::1)."""
    from viz.web.guard import is_loopback_address

    return is_loopback_address(str(sock.getsockname()[0]))


def bind_report(
    run: Any, sock: socket.socket, host: str, what: str, path: str = "/"
) -> tuple[str, ...] | None:
    """Say where the server listens as soon as `sock` is bound (`--port 0` included), before the
    model loads, and return the `Host` names it accepts: on a loopback bind
    `viz.web.guard.loopback_hosts(host, bound address)` (the Host check stays on however
    `--host` spells the loopback name), else None (no Host check)."""
    from viz.web.guard import loopback_hosts

    run.say(f"{what} listening on {url_of(sock)}{path}; loading the model first (Ctrl-C to stop)")
    if not bound_to_loopback(sock):
        return None
    return loopback_hosts(host, str(sock.getsockname()[0]))


def url_of(sock: socket.socket) -> str:
    """`http://HOST:PORT` of the address `sock` is bound to (the real port after `--port 0`;
    an IPv6 host in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://{host_port(str(host), int(port))}"


def run_uvicorn(
    app: Any,
    sock: socket.socket,
    *,
    say: Callable[[str], None] | None = None,
    on_stop: Callable[[], None] | None = None,
    **config: Any,
) -> None:
    """Serve `app` on the listening `sock` with uvicorn until Ctrl-C / SIGTERM; then print
    "server stopped" (with `say`, default a line on stderr) and close the socket.

    Args:
        on_stop: called once the server starts to stop (after Ctrl-C / SIGTERM, before it waits
            for the open connections to close), in the server's event loop: `headsteer explore`
            cancels its jobs there, so their streams end at once instead of running to the end.
        config: more `uvicorn.Config` options (default `log_level="warning"`).

    Raises:
        SystemExit: 3 when uvicorn failed to start the app (as `uvicorn.run` does).
    """
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            if on_stop is not None:
                on_stop()
            await super().shutdown(sockets=sockets)

    config.setdefault("log_level", "warning")
    server = Server(uvicorn.Config(app, **config))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C: uvicorn re-raises the SIGINT it caught, once shut down
        pass
    finally:
        sock.close()
    if not server.started:
        raise SystemExit(3)
    (say or (lambda msg: print(msg, file=sys.stderr)))("server stopped")
