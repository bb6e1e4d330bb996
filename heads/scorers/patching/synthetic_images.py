"""Synthetic minimal image pairs: the same picture with one coloured square's colour changed.

A stand-in for NOTICE's semantic minimal pairs (Golovanevsky et al. 2024: two images that
differ in one attribute, the same question) that needs no data set: `minimal_image_pair`
draws a grey canvas with a few seeded distractor squares and one target square, whose colour
is the only difference between the clean and the corrupted image; `colour_pairs` turns such
pictures into `ImagePair`s asking for the target's colour (answer: the clean colour, as a
token with a leading space; counterfactual: the corrupted colour).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from heads._util.validation import check_int, short_repr
from heads.errors import HeadsteerValueError
from heads.scorers.patching.vision import ImagePair

__all__ = ["COLOURS", "colour_pairs", "minimal_image_pair"]

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 210, 30),
    "white": (250, 250, 250),
    "black": (10, 10, 10),
}
"""Named RGB colours of the target square (each name is one token with a leading space in the
SmolLM2 tokenizer: `" red"`, `" blue"`, ...)."""

_DISTRACTOR = (120, 90, 60)  # brown: not one of COLOURS, so the target is the only coloured square
_BACKGROUND = (128, 128, 128)


def _rgb(colour: str | Sequence[int], what: str) -> tuple[int, int, int]:
    if isinstance(colour, str):
        if colour not in COLOURS:
            raise HeadsteerValueError(
                f"{what} {short_repr(colour)} is not one of {sorted(COLOURS)} (or pass an RGB triple)"
            )
        return COLOURS[colour]
    vals = list(colour)
    if len(vals) != 3 or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255 for v in vals
    ):
        raise HeadsteerValueError(
            f"{what} must be a colour name or three ints 0..255, got {short_repr(colour)}"
        )
    return (vals[0], vals[1], vals[2])


def minimal_image_pair(
    size: int = 16,
    *,
    colour: str | Sequence[int] = "red",
    counterfactual: str | Sequence[int] = "blue",
    grid: int = 4,
    cell: tuple[int, int] | None = None,
    distractors: int = 2,
    seed: int = 0,
) -> tuple[Any, Any]:
    """A clean / corrupted pair of `size x size` RGB PIL images on a `grid x grid` layout.

    Both images hold the same grey canvas and `distractors` brown squares at seeded cells; the
    target square at `cell` (row, column; default a seeded free cell) is `colour` in the clean
    image and `counterfactual` in the corrupted one. Only the target cell's pixels differ.

    Args:
        size: side in pixels (default 16: the tiny test VLMs' input size); a multiple of `grid`.
        colour, counterfactual: names in `COLOURS` or RGB triples; must differ.
        grid: cells per side (default 4).
        cell: the target cell, or None for a seeded one.
        distractors: brown squares besides the target (default 2), `0 .. grid**2 - 1`.
        seed: seeds the cells chosen (default 0).

    Returns:
        `(clean, corrupted)` PIL images.

    Raises:
        ValueError: a size that is not a positive multiple of `grid`, equal colours, an unknown
            colour, a cell outside the grid, too many distractors.
    """
    from PIL import Image, ImageDraw

    grid = check_int("grid", grid, lo=1, hi=64)
    size = check_int("size", size, lo=grid, hi=4096)
    if size % grid:
        raise HeadsteerValueError(f"size {size} is not a multiple of grid {grid}")
    distractors = check_int("distractors", distractors, lo=0, hi=grid * grid - 1)
    a, b = _rgb(colour, "colour"), _rgb(counterfactual, "counterfactual")
    if a == b:
        raise HeadsteerValueError(f"colour and counterfactual are the same colour {a}: nothing would differ")
    rng = random.Random(seed)
    cells = [(r, c) for r in range(grid) for c in range(grid)]
    if cell is None:
        target = rng.choice(cells)
    else:
        if not (isinstance(cell, (tuple, list)) and len(cell) == 2 and all(isinstance(x, int) for x in cell)):
            raise HeadsteerValueError(f"cell must be (row, column) ints, got {short_repr(cell)}")
        target = (int(cell[0]), int(cell[1]))
        if target not in cells:
            raise HeadsteerValueError(f"cell {target} is outside the {grid}x{grid} grid")
    others = rng.sample([c for c in cells if c != target], distractors)
    step = size // grid

    def draw(fill: tuple[int, int, int]) -> Any:
        im = Image.new("RGB", (size, size), _BACKGROUND)
        d = ImageDraw.Draw(im)
        for (r, c), rgb in [*[(o, _DISTRACTOR) for o in others], (target, fill)]:
            d.rectangle([c * step, r * step, (c + 1) * step - 1, (r + 1) * step - 1], fill=rgb)
        return im

    return draw(a), draw(b)


def colour_pairs(
    n: int,
    *,
    size: int = 16,
    colours: Sequence[str] = ("red", "blue", "green", "yellow"),
    prompt: str = "What colour is the square? The square is",
    seed: int = 0,
) -> list[ImagePair]:
    """`n` vision pairs asking for the target square's colour (`minimal_image_pair`).

    Pair i draws two different colours from `colours` and a target cell (seeded by `seed`);
    `answer` is `" " + clean colour`, `counterfactual` `" " + corrupted colour`, `meta` holds
    both colours, the cell index and the seed.

    Raises:
        ValueError: `n < 1`, fewer than two colours, an unknown colour.
    """
    n = check_int("n", n, lo=1, hi=100_000)
    names = list(colours)
    if len(set(names)) < 2:
        raise HeadsteerValueError(f"colours needs at least two different names, got {short_repr(names)}")
    for c in names:
        _rgb(c, "colour")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.sample(names, 2)
        s = rng.randrange(2**31)
        clean, corrupted = minimal_image_pair(size, colour=a, counterfactual=b, seed=s)
        out.append(
            ImagePair(
                prompt,
                clean,
                corrupted,
                f" {a}",
                f" {b}",
                {"colour": a, "counterfactual": b, "seed": s, "index": i},
            )
        )
    return out
