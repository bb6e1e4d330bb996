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
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer._click import exceptions as click_errors  # typer 0.29 vendors click: its exceptions
from typer.core import TyperGroup

from heads._util.files import check_output
from heads._util.progress import Progress
from heads._util.validation import short_repr
from heads.errors import HeadsteerError, HeadsteerValueError
from heads.model.loading import DTYPES
from heads.model.loading import check_dtype as _check_dtype

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

# Not a terminal (a pipe, a log file): rich would cut tables at 80 columns; use 160 unless COLUMNS says.
console = Console() if sys.stdout.isatty() or "COLUMNS" in os.environ else Console(width=160)
err = Console(stderr=True, soft_wrap=True)
_STATE = {"debug": False, "quiet": False}
USER_ERRORS: tuple[type[BaseException], ...] = (HeadsteerError, OSError)
"""What the CLI reports as the user's error (one line, exit 2): headsteer's own errors (bad
values, refused models, a missing extra) and an `OSError` about a path (not found, no permission,
disk full). Every other exception is a bug (`report_bug`, exit 1)."""
USER_ERROR_EXIT = 2
"""Exit status for a user error (a bad option or value), as click uses for usage errors."""
BUG_EXIT = 1
"""Exit status for an internal error (a bug in headsteer or a library it calls)."""
DEBUG_ENV = "HEADSTEER_DEBUG"
"""Environment variable: `HEADSTEER_DEBUG=1` is `headsteer --debug` (tracebacks)."""
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


