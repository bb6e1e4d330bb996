"""`SweepOptions`: how a head sweep runs (rows per forward, shard, executor, progress, seed).

Every scorer built on the variant engine (`heads.engine.variants`) — Ships, dataset-level Ships,
Sahara, the attribution estimate and its confirmation, PASTA profiling, ACT head filtering, and
the patching and circuit sweeps — takes one `options=SweepOptions(...)` instead of repeating these
keyword arguments. None of them changes a score: they only decide how the work is split and
reported (the seed draws random control heads where a scorer has them).

    from heads import SweepOptions
    ships(model, prompts, options=SweepOptions(max_rows=32, progress=False))

A memory budget (`max_memory`) is honoured by one line in each sweep, before its first forward:
`opts = opts.within(model, tokens, plan)` lowers `max_rows` to the rows the memory plan of that
kind of forward fits (`"forward"`, `"gradient"`, `"detectors"`, ...; `heads.planning.ANALYSES`),
and `opts.check_run(model, tokens, plan, batch)` refuses a run that has no batch to shrink; a
sweep that cannot honour it leaves `"max_memory"` out of its `takes`, so it is refused by name
(docs/long-context.md lists which analysis runs under which plan).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from heads._util.progress import ProgressArg
from heads._util.validation import check_int, check_seed, check_shard, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError

if TYPE_CHECKING:
    from heads.engine.executors import Executor

__all__ = ["SWEEP_KEYS", "SweepOptions", "sweep_options", "sweep_rows"]

SWEEP_KEYS = ("max_rows", "shard", "executor", "progress", "seed")
"""The keyword arguments `SweepOptions` replaces (accepted, deprecated, for one release)."""


@dataclass(frozen=True)
class SweepOptions:
    """How a sweep over head variants runs.

    Attributes:
        max_rows: batch rows per forward (default 64): the memory bound. Rows are
            (variant, prompt) pairs, sorted by length and trimmed per batch.
        shard: `(i, n)`: score only every n-th variant from i (merge the parts with
            `heads.results.scores.merge_scores`); default None scores all.
        executor: `"local"`, `"ray"` or a `heads.engine.executors.Executor` that splits the sweep
            into its shards and merges them; default None runs here, unsharded.
        progress: True (default: a tqdm bar), False / None (off), or a callable
            `progress(done, total)` called after each batch.
        seed: seeds anything random in the scorer (control heads); default 0.
        max_memory: a memory budget per device (bytes, or `"24GB"` / `"80GiB"`; default None:
            none). A sweep then runs at most the batch rows whose planned peak stays within it
            (`rows_for`, from `heads.plan_memory`), fewer than `max_rows` where needed, and is
            refused before its first forward, with the minimum named, when one row does not fit
            (`within`); an analysis without a batch to shrink is refused when its one run does
            not fit (`check_run`); one that takes no budget refuses it by name.

    Raises:
        HeadsteerValueError: `max_rows` not a positive int, a bad `shard`, `shard` together
            with `executor`, a non-int seed, an unknown executor name.
        HeadsteerTypeError: `progress` of another type.
    """

    max_rows: int = 64
    shard: tuple[int, int] | None = None
    executor: str | Executor | None = None
    progress: ProgressArg = True
    seed: int = 0
    max_memory: int | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_rows", check_int("max_rows", self.max_rows, lo=1))
        object.__setattr__(self, "shard", check_shard(self.shard))
        object.__setattr__(self, "seed", check_seed("seed", self.seed))
        if not (self.progress is None or isinstance(self.progress, bool) or callable(self.progress)):
            raise HeadsteerTypeError(
                "progress must be True, False, None or a callable (done, total), got "
                f"{short_repr(self.progress)}"
            )
        if isinstance(self.executor, str) and self.executor not in ("local", "ray"):
            raise HeadsteerValueError(
                f"executor must be 'local', 'ray' or an Executor, got {short_repr(self.executor)}"
            )
        if self.max_memory is not None:
            from heads.planning.units import parse_bytes

            object.__setattr__(self, "max_memory", parse_bytes(self.max_memory, "max_memory"))
        if self.shard is not None and self.executor is not None:
            raise HeadsteerValueError(
                "pass either shard= or executor=, not both: an executor makes its own shards"
            )

    def rows_for(self, model: Any, tokens: int, request: object = "forward") -> int:
        """Batch rows per forward for `request` on rows of `tokens` tokens: `max_rows`, or fewer
        when the plan of `max_memory` allows fewer (`heads.planning.rows_within`).

        Args:
            model: the `HeadModel` (its config, dtype and device are planned; no forward runs).
            tokens: the longest row's length.
            request: what each forward is (default `"forward"`, a no-grad forward; see
                `heads.planning.ANALYSES`).

        Raises:
            HeadsteerValueError: one row already exceeds `max_memory` (the minimum named).
        """
        if self.max_memory is None:
            return self.max_rows
        from heads.planning.plan import rows_within

        device = str(getattr(model, "device", "cpu"))
        dtype = getattr(model, "dtype", "float32")
        return rows_within(model, self.max_memory, request, tokens, dtype, device, most=self.max_rows)

    def within(
        self, model: Any, tokens: int, request: object = "forward", *, reserve: int = 0, whole: int = 0
    ) -> SweepOptions:
        """These options with `max_rows` lowered to the rows per forward that `max_memory`
        allows (`rows_for`; unchanged without a budget): the one line a sweep runs before its
        first forward, so every later `max_rows` it reads is within the budget.

        Args:
            model: the `HeadModel` (config, dtype and device planned; no forward runs).
            tokens: the longest row's length (a batch's width).
            request: what each forward is: `"forward"` (default), `"gradient"`, `"detectors"`,
                `"sinks"`, `"qrhead"`, `"knockout"`, ... (`heads.planning.ANALYSES`) or a
                `heads.planning.MemoryRequest`.
            reserve: bytes the sweep keeps alive beside its forwards (recorded clean / corrupted
                activations, accumulated scores; default 0): the rows fit `max_memory - reserve`.
            whole: rows the sweep also runs in one forward, unsplit (e.g. the recorded clean
                run of every pair; default 0: none): that forward's plan must fit as well.

        Raises:
            HeadsteerValueError: one row already exceeds `max_memory` (the message names that
                minimum, weights included, and the budget), or one row fits but the `whole` run
                does not (the message names its rows and that they run in one forward).
        """
        if self.max_memory is None:
            return self
        from heads.planning.plan import rows_within

        budget = int(self.max_memory)
        one = self._plan(model, tokens, request, 1)
        if one.peak + reserve > budget:  # the minimum: one row (checked before the whole run)
            self._refuse(one, reserve)
        if whole:
            self.check_run(model, tokens, request, batch=whole, reserve=reserve)
        device = str(getattr(model, "device", "cpu"))
        dtype = getattr(model, "dtype", "float32")
        rows = rows_within(model, budget - reserve, request, tokens, dtype, device, most=self.max_rows)
        return self.replace(max_rows=rows)

    def check_run(
        self, model: Any, tokens: int, request: object = "forward", batch: int = 1, *, reserve: int = 0
    ) -> None:
        """Refuse, before any forward, a run with no batch axis to shrink (`batch` rows of
        `tokens` tokens in one forward, `reserve` bytes kept beside it) whose planned peak
        exceeds `max_memory`; nothing without a budget.

        Raises:
            HeadsteerValueError: the plan exceeds `max_memory` (the planned minimum named).
        """
        if self.max_memory is None:
            return
        plan = self._plan(model, tokens, request, batch)
        if plan.peak + reserve > int(self.max_memory):
            self._refuse(plan, reserve)

    @staticmethod
    def _plan(model: Any, tokens: int, request: object, batch: int) -> Any:
        from heads.planning.plan import plan_memory

        device = str(getattr(model, "device", "cpu"))
        return plan_memory(model, request, tokens, batch, getattr(model, "dtype", "float32"), device)

    def _refuse(self, plan: Any, reserve: int) -> None:
        from heads.planning.units import format_bytes

        kept = f" + {format_bytes(reserve)} kept beside it" if reserve else ""
        if plan.batch > 1:  # only a run with no batch axis to shrink is refused at > 1 row
            kept += f"; the {plan.batch} rows run in one forward"
        raise HeadsteerValueError(
            f"{plan.request.analysis} on {plan.batch} x {plan.tokens} tokens needs at least "
            f"{format_bytes(plan.peak + reserve)} ({plan!r}{kept}); max_memory is "
            f"{format_bytes(int(self.max_memory or 0))}"
        )

    def replace(self, **changes: Any) -> SweepOptions:
        """A copy with `changes` applied (validated again)."""
        from dataclasses import replace

        return replace(self, **changes)


def sweep_options(
    options: SweepOptions | None,
    legacy: Mapping[str, Any],
    where: str,
    *,
    takes: Collection[str] = SWEEP_KEYS,
    renamed: Mapping[str, str] | None = None,
    stacklevel: int = 3,
) -> SweepOptions:
    """The `SweepOptions` a scorer runs with: `options` (default `SweepOptions()`), updated by the
    deprecated keyword arguments in `legacy` (`max_rows=`, `shard=`, ...; a `DeprecationWarning`).

    Args:
        options: the caller's `options=` (None: the defaults).
        legacy: the scorer's `**kwargs`: only names in `SWEEP_KEYS` are allowed.
        where: the scorer's name, for the messages.
        takes: the options this scorer uses; another one set to a non-default value is an error
            (e.g. `shard` for Sahara, whose greedy steps cannot be split). `progress` is never
            refused: turning the progress display on or off is valid for every scorer (used where
            it reports progress, harmless elsewhere).
        renamed: the scorer's own old keyword names for an option (`{"batch_rows": "max_rows"}`),
            accepted the same way (deprecated; the warning names the option).
        stacklevel: the `DeprecationWarning`'s stack level (default 3: the caller of the scorer
            that calls this; one more for each helper in between).

    Raises:
        HeadsteerTypeError: a keyword that is no sweep option (worded as Python words an unknown
            keyword), or `options` not a `SweepOptions`.
        HeadsteerValueError: a bad option value, an option this scorer does not take, or a
            keyword in `legacy` whose option `options` also sets (to a non-default value).
    """
    renamed = dict(renamed or {})
    unknown = sorted(set(legacy) - set(SWEEP_KEYS) - set(renamed))
    if unknown:
        raise HeadsteerTypeError(f"{where}() got an unexpected keyword argument {short_repr(unknown[0])}")
    if options is None:
        options = SweepOptions()
    elif not isinstance(options, SweepOptions):
        raise HeadsteerTypeError(f"options must be a heads.SweepOptions, got {short_repr(options)}")
    if legacy:
        given = SweepOptions()
        for k in legacy:
            field = renamed.get(k, k)
            if getattr(options, field) != getattr(given, field):
                raise HeadsteerValueError(
                    f"{where}() got both {k}= and options.{field}: pass only "
                    f"options=SweepOptions({field}=...)"
                )
        names = ", ".join(f"{k}=" for k in legacy)
        fill = ", ".join(f"{renamed.get(k, k)}=..." for k in legacy)
        warnings.warn(
            f"{where}({names}) is deprecated: pass options=SweepOptions({fill}) instead "
            "(the keywords are removed in the next release)",
            DeprecationWarning,
            stacklevel=_past_decorators(stacklevel),
        )
        options = options.replace(**{renamed.get(k, k): v for k, v in legacy.items()})
    defaults = SweepOptions()
    for f in fields(SweepOptions):
        if f.name == "progress":  # a display preference: used where the scorer reports, never refused
            continue
        if f.name not in takes and getattr(options, f.name) != getattr(defaults, f.name):
            raise HeadsteerValueError(
                f"{where} does not take {f.name}= (got {short_repr(getattr(options, f.name))})"
            )
    return options


_DECORATORS = ("torch.utils._contextlib",)
"""Modules whose wrapper frames sit between a decorated scorer and its caller
(`@torch.no_grad()`'s `decorate_context`)."""


def _past_decorators(stacklevel: int) -> int:
    """`stacklevel` as `sweep_options` passes it to `warnings.warn`, plus one for each decorator
    frame (`_DECORATORS`) on the way to the caller: a `@torch.no_grad()` scorer's warning names
    its caller's line, not torch's wrapper."""
    frame = sys._getframe(2)  # sweep_options' caller: level 2 of its warning
    level = 2
    while frame is not None and level <= stacklevel:
        if frame.f_globals.get("__name__") in _DECORATORS:
            stacklevel += 1
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return stacklevel


def sweep_rows(
    options: SweepOptions | None,
    legacy: dict[str, Any],
    where: str,
    *,
    default: int,
    name: str = "batch_size",
    takes: Collection[str] = ("max_rows",),
    stacklevel: int = 4,
) -> SweepOptions:
    """`sweep_options` for a scorer whose rows per forward were its own keyword `name=` with its
    own default: the returned options' `max_rows` is the loose keyword's value (checked and named
    before the `DeprecationWarning`), else `options.max_rows` where it is not the `SweepOptions`
    default, else `default`. Call it from the scorer itself (the warning names its caller's line).

    Raises:
        HeadsteerValueError: the loose value not a positive int (named), and what `sweep_options`
            refuses.
    """
    if name in legacy:
        check_int(name, legacy[name], lo=1)
    loose = name in legacy
    opts = sweep_options(
        options, legacy, where, takes=takes, renamed={name: "max_rows"}, stacklevel=stacklevel
    )
    if not loose and opts.max_rows == SweepOptions().max_rows:
        opts = opts.replace(max_rows=default)
    return opts
