"""Writing the user's files safely: never overwrite without asking, never follow a symlink, atomic.

Every file headsteer writes (head profiles, scores, reports, CSV tables) goes through
`write_text` / `write_bytes` here:

* an existing file is refused unless `overwrite=True` (the CLI's `--force`);
* a symlink at the output path is always refused (it could point anywhere);
* the data goes to a temporary file in the same folder, is flushed to disk, and is
  renamed over the target, so an interrupted write never leaves a partial file;
* missing parent folders are created.

`check_output(path, overwrite)` runs the same checks without writing, so a command can
refuse a bad output path before any expensive work.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

from heads.errors import HeadsteerValueError

__all__ = [
    "check_output",
    "check_writable",
    "current_umask",
    "is_file",
    "short_path",
    "write_bytes",
    "write_text",
]


def is_file(path: str | os.PathLike) -> bool:
    """`Path(path).is_file()` that answers False instead of raising for a name the file system
    cannot hold (too long, a NUL byte)."""
    try:
        return Path(path).expanduser().is_file()
    except (OSError, ValueError):
        return False


def short_path(path: str | os.PathLike, limit: int = 80) -> str:
    """`repr` of `str(path)` cut to about `limit` characters, for one-line messages."""
    text = str(path)
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def check_output(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Check that `path` may be written; returns it as a `Path`.

    Raises:
        ValueError: `path` is a symlink (always refused), a folder, an existing file while
            `overwrite` is False, or in a folder where no file can be created (tested by
            creating and removing a temporary file). The message names the path.
    """
    p = Path(path).expanduser()
    if p.is_symlink():
        raise HeadsteerValueError(f"refusing to write through a symlink: {p}")
    if p.is_dir():
        raise HeadsteerValueError(f"output path is a folder, not a file: {p}")
    if p.exists() and not overwrite:
        raise HeadsteerValueError(f"{p} exists; pass --force (API: overwrite=True) to replace it")
    check_writable(p.parent)
    return p


def check_writable(folder: str | os.PathLike) -> Path:
    """Check that files can be created in `folder` (or, if it does not exist yet, in its
    nearest existing ancestor, where it will be made) by creating and removing a temporary
    file there: permission bits do not tell (root, read-only file systems, full quotas).

    Raises:
        ValueError: the folder cannot be written, naming it and the system's reason.
    """
    target = Path(folder).expanduser()
    probe = target
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise HeadsteerValueError(f"cannot write into {target}: {probe} is not a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".headsteer-write-test-", dir=probe)
    except OSError as exc:
        raise HeadsteerValueError(f"cannot write into {target}: {exc.strerror or exc} ({probe})") from None
    os.close(fd)
    os.unlink(tmp)
    return target


def write_bytes(path: str | os.PathLike, data: bytes, overwrite: bool = False) -> Path:
    """Write `data` to `path` atomically (temporary file in the same folder, then rename).

    Creates missing parent folders. Returns the path written.

    Raises:
        ValueError: see `check_output`.
    """
    p = check_output(path, overwrite)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        check_output(p, overwrite)  # re-check: a symlink may have appeared meanwhile
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def write_text(path: str | os.PathLike, text: str, overwrite: bool = False) -> Path:
    """Write `text` (UTF-8) to `path` atomically; see `write_bytes`."""
    return write_bytes(path, text.encode("utf-8"), overwrite)


def current_umask() -> int:
    """The process's file-mode creation mask, read without changing it.

    On Linux the `Umask:` line of `/proc/self/status`. Elsewhere (or if that line cannot be
    read) the mask read once at import time (`os.umask` set and restored there, under a lock,
    before any write of ours), so no write ever changes the process umask: another thread's
    `mkdir` never sees a zero mask.
    """
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return _IMPORT_UMASK


_UMASK_LOCK = threading.Lock()


def _import_umask() -> int:
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


_IMPORT_UMASK = _import_umask()