# ------------------------------------------------------------------ checks
def check_device(device: str) -> str:
    """The `--device` value if torch knows it and it is available here.

    Raises:
        ValueError: an unknown device string, or CUDA / MPS not available.
    """
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise HeadsteerValueError(
            f"--device {short_repr(device)} is not a torch device (use cpu, cuda, cuda:N or mps)"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise HeadsteerValueError(f"--device {short_repr(device)}: no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise HeadsteerValueError(
                f"--device {short_repr(device)}: only {torch.cuda.device_count()} CUDA devices"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise HeadsteerValueError(f"--device {short_repr(device)}: MPS is not available")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise HeadsteerValueError(f"--device {short_repr(device)}: use cpu, cuda, cuda:N or mps")
    return device


def check_dtype(dtype: str):
    """The torch dtype named by `--dtype` (one of `heads.model.loading.DTYPES`); ValueError for any other."""
    return _check_dtype(dtype, option="--dtype")


def _positive(**options: int) -> None:
    """ValueError naming the first option (as --flag) that is not a positive int."""
    for name, value in options.items():
        if value < 1:
            raise HeadsteerValueError(f"--{name.replace('_', '-')} must be a positive int, got {value}")


def _at_most(option: str, value: int, cap: int) -> None:
    """ValueError when `value` is above `cap` (unbounded work from one option)."""
    if value > cap:
        raise HeadsteerValueError(f"{option} {value} is above the cap of {cap}")


def check_prompt(prompt: str, emphasize: list[str] | None = None, *, option: str = "prompt") -> str:
    """Refuse, before the model loads, a prompt that cannot be steered.

    Raises:
        ValueError: `prompt` (or an `--emphasize` value) is empty or white space, has unbalanced
            `**` markup, or has no emphasized span (no `**markup**` and no `--emphasize`).
    """
    from heads.inputs.spans import parse_markup

    if not prompt.strip():
        raise HeadsteerValueError(f"{option} is empty")
    check_text(prompt, option)
    for e in emphasize or ():
        if not e.strip():
            raise HeadsteerValueError(f"--emphasize is empty or white space: {short_repr(e)}")
        check_text(e, "--emphasize")
    plain, spans = parse_markup(prompt)
    if not spans and not emphasize:
        raise HeadsteerValueError(
            f"{option} has no emphasized span: mark it with **double stars** or pass --emphasize"
        )
    for e in emphasize or ():
        if e not in plain:
            raise HeadsteerValueError(f"--emphasize {short_repr(e)} is not in the {option.lstrip('-')}")
    return prompt


def check_text(text: str, option: str) -> None:
    """Refuse text from the command line that is not valid Unicode: bytes that are not UTF-8
    (Python hands them over as the surrogates U+DC80..U+DCFF) or a lone surrogate, naming the
    option and the position."""
    from heads.inputs.prompts import check_encodable

    for i, ch in enumerate(text):
        if "\udc80" <= ch <= "\udcff":
            raise HeadsteerValueError(
                f"{option} is not valid UTF-8: byte 0x{ord(ch) - 0xDC00:02x} at character {i}"
            )
    check_encodable(text, option)


def check_head_file(
    path: str, heads, *, option: str = "--pasta-heads", geometry: tuple[int, int] | None = None
) -> None:
    """Refuse, before the model loads, a parsed `{"layer": [heads]}` file (`heads`, a `HeadSet`)
    that selects no heads or names a negative layer or head, or (with `geometry`) a layer or
    head outside the model.

    Args:
        geometry: `(n_layers, n_heads)` of the model, from its config before any weight is read
            (`heads.model.loading.read_geometry`; default None: the range is checked once the
            model is loaded).

    Raises:
        ValueError: naming `option` and the file (and, out of range, the head and the model's
            layers / heads).
    """
    if not len(heads):
        raise HeadsteerValueError(f"{option} {path!r} selects no heads")
    bad = [(la, h) for la, h in heads if la < 0 or h < 0]
    if bad:
        la, h = bad[0]
        raise HeadsteerValueError(
            f"{option} {path!r} names a negative layer or head: layer {la}, head {h} (both must be >= 0)"
        )
    if geometry is not None:
        n_layers, n_heads = geometry
        outside = [(la, h) for la, h in heads if la >= n_layers or h >= n_heads]
        if outside:
            la, h = outside[0]
            raise HeadsteerValueError(
                f"{option} {path!r} names layer {la}, head {h}, outside the model: it has layers "
                f"0..{n_layers - 1} and heads 0..{n_heads - 1} per layer"
            )


def _json(obj) -> str:
    """Strict JSON: NaN and infinities become null."""

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(obj), allow_nan=False)


def warn_line(message: str) -> None:
    """Print one `warning: ...` line on stderr (white space collapsed; also with `--quiet`).

    Every warning a command raises (`warnings.warn`: a silent fallback, a no-op parameter)
    is routed here by `command`, so the user sees one line, not a Python warning with its
    source line.
    """
    msg = " ".join(str(message).split())
    err.print(f"[yellow]warning:[/yellow] {escape(msg)}", highlight=False)


@contextlib.contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """Within: each distinct warning message printed once, as one line through `warn_line`."""
    seen: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001
        text = str(message)
        if text not in seen:
            seen.add(text)
            warn_line(text)

    with warnings.catch_warnings():
        warnings.filterwarnings("always", category=UserWarning)
        warnings.showwarning = show
        yield


def _quiet_transformers() -> None:
    """No per-weight progress bars or info logs from transformers in the terminal."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


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
        device, dtype: `--device`, `--dtype` (checked before any work).
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
    def load(self, device_map: str | dict | None = None):
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

    def status(self, msg: str):
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
        `progress=` callbacks give them.
        """
        state = {"done": 0, "total": max(int(total), 1), "label": label}
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
                    escape(f"{state['label']}: {state['done']}/{state['total']} ({elapsed:.0f} s{eta})"),
                    highlight=False,
                )

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


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def debug_enabled() -> bool:
    """Whether tracebacks are shown: `headsteer --debug`, or `HEADSTEER_DEBUG` set to 1 / true / yes."""
    return _STATE["debug"] or os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes")


def report_bug(exc: BaseException) -> None:
    """Print an unexpected exception as a bug on stderr (its traceback first with --debug).

    The line is `internal error: <Type>: <message> (rerun with --debug for the traceback)`;
    with --debug the traceback comes first and the hint is left out.
    """
    if debug_enabled():
        err.print_exception()
    hint = "" if debug_enabled() else " (rerun with --debug for the traceback)"
    msg = " ".join(str(exc).split())
    what = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    err.print(f"[red]internal error:[/red] {escape(what)}{hint}", highlight=False)


