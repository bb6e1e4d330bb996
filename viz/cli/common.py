"""The skeleton every `headsteer` command shares: options, model loading, progress, output, errors.

A command is a function `fn(run: Run, **own_options) -> dict | None` registered with
`@command(app)`. The decorator adds the shared option set to its signature

    --model, --device, --dtype, --quiet, --json, --force

and runs it inside one frame:

* the command checks its own options first, then declares every file it will write
  with `run.output(...)` / `run.folder(...)` (an existing file without `--force`, a
  symlink or a folder there: exit 2, before any work), then `run.load()` loads the
  model with a status line and `run.progress(total, label)` gives a progress
  callback `step(done, total)`;
* human output goes through `run.show(...)` (nothing with `--json`); the returned
  dict is printed as strict JSON with `--json`;
* every declared file that was written is printed (`wrote PATH`; on stderr with
  `--json`);
* a warning raised inside (a silent fallback, a no-op parameter) is one
  `warning: ...` line on stderr (`warn_line`), printed once;
* a user error (a `heads.errors.HeadsteerError`, a bad option, an `OSError` about a
  path) is one line `error: ...` on stderr and exit 2; any other exception is a bug:
  one line `internal error: <Type>: <message> (rerun with --debug for the traceback)`
  and exit 1. `headsteer --debug` (or `HEADSTEER_DEBUG=1`) prints the traceback first,
  in both cases. Ctrl-C exits 130. Whatever the failure, when some declared files were
  already written, one more line says which were and which were not.

The pieces live in `viz.cli.messages` (consoles, warning and error lines, exit statuses),
`viz.cli.checks` (option checks made before the model loads) and `viz.cli.usage` (the group's
one-line usage errors); this module holds the shared options, `Run` and `command`, and
re-exports the others' names.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from typer._click import exceptions as click_errors  # typer 0.29 vendors click: its exceptions

from heads._util.files import check_output
from heads._util.progress import Progress
from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.model.loading import DTYPES

# The names below `as` themselves are re-exported: their import path `viz.cli.common.<name>` stays.
from viz.cli.checks import (
    _at_most as _at_most,
)
from viz.cli.checks import (
    _positive as _positive,
)
from viz.cli.checks import (
    check_device,
    check_dtype,
)
from viz.cli.checks import (
    check_head_file as check_head_file,
)
from viz.cli.checks import (
    check_prompt as check_prompt,
)
from viz.cli.checks import (
    check_text as check_text,
)
from viz.cli.messages import (
    _STATE,
    BUG_EXIT,
    USER_ERROR_EXIT,
    USER_ERRORS,
    _json,
    _quiet_transformers,
    _warnings_as_lines,
    console,
    debug_enabled,
    err,
    report_bug,
    warn_line,
)
from viz.cli.messages import (
    DEBUG_ENV as DEBUG_ENV,
)
from viz.cli.messages import (
    _one_line as _one_line,
)
from viz.cli.messages import (
    set_global as set_global,
)
from viz.cli.usage import OneLineUsageErrors
from viz.cli.usage import _path_options as _path_options
from viz.cli.usage import _refuse_empty_paths as _refuse_empty_paths

if TYPE_CHECKING:
    from heads.model.adapter import HeadModel

__all__ = [
    "BUG_EXIT",
    "USER_ERRORS",
    "USER_ERROR_EXIT",
    "OneLineUsageErrors",
    "Run",
    "command",
    "console",
    "debug_enabled",
    "err",
    "report_bug",
    "warn_line",
]

PLAIN_PROGRESS_EVERY_S = 5.0
"""Seconds between plain progress lines when stderr is not a terminal (logs, CI, nohup)."""

# ------------------------------------------------------------------ shared options
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="HF model folder or a packaged model name, gemma-3-270m "
        "(default: embedded SmolLM2-135M-Instruct)",
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="torch device: cpu, cuda, cuda:N or mps")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help=f"weight dtype: {', '.join(DTYPES)}")]
QuietOpt = Annotated[bool, typer.Option("--quiet", help="no status line or progress bars")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]
ForceOpt = Annotated[bool, typer.Option("--force", help="replace existing output files")]
AllowMismatchOpt = Annotated[
    bool,
    typer.Option(
        "--allow-weight-mismatch",
        help="load a checkpoint that lacks tensors or has extra ones, with a warning listing them "
        "(default: an error); the environment variable HEADSTEER_ALLOW_WEIGHT_MISMATCH=1 does the same",
    ),
]
NO_FILES_FORCE_HELP = (
    "no effect: this command writes no file (taken so that every command has the same options)"
)
NoFilesForceOpt = Annotated[bool, typer.Option("--force", help=NO_FILES_FORCE_HELP)]
EmphasizeOpt = Annotated[
    list[str] | None,
    typer.Option("--emphasize", help="substring to emphasize (repeatable), besides **markup** in the prompt"),
]

_SHARED: dict[str, tuple[Any, Any]] = {
    "model": (ModelOpt, None),
    "device": (DeviceOpt, "cpu"),
    "dtype": (DtypeOpt, "float32"),
    "quiet": (QuietOpt, False),
    "as_json": (JsonOpt, False),
    "force": (ForceOpt, False),
    "allow_weight_mismatch": (AllowMismatchOpt, False),
}


def _stat(p: Path) -> tuple[int, int] | None:
    try:
        st = p.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns)


# ------------------------------------------------------------------ the run
@dataclass
class Run:
    """One command's shared state: options, declared outputs, model loading, progress, output.

    Attributes:
        model: `--model` (None: the embedded model).
        device: `--device` (checked before any work).
        dtype: `--dtype` (checked before any work).
        quiet: `--quiet` here or on `headsteer` itself.
        as_json: `--json`.
        force: `--force`: declared outputs may replace existing files.
        allow_weight_mismatch: `--allow-weight-mismatch` (or `HEADSTEER_ALLOW_WEIGHT_MISMATCH=1`):
            `load` accepts a checkpoint with missing or unexpected tensors, warning.
        user_set: the command's own parameters the user gave (on the command line or through
            an environment variable: click's `ctx.get_parameter_source(name)` is not DEFAULT /
            DEFAULT_MAP), by Python name; None outside a click command (see `gave`).
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    quiet: bool = False
    as_json: bool = False
    force: bool = False
    allow_weight_mismatch: bool = False
    planned: dict[Path, tuple[int, int] | None] = field(default_factory=dict)
    user_set: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.model is not None and not str(self.model).strip():
            raise HeadsteerValueError(
                "--model is empty: give a model folder, or leave --model out for the embedded model"
            )

    def check_new_tokens(self, max_new_tokens: int, option: str = "--max-new-tokens") -> None:
        """Refuse, from `--model`'s config before any weight is read, a `max_new_tokens` that
        no prompt leaves room for (at least the model's positions)."""
        from heads.model.loading import read_max_positions

        limit = read_max_positions(self.model)
        if limit is not None and max_new_tokens >= limit:
            raise HeadsteerValueError(
                f"{option} {short_repr(max_new_tokens)} does not fit: the model has {limit} positions "
                "for the prompt and the new tokens together"
            )

    def gave(self, name: str, value: object = None, default: object = None) -> bool:
        """Whether the user gave option `name` (its Python name, e.g. `"caa_layer"`), even at
        its default value: an option that a chosen method does not use is refused when given at
        all, not only when it differs from its default. Outside a click command (`user_set` is
        None: the command called from Python) it falls back to `value != default`."""
        if self.user_set is None:
            return value != default
        return name in self.user_set

    # -- outputs
    def output(
        self, path: str | os.PathLike, *, suffixes: tuple[str, ...] = (), option: str = "--out"
    ) -> Path:
        """Declare a file this command will write and check it now, before any work.

        Raises:
            ValueError: wrong suffix (when `suffixes` is given), a folder or a symlink
                at `path`, or an existing file without `--force`.
        """
        p = Path(path).expanduser()
        if suffixes and p.suffix.lower() not in suffixes:
            article = "an" if suffixes[0] in (".html", ".htm") else "a"
            raise HeadsteerValueError(f"{option} must name {article} {suffixes[0]} file, got {str(path)!r}")
        check_output(p, self.force)
        self.planned[p] = _stat(p)
        return p

    def folder(self, path: str | os.PathLike, names: list[str], *, option: str = "--out") -> list[Path]:
        """Declare files `names` inside folder `path` (which may not exist yet); see `output`.

        Raises:
            ValueError: `path` exists and is not a folder, or is a symlink; any of the
                files fails `output`'s checks.
        """
        folder = Path(path).expanduser()
        if folder.is_symlink():
            raise HeadsteerValueError(f"refusing to write through a symlink: {folder}")
        if folder.exists() and not folder.is_dir():
            raise HeadsteerValueError(f"{option} {str(path)!r} exists and is not a folder")
        return [self.output(folder / n) for n in names]

    def written(self) -> list[Path]:
        """Declared files that this run wrote (a new file, or a replaced one), in declared order."""
        return [p for p, before in self.planned.items() if (now := _stat(p)) is not None and now != before]

    # -- model and progress
    def load(self, device_map: str | dict | None = None) -> HeadModel:
        """Load `--model` on `--device` in `--dtype`, with a status line on stderr; a `HeadModel`.

        `device_map` (e.g. `"auto"`) places the layers through accelerate instead of `--device`.
        """
        from heads import load_model

        dtype = check_dtype(self.dtype)
        _quiet_transformers()
        name = self.model or "the embedded SmolLM2-135M-Instruct"
        where = self.device if device_map is None else f"device_map={device_map}"
        # explicit opt-in, warned: the flag, or the documented environment variable
        lax = self.allow_weight_mismatch or os.environ.get("HEADSTEER_ALLOW_WEIGHT_MISMATCH", "") == "1"
        with self.status(f"loading {name} ({self.dtype}, {where})…"):
            if device_map is not None:
                return load_model(self.model, dtype=dtype, device_map=device_map, allow_weight_mismatch=lax)
            return load_model(self.model, dtype=dtype, device=self.device, allow_weight_mismatch=lax)

    def status(self, msg: str) -> contextlib.AbstractContextManager[Any]:
        """A spinner on a terminal, one plain line otherwise, nothing with `--quiet`."""
        if self.quiet:
            return contextlib.nullcontext()
        if err.is_terminal:
            return err.status(escape(msg))
        err.print(escape(msg), highlight=False)
        return contextlib.nullcontext()

    def say(self, msg: str) -> None:
        """One plain line on stderr (nothing with `--quiet`)."""
        if not self.quiet:
            err.print(escape(msg), highlight=False)

    @contextlib.contextmanager
    def progress(self, total: int, label: str = "working") -> Iterator[Progress]:
        """A progress display for `total` steps; yields the callback `step(done, total)`.

        On a terminal, a rich bar with elapsed time and ETA; when stderr is not a
        terminal, a plain line at most every `PLAIN_PROGRESS_EVERY_S` seconds and when done; with
        `--quiet`, nothing. `step(done, total)` is a `heads._util.progress.Progress`: it sets
        the absolute position and the (possibly grown) total, as the library's
        `progress=` callbacks give them. `step.stage(name)` replaces the label while a later stage
        of the same work runs (the patching report's DLA and logit lens after its sweep).
        """
        state = {"done": 0, "total": max(int(total), 1)}
        shown_label = [label]  # `step.stage(name)` replaces it while a later stage runs
        bar = None
        if not self.quiet and err.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=err,
                transient=True,
            )
            task = bar.add_task(escape(label), total=state["total"])
        t0 = last = time.monotonic()
        if bar is None and not self.quiet:  # say what runs before its first step ends
            err.print(escape(f"{label}: 0/{state['total']}"), highlight=False)

        shown = (0, state["total"])  # the (done, total) last printed: a repeated final step prints once

        # (done, time) at the first step: it often holds a one-off cost (a prefill, a compile),
        # so the ETA is estimated from the steps after it
        first: tuple[int, float] | None = None

        def step(done: int, total: int) -> None:
            nonlocal last, shown, first
            state["done"], state["total"] = int(done), max(int(total), 1)
            if first is None and state["done"] > 0:
                first = (state["done"], time.monotonic())
            if bar is not None:
                bar.update(task, completed=state["done"], total=state["total"])
            elif (
                not self.quiet
                and (state["done"], state["total"]) != shown
                and (time.monotonic() - last >= PLAIN_PROGRESS_EVERY_S or state["done"] >= state["total"])
            ):  # every few seconds, and at the end
                last = time.monotonic()
                shown = (state["done"], state["total"])
                elapsed = last - t0
                eta = ""
                if first is not None and state["done"] > first[0]:  # the rate after the first step
                    rate = (last - first[1]) / (state["done"] - first[0])
                    eta = f", ETA {rate * (state['total'] - state['done']):.0f} s"
                err.print(
                    escape(f"{shown_label[0]}: {state['done']}/{state['total']} ({elapsed:.0f} s{eta})"),
                    highlight=False,
                )

        def stage(name: str) -> None:
            """Name the stage now running (e.g. `"direct logit attribution"` after a patch sweep)."""
            shown_label[0] = name
            if bar is not None:
                bar.update(task, description=escape(name))

        step.stage = stage  # type: ignore[attr-defined]  # read by reports with several stages
        if bar is None:
            yield step
            return
        with bar:
            yield step

    # -- output
    def show(self, *items: Any) -> None:
        """Print tables or text to stdout, unless `--json`."""
        if not self.as_json:
            for item in items:
                if isinstance(item, str):
                    console.print(item, highlight=False, markup=False)
                else:
                    console.print(item)

    def _report_files(self, *, failed: bool) -> None:
        done = self.written()
        if not failed:
            out = err if self.as_json else console
            if not (self.as_json and self.quiet):
                for p in done:
                    out.print(escape(f"wrote {p}"), highlight=False)
            return
        if done:
            missing = [p for p in self.planned if p not in done]
            err.print(
                escape(
                    f"written: {', '.join(map(str, done))}; "
                    f"not written: {', '.join(map(str, missing)) or 'none'}"
                ),
                highlight=False,
            )

    def fail(self, exc: BaseException) -> None:
        """A user error: one line on stderr (the traceback first with --debug), then exit 2."""
        if debug_enabled():
            err.print_exception()
        err.print(f"[red]error:[/red] {escape(_one_line(exc))}", highlight=False)
        self._report_files(failed=True)
        raise typer.Exit(USER_ERROR_EXIT)

    def crash(self, exc: BaseException) -> None:
        """A bug: `report_bug`'s line (the traceback first with --debug), then exit 1."""
        report_bug(exc)
        self._report_files(failed=True)
        raise typer.Exit(BUG_EXIT)


