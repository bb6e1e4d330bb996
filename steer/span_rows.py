"""Batch rows that a span-based intervention (PASTA, SpotLight) cannot steer.

PASTA (`exclude` / `include`) and SpotLight steer attention towards each prompt's emphasized
span. In a batch where only some prompts have a span, the others are left unsteered (their
edits are the identity on those rows). That is never silent: `warn_rows_without_span` emits
an `UnsteeredRowsWarning` naming the rows; turn it into an error with
`warnings.simplefilter("error", steer.UnsteeredRowsWarning)`. A batch where no prompt has a
span is a `ValueError` in the method itself.
"""

from __future__ import annotations

import warnings

from heads.inputs.prompts import EncodedPrompts

__all__ = ["UnsteeredRowsWarning", "rows_without_span", "warn_rows_without_span"]


class UnsteeredRowsWarning(UserWarning):
    """Some prompts of a batch have no emphasized span, so a span-based method leaves them unsteered."""


def rows_without_span(enc: EncodedPrompts, spans: list[list[tuple[int, int]]] | None = None) -> list[int]:
    """Indices of the batch rows of `enc` without a span (of `spans`; default `enc.spans`)."""
    return [b for b, row in enumerate(enc.spans if spans is None else spans) if not row]


def warn_rows_without_span(
    enc: EncodedPrompts,
    method: str,
    *,
    spans: list[list[tuple[int, int]]] | None = None,
    stacklevel: int = 3,
) -> list[int]:
    """Warn (`UnsteeredRowsWarning`) if some, but not all, rows of `enc` have no span.

    Args:
        enc: the encoded batch.
        method: the method's name, for the message (e.g. `"PASTA"`).
        spans: the per-row spans the method steers towards (default `enc.spans`, the
            emphasized text; e.g. `enc.select_spans("image")` for image spans).
        stacklevel: passed to `warnings.warn`.

    Returns:
        the rows without a span (empty: nothing was warned).
    """
    rows = rows_without_span(enc, spans)
    if rows and len(rows) < enc.batch:
        which = ", ".join(str(b) for b in rows)
        many = len(rows) > 1
        warnings.warn(
            f"{method}: prompt{'s' if many else ''} {which} of {enc.batch} {'have' if many else 'has'} "
            f"no emphasized span and {'are' if many else 'is'} left unsteered "
            "(mark a span with **...** or pass emphasize=)",
            UnsteeredRowsWarning,
            stacklevel=stacklevel,
        )
    return rows