def _user_set(names) -> frozenset[str] | None:
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
    app: typer.Typer, name: str | None = None, *, writes_files: bool = True, json_help: str | None = None
) -> Callable[[Callable], Callable]:
    """Register `fn(run: Run, **options) -> dict | None` as command `name` of `app`.

    Adds the shared options (`--model`, `--device`, `--dtype`, `--quiet`, `--json`,
    `--force`) to the command's own and runs it in the skeleton described in this
    module's docstring. A command that writes no file (`writes_files=False`: `generate`,
    `serve`) still takes `--force`, so that every command has the same options; its help
    says it has no effect there and passing it prints one warning line. `json_help` replaces
    the help of `--json` where it means something else than "JSON instead of tables" (`serve`).
    Returns `fn` unchanged.
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
                    check_device(run.device)
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


def _path_options(group: Any) -> set[str]:
    """The option names (`--out`, ...) of every command of `group` whose type is a `Path`."""
    import typing

    names: set[str] = set()
    for cmd in group.commands.values():
        if hasattr(cmd, "commands"):
            names |= _path_options(cmd)
        for param in cmd.params:
            ann = getattr(getattr(param, "type_descriptor", None), "annotation", None)
            if ann is Path or Path in typing.get_args(ann):
                names.update(o for o in param.opts if o.startswith("--"))
    return names


def _refuse_empty_paths(group: Any, argv: list[str]) -> None:
    """A path option given an empty string (`--out ''`) is a usage error: click would read it
    as the current folder and, for `build refusal-model`, start a fine-tune writing there."""
    paths = _path_options(group)
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        empty = (eq and value == "") or (not eq and i + 1 < len(argv) and argv[i + 1] == "")
        if name in paths and empty and not value:
            raise click_errors.UsageError(f"{name} is empty: give a path")


class OneLineUsageErrors(TyperGroup):
    """The `headsteer` group: a usage error (missing or unknown option, bad value) is one line.

    click prints a usage block, a hint and the error for a usage error; here it is one line
    on stderr, `error: <what> (see: <command> --help)`, and exit 2, like every other bad
    input. Help (`--help`, a group called without a command) is printed as click does.
    """

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            argv = kwargs.get("args", args[0] if args else None)
            _refuse_empty_paths(self, sys.argv[1:] if argv is None else list(argv))
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click_errors.NoArgsIsHelpError as exc:
            if not standalone_mode:
                raise
            exc.show()
            raise SystemExit(exc.exit_code) from None
        except click_errors.UsageError as exc:
            if not standalone_mode:
                raise
            where = exc.ctx.command_path if exc.ctx is not None else "headsteer"
            msg = " ".join(exc.format_message().split()).rstrip(".")
            err.print(f"[red]error:[/red] {escape(msg)} (see: {escape(where)} --help)", highlight=False)
            raise SystemExit(2) from None
        except click_errors.ClickException as exc:
            if not standalone_mode:
                raise
            exc.show()
            raise SystemExit(exc.exit_code) from None
        except typer.Abort:
            if not standalone_mode:
                raise
            err.print("[red]aborted[/red]", highlight=False)
            raise SystemExit(1) from None
        except typer.Exit:
            raise
        except USER_ERRORS as exc:  # outside a command (e.g. in an option callback)
            if not standalone_mode:
                raise
            if debug_enabled():
                err.print_exception()
            err.print(f"[red]error:[/red] {escape(_one_line(exc))}", highlight=False)
            raise SystemExit(USER_ERROR_EXIT) from None
        except Exception as exc:  # a bug outside a command
            if not standalone_mode:
                raise
            report_bug(exc)
            raise SystemExit(BUG_EXIT) from None
        if not standalone_mode:
            return rv
        raise SystemExit(rv if isinstance(rv, int) else 0)


def set_global(debug: bool, quiet: bool) -> None:
    """`headsteer --debug --quiet ...`: tracebacks on every error; quiet for every command."""
    _STATE["debug"] = debug
    _STATE["quiet"] = quiet
