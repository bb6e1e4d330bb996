"""`headsteer serve`'s default limits (shared by the command and the app factory)."""

__all__ = ["MAX_BODY_BYTES"]

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Default largest request body (`--max-body-mb`, default 4 MiB); larger bodies get HTTP 413
before they are read (a `Content-Length` above it is refused at once, a chunked body as soon as
it passes the limit)."""