def _user_set(names: Iterable[str]) -> frozenset[str] | None:
    """The names among `names` whose value the user gave (not click's default); None without
    a click context."""
    from typer._click.core import ParameterSource
    from typer._click.globals import get_current_context

    ctx = get_current_context(silent=True)
    if ctx is None:
        return None
    defaults = (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
    return frozenset(n for n in names if ctx.get_parameter_source(n) not in defaults)


def command(
    app: typer.Typer,
    name: str | None = None,
    *,
    writes_files: bool = True,
    json_help: str | None = None,
    uses_device: bool = True,
) -> Callable[[Callable], Callable]:
    """Register `fn(run: Run, **options) -> dict | None` as command `name` of `app`.

    Adds the shared options (`--model`, `--device`, `--dtype`, `--quiet`, `--json`,
    `--force`) to the command's own and runs it in the skeleton described in this
    module's docstring. A command that writes no file (`writes_files=False`: `generate`,
    `serve`) still takes `--force`, so that every command has the same options; its help
    says it has no effect there and passing it prints one warning line. `json_help` replaces
    the help of `--json` where it means something else than "JSON instead of tables" (`serve`).
    A command that runs nothing on `--device` (`uses_device=False`: `plan`, from the config
    alone) checks only that it names a device, not that one is present. Returns `fn` unchanged.
    """

    def decorate(fn: Callable) -> Callable:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "run"]
        taken = {p.name for p in own}
        options = dict(_SHARED)
        if not writes_files:
            options["force"] = (NoFilesForceOpt, False)
        if json_help is not None:
            options["as_json"] = (Annotated[bool, typer.Option("--json", help=json_help)], False)
        extra = [
            inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=a)
            for k, (a, d) in options.items()
            if k not in taken
        ]
        label = name or fn.__name__.replace("_", "-")
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + extra

        def wrapper(**kwargs: Any) -> None:
            shared = {k: kwargs.pop(k) for k in _SHARED}
            shared["quiet"] = shared["quiet"] or _STATE["quiet"]
            run = Run(**shared, user_set=_user_set(kwargs))
            try:
                with _warnings_as_lines():
                    if run.force and not writes_files:
                        warn_line(f"--force has no effect: {label} writes no file")
                    check_device(run.device, present=uses_device)
                    check_dtype(run.dtype)
                    result = fn(run, **kwargs)
            except USER_ERRORS as exc:
                run.fail(exc)
            except KeyboardInterrupt:
                err.print("[red]interrupted[/red]", highlight=False)
                run._report_files(failed=True)
                raise typer.Exit(130) from None
            except (typer.Exit, typer.Abort, click_errors.ClickException):
                raise  # click's own flow (a command may raise typer.Exit or BadParameter)
            except Exception as exc:  # a bug, not the user's input
                run.crash(exc)
            if run.as_json and result is not None:
                print(_json(result))
            run._report_files(failed=False)

        wrapper.__name__ = fn.__name__
        wrapper.__qualname__ = fn.__qualname__
        wrapper.__doc__ = fn.__doc__
        wrapper.__module__ = fn.__module__
        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        app.command(name)(wrapper)
        return fn

    return decorate
