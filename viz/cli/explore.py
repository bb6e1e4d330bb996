"""`headsteer explore`: the interactive head explorer (`viz.explorer`) on a local port."""

import ipaddress
import json
import socket
import sys
from typing import Annotated

import typer

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from viz.cli.common import Run

__all__ = ["check_listen", "explore_command"]


def check_listen(host: str, port: int) -> None:
    """Refuse, before the model loads, a `host` that does not resolve or a `port` that cannot be
    bound there (in use, no permission): a socket is bound and closed again (SO_REUSEADDR, as
    uvicorn does, so a port in TIME_WAIT is not refused).

    Raises:
        ValueError: naming `--host` or `--port` and the reason.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise HeadsteerValueError(f"--host {short_repr(host)} does not resolve: {exc}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            raise HeadsteerValueError(
                f"--port {port} cannot be bound on {host}: {exc.strerror or exc}"
            ) from None


def explore_command(
    run: Run,
    host: Annotated[str, typer.Option(help="address to listen on (non-loopback: warning)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8765,
    atlas: Annotated[
        str | None,
        typer.Option(
            help="a saved head atlas (HeadAtlas.save) to colour the grid by; default: computed on demand"
        ),
    ] = None,
) -> None:
    """Open the interactive head explorer in the browser at http://HOST:PORT/ (Ctrl-C to stop).

    Binding to a non-loopback host prints a warning: the explorer has no authentication."""
    if not 0 <= port <= 65535:
        raise HeadsteerValueError(f"--port must be in 0..65535, got {port}")
    try:
        loop = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loop = False
    if not loop:
        print(
            f"warning: --host {host} is not a loopback address: anyone who can reach it can use the "
            "explorer (it has no authentication)",
            file=sys.stderr,
        )
    try:
        import uvicorn
    except ImportError:
        raise HeadsteerValueError(
            "headsteer explore needs the extra: pip install 'headsteer[serve]'"
        ) from None
    check_listen(host, port)
    head_atlas = None
    if atlas is not None:
        from heads.scorers.roles.atlas import HeadAtlas

        head_atlas = HeadAtlas.load(atlas)  # read before the model is loaded: a bad file fails fast
    hm = run.load()
    from viz.explorer.app import create_explorer

    if head_atlas is not None and head_atlas.model != hm.name:
        raise HeadsteerValueError(
            f"--atlas {atlas} is of model {short_repr(head_atlas.model)}, not {short_repr(hm.name)}"
        )
    app = create_explorer(hm, atlas=head_atlas)
    url = f"http://{host}:{port}/"
    if run.as_json:
        print(json.dumps({"url": url, "model": hm.name}), flush=True)
    run.say(f"explorer for {hm.name} on {url} (Ctrl-C to stop)")
    uvicorn.run(app, host=host, port=port, log_level="warning")
