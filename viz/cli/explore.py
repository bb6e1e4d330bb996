"""`headsteer explore`: the interactive head explorer (`viz.explorer`) on a local port."""

import json
import sys
from typing import Annotated

import typer

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from viz.cli.common import Run
from viz.cli.listen import bind_report, bound_to_loopback, listen_socket, run_uvicorn, url_of

__all__ = ["explore_command"]


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
        import uvicorn  # noqa: F401 - the extra, checked before anything binds or loads
    except ImportError:
        raise HeadsteerValueError(
            "headsteer explore needs the extra: pip install 'headsteer[serve]'"
        ) from None
    sock = listen_socket(host, port)  # bound and held before the slow load: a busy port fails now
    try:
        # decided by the address bound, not by how --host spells it (LOCALHOST, localhost., 127.1)
        if not bound_to_loopback(sock):
            print(
                f"warning: --host {host} is not a loopback address: anyone who can reach it can use the "
                "explorer (it has no authentication)",
                file=sys.stderr,
            )
        head_atlas = None
        if atlas is not None:
            from heads.scorers.roles.atlas import HeadAtlas

            head_atlas = HeadAtlas.load(atlas)  # read before the model is loaded: a bad file fails fast
        hosts = bind_report(run, sock, host, "explorer")  # the URL now, before the slow load
        hm = run.load()
        from viz.explorer.app import create_explorer

        if head_atlas is not None and head_atlas.model != hm.name:
            raise HeadsteerValueError(
                f"--atlas {atlas} is of model {short_repr(head_atlas.model)}, not {short_repr(hm.name)}"
            )
        app = create_explorer(hm, atlas=head_atlas, hosts=hosts)  # loopback: refuse other Host names
    except BaseException:
        sock.close()
        raise
    url = f"{url_of(sock)}/"  # the real port with --port 0; an IPv6 host in brackets
    if run.as_json:
        print(json.dumps({"url": url, "model": hm.name}), flush=True)
    run.say(f"explorer for {hm.name} on {url} (Ctrl-C to stop)")
    # Ctrl-C / SIGTERM: every job is cancelled as Cancel does, so the server is gone at once
    run_uvicorn(app, sock, say=run.say, on_stop=app.state.jobs.stop_all)
