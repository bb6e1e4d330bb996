"""Progress of long-running work: a tqdm bar by default, or a callback `progress(done, total)`.

Every long-running function of headsteer (the head scorers on the variant engine, PASTA
profiling, ACT calibration, MAPS, task evaluation, the report computations) takes
`progress: ProgressArg = True`:

* `True` (default): a `tqdm.auto` bar on stderr (a notebook widget under Jupyter when
  `ipywidgets` is installed); `TQDM_DISABLE=1` in the environment turns every bar off;
* `False` or `None`: no progress at all;
* a callable `progress(done, total)`: called with two ints, `0 <= done <= total`, after
  each unit of work; `done` never decreases and the last call has `done == total`.

The unit is the function's own and is documented there (batch rows of the variant engine,
examples, layers, steps); `total` may grow between calls when a function only learns it
while working (a front end shows the latest one). A function turns its argument into one
callable with `progress_callback` and hands that callable (or None) to the functions it
calls, so nested work draws one bar:

    scores = heads.scorers.safety.ships(model, prompts)                      # a tqdm bar
    scores = heads.scorers.safety.ships(model, prompts, progress=False)      # silent
    scores = heads.scorers.safety.ships(model, prompts, progress=lambda done, total: print(done, "/", total))
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from heads._util.validation import short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError

__all__ = ["Progress", "ProgressArg", "hf_progress_bars_off", "offset_progress", "progress_callback"]

Progress = Callable[[int, int], None]
"""`progress(done, total)`: `done` units of `total` finished (ints, `0 <= done <= total`)."""

ProgressArg = Progress | bool | None
"""What a long-running function accepts as `progress=`: True (a tqdm bar), False/None (off)
or a `Progress` callable."""


@contextmanager
def progress_callback(
    progress: ProgressArg, desc: str, unit: str = "it", *, delay: float = 0.0
) -> Iterator[Progress | None]:
    """Turn a `progress=` argument into one `Progress` callable (None when off).

    Args:
        progress: True (a `tqdm.auto` bar, closed when the block exits, also on error),
            False / None (off: yields None), or a `(done, total)` callable (yielded as is).
        desc: the bar's label (e.g. `"ships"`).
        unit: the bar's unit (e.g. `"rows"`, `"layers"`).
        delay: seconds before the bar is drawn (default 0; tqdm's `delay`): a call that ends
            sooner shows nothing, a longer one still shows its progress.

    Yields:
        A callable `report(done, total)` or None.

    Raises:
        TypeError: `progress` is none of these (checked on entry, before any work).
    """
    if progress is None or progress is False:
        yield None
        return
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=None, desc=desc, unit=unit, dynamic_ncols=True, delay=delay)

        def report(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)  # update() refreshes, also when only the total changed

        try:
            yield report
        finally:
            bar.close()
        return
    if not callable(progress):
        raise HeadsteerTypeError(
            f"progress must be True, False, None or a callable (done, total), got {type(progress).__name__}"
        )
    yield progress


def offset_progress(progress: Progress | None, offset: int, total: int) -> Progress | None:
    """A callback for one stage of a larger job: reports `(offset + done, total)` to `progress`.

    A job of several stages with known sizes `n_1, n_2, ...` (in one unit) passes
    `offset_progress(progress, n_1 + ... + n_{i-1}, n_1 + n_2 + ...)` to stage i; the
    stage's own total is ignored. `None` (or False) stays `None` (no progress wanted);
    `progress` is a callable, not True: turn True into a bar first with `progress_callback`.

    Raises:
        ValueError: a negative `offset` or a `total` below it.
    """
    if offset < 0 or total < offset:
        raise HeadsteerValueError(f"need 0 <= offset <= total, got offset={offset}, total={total}")
    if progress is None or progress is False:
        return None
    if not callable(progress):
        raise HeadsteerTypeError(
            f"offset_progress needs a (done, total) callable, got {short_repr(progress)}"
        )

    def stage(done: int, _stage_total: int) -> None:
        progress(min(offset + done, total), total)

    return stage


_HF_BARS_LOCK = threading.Lock()
_HF_BARS: dict[str, int | bool] = {"depth": 0, "transformers": False, "hub": False}


@contextmanager
def hf_progress_bars_off() -> Iterator[None]:
    """transformers' and huggingface_hub's own tqdm bars (e.g. "Writing model shards" in
    `save_pretrained`, "Loading weights") off inside the block, restored on exit (also on error).

    The switch is process-wide in both libraries; blocks may nest and run in several threads
    at once: the first block to enter records the previous state and turns the bars off, the
    last to leave restores it (a lock guards the count). Code outside every block that runs
    meanwhile in another thread sees the bars off as well.
    """
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    with _HF_BARS_LOCK:
        if _HF_BARS["depth"] == 0:
            _HF_BARS["transformers"] = hf_logging.is_progress_bar_enabled()
            _HF_BARS["hub"] = not hub_utils.are_progress_bars_disabled()
            hf_logging.disable_progress_bar()  # both libraries' switches
        _HF_BARS["depth"] = int(_HF_BARS["depth"]) + 1
    try:
        yield
    finally:
        with _HF_BARS_LOCK:
            _HF_BARS["depth"] = int(_HF_BARS["depth"]) - 1
            if _HF_BARS["depth"] == 0:
                if _HF_BARS["transformers"]:
                    hf_logging.enable_progress_bar()  # also turns huggingface_hub's on
                    if not _HF_BARS["hub"]:
                        hub_utils.disable_progress_bars()
                elif _HF_BARS["hub"]:
                    hub_utils.enable_progress_bars()
