"""`headsteer serve`: the command that loads a model and serves it (`viz.server.app.create_app`)."""

import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from viz.cli.common import Run
from viz.server.access_log import log
from viz.server.cli_limits import MAX_BODY_BYTES

__all__ = ["API_KEY_ENV", "MAX_BODY_BYTES", "check_api_key", "check_loopback", "serve_command"]

API_KEY_ENV = "HEADSTEER_API_KEY"
"""The environment variable `--api-key` is read from when not given (keeps it out of `ps`)."""


def check_loopback(host: str) -> str:
    """Return `host` if every address it resolves to is a loopback address (`localhost`,
    `LOCALHOST.`, 127.0.0.0/8, `127.1`, ::1, a name the hosts file maps to 127.0.1.1, ...).

    Raises:
        HeadsteerValueError: any other address (the server has no authentication without
            `--api-key`), or a host that does not resolve.
    """
    from viz.cli.listen import resolves_to_loopback

    if not resolves_to_loopback(host):
        raise HeadsteerValueError(
            f"--host {short_repr(host)} is not a loopback address: headsteer serve listens on 127.0.0.1 "
            f"/ ::1 only, unless --api-key (or {API_KEY_ENV}) sets the key every request must send"
        )
    return host


def check_api_key(key: str | None) -> str | None:
    """`key` (None: none), or HeadsteerValueError for an empty key, one with white space or
    control characters, or one longer than 512 characters."""
    if key is None:
        return None
    if not key or len(key) > 512 or any(c.isspace() or not c.isprintable() for c in key):
        raise HeadsteerValueError(
            f"--api-key must be 1-512 printable characters without white space (got {len(key)} characters)"
        )
    return key


def serve_command(
    run: Run,
    host: Annotated[
        str, typer.Option(help="address to listen on: loopback, or any with --api-key")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    max_batch: Annotated[int, typer.Option(help="most requests decoded together")] = 32,
    batch_wait_ms: Annotated[float, typer.Option(help="wait for more requests after the first (ms)")] = 20.0,
    device_map: Annotated[
        str | None, typer.Option(help='"auto": spread the layers over the GPUs (then CPU) with accelerate')
    ] = None,
    max_body_mb: Annotated[
        float, typer.Option(help="largest request body in MiB; larger ones get HTTP 413 (default 4)")
    ] = MAX_BODY_BYTES / 2**20,
    max_prompt_tokens: Annotated[
        int, typer.Option(help="longest prompt in tokens; 0 = the model's positions (default)")
    ] = 0,
    caa_vector: Annotated[
        Path | None,
        typer.Option(
            "--caa-vector",
            help="safetensors file of named CAA vectors (steer.save_caa_vectors); requests name them: "
            '{"method": "caa", "vector": NAME}',
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar=API_KEY_ENV,
            show_envvar=True,
            help="every request must send 'Authorization: Bearer KEY' (HTTP 401 otherwise); needed to "
            "listen on a non-loopback address",
        ),
    ] = None,
) -> None:
    """Serve steered generation over an OpenAI-compatible HTTP API (Ctrl-C / SIGTERM to stop).

    With --json, one JSON line on stdout once the model is loaded: {"url", "model"} (for
    scripts that start the server and wait for it). Each request is logged as one line on
    stderr (client, method and path, status, tokens, time). Bodies over --max-body-mb get
    HTTP 413; a client that disconnects has its request cancelled. --caa-vector loads named
    CAA vectors at start (checked before the model loads, and against it once loaded).
    On a loopback address a request whose Host is not this server's is HTTP 403, and a POST
    body that is not application/json is HTTP 415 (no other web site can use the server)."""
    from viz.cli.listen import resolves_to_loopback

    check_api_key(api_key)
    if api_key is None:
        check_loopback(host)
    if not 0 <= port <= 65535:
        raise HeadsteerValueError(f"--port must be in 0..65535, got {port}")
    if max_batch < 1 or not 0 <= batch_wait_ms <= 10_000:
        raise HeadsteerValueError(
            f"--max-batch must be >= 1 and --batch-wait-ms in [0, 10000], got {max_batch}, {batch_wait_ms}"
        )
    if not 0 < max_body_mb <= 4096:
        raise HeadsteerValueError(f"--max-body-mb must be in (0, 4096], got {max_body_mb}")
    if max_prompt_tokens < 0:
        raise HeadsteerValueError(f"--max-prompt-tokens must be >= 0 (0 = no limit), got {max_prompt_tokens}")
    try:
        import uvicorn  # noqa: F401 - the extra, checked before anything binds or loads
    except ImportError:
        raise HeadsteerValueError("headsteer serve needs the extra: pip install 'headsteer[serve]'") from None
    if device_map not in (None, "auto"):
        raise HeadsteerValueError(f"--device-map must be 'auto', got {short_repr(device_map)}")
    if device_map is not None and run.device != "cpu":
        raise HeadsteerValueError(
            f"--device {run.device} and --device-map {device_map} conflict: the device map places the "
            "layers; drop --device"
        )
    if api_key is not None and not resolves_to_loopback(host):
        print(
            f"warning: --host {host} is not a loopback address: the API key and the prompts travel as "
            "plain HTTP; put a TLS proxy in front of it for any network you do not trust",
            file=sys.stderr,
        )
    from viz.cli.listen import bind_report, listen_socket, run_uvicorn, url_of

    sock = listen_socket(host, port)  # bound and held before the slow load: a busy port fails now
    try:
        caa_vectors = None
        if caa_vector is not None:
            from steer.caa import load_caa_vectors

            caa_vectors = load_caa_vectors(caa_vector)  # a bad file fails here, before the model loads
        hosts = bind_report(run, sock, host, "server", "/v1")  # the URL now, before the slow load
        hm = run.load(device_map=device_map)
        from viz.server.factory import create_app

        app = create_app(
            hm,
            max_batch=max_batch,
            wait_s=batch_wait_ms / 1000,
            max_body_bytes=int(max_body_mb * 2**20),
            max_prompt_tokens=max_prompt_tokens or None,
            caa_vectors=caa_vectors,
            hosts=hosts,
            api_key=api_key,
        )
    except BaseException:
        sock.close()
        raise
    if not log.handlers:  # one line per request on stderr (after --json's line on stdout)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%dT%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    url = f"{url_of(sock)}/v1"  # the real port with --port 0; an IPv6 host in brackets
    if run.as_json:
        print(json.dumps({"url": url, "model": hm.name}), flush=True)
    run.say(f"serving {hm.name} on {url} (Ctrl-C or SIGTERM to stop)")
    run_uvicorn(app, sock, say=run.say, timeout_graceful_shutdown=600)
