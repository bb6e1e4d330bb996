"""Progress of long-running work as numbers: a callback `progress(done, total)`.

Every long-running function of headsteer (the head scorers on the variant engine, PASTA
profiling, ACT calibration, MAPS, task evaluation, the report computations) takes
`progress: Progress | None = None` and calls it with two ints, `0 <= done <= total`,
after each unit of work; `done` never decreases and the last call has `done == total`.
The unit is the function's own and is documented there (batch rows of the variant
engine, examples, layers, steps); `total` may grow between calls when a function only
learns it while working (a front end shows the latest one).

A front end turns it into a bar (the CLI uses `rich`), a notebook into a counter:

    scores = heads.ships(model, prompts, progress=lambda done, total: print(done, "/", total))
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Progress", "offset_progress"]

Progress = Callable[[int, int], None]
"""`progress(done, total)`: `done` units of `total` finished (ints, `0 <= done <= total`)."""


def offset_progress(progress: Progress | None, offset: int, total: int) -> Progress | None:
    """A callback for one stage of a larger job: reports `(offset + done, total)` to `progress`.

    A job of several stages with known sizes `n_1, n_2, ...` (in one unit) passes
    `offset_progress(progress, n_1 + ... + n_{i-1}, n_1 + n_2 + ...)` to stage i; the
    stage's own total is ignored. `None` stays `None` (no progress wanted).

    Raises:
        ValueError: a negative `offset` or a `total` below it.
    """
    if offset < 0 or total < offset:
        raise ValueError(f"need 0 <= offset <= total, got offset={offset}, total={total}")
    if progress is None:
        return None

    def stage(done: int, _stage_total: int) -> None:
        progress(min(offset + done, total), total)

    return stage
