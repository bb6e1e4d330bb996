"""Checks of command-line values the `headsteer` commands share, made before the model loads:
`--device`, `--dtype`, positive and capped counts, prompts and their `**markup**`, text that is
not valid Unicode, head files. Each raises a `HeadsteerValueError` naming the option.

Re-exported by `viz.cli.common`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.model.loading import check_dtype as _check_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["check_device", "check_dtype", "check_head_file", "check_prompt", "check_text"]


def check_device(device: str, present: bool = True) -> str:
    """The `--device` value if torch knows it and (`present`, default) it is available here.

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
    if dev.type not in ("cpu", "cuda", "mps"):
        raise HeadsteerValueError(f"--device {short_repr(device)}: use cpu, cuda, cuda:N or mps")
    if not present:  # a name only (`plan`: nothing runs on it)
        return device
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise HeadsteerValueError(f"--device {short_repr(device)}: no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise HeadsteerValueError(
                f"--device {short_repr(device)}: only {torch.cuda.device_count()} CUDA devices"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise HeadsteerValueError(f"--device {short_repr(device)}: MPS is not available")
    return device


def check_dtype(dtype: str) -> torch.dtype:
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
    path: str,
    heads: Collection[tuple[int, int]],
    *,
    option: str = "--pasta-heads",
    geometry: tuple[int, int] | None = None,
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
