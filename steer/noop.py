"""Warnings for steering parameters that do nothing (or silently do something else).

A steering method built with a value that makes it a no-op (PASTA `alpha = 1`, ACT
`beta = 1`, Ablate `eps = 1`, an empty head selection) still runs, bitwise equal to the
unsteered model; the user gets one `NoOpWarning` (a `UserWarning`) saying so. The CLI prints
it as one `warning: ...` line on stderr (`viz.cli.common`) and runs.

A server refuses instead (`refusing_noop`): its client would never see a warning, so
`headsteer serve` and `headsteer explore` answer HTTP 400 whose message is the same sentence
(`headsteer serve` prefixes the entry, `steer[0] (pasta): PASTA alpha=1.0 is a no-op: ...`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping

from heads.results.scores import HeadSet

__all__ = ["NoOpWarning", "empty_heads", "refusing_noop", "warn_noop"]


class NoOpWarning(UserWarning):
    """A steering parameter that leaves the model unchanged, or a silent fallback."""


def empty_heads(spec: object) -> bool:
    """True when a head spec is visibly empty without a model: `{}`, `[]`, `()`, an empty
    `HeadSet`, or a `{"layer": []}` dict with no head in any layer. Files and None: False."""
    if isinstance(spec, HeadSet):
        return not len(spec)
    if isinstance(spec, Mapping):
        return all(isinstance(v, (list, tuple)) and not v for v in spec.values())
    if isinstance(spec, (list, tuple)):
        return not spec
    return False


def warn_noop(message: str, *, stacklevel: int = 3) -> None:
    """Raise `message` as a `NoOpWarning` pointing at the caller's caller (the user's line)."""
    warnings.warn(message, NoOpWarning, stacklevel=stacklevel)


@contextlib.contextmanager
def refusing_noop() -> Iterator[None]:
    """Inside, a `NoOpWarning` is raised as a `HeadsteerValueError` with the warning's own text
    (one line): the servers' rule, where the CLI and the Python API warn and run.

    Raises:
        ValueError: the text of the first `NoOpWarning` raised inside.
    """
    from heads.errors import HeadsteerValueError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", NoOpWarning)
            yield
    except NoOpWarning as exc:
        raise HeadsteerValueError(str(exc)) from None
