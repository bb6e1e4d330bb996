"""Shipped clean / corrupted prompt-pair sets for causal analysis (activation and path patching).

`probes/data/pairs/<name>.jsonl` holds one pair a line, built by `python -m probes.datasets.make_pairs`
(seeded, deterministic; see that module for how each set is made):

- `ioi`: indirect-object identification (Wang et al. 2022), 240 clean prompts from 15 templates
  (BABA and ABBA), each with an `"abc"` and an `"s_flip"` corruption (480 records).
- `colored_objects`: "On the desk, I see a red pen, ... What color is the cup? The cup is"
  (after Merullo et al. 2024), corrupted by asking about another object (240 pairs).
- `comp_mech`: competition of mechanisms (Ortu et al. 2024) from the `counterfact` task: the
  current value against the earlier one, corrupted by swapping them (200 pairs).

Every record has `id`, `split` ("train" / "test"), `clean`, `corrupted`, `answer` and
`counterfactual` (single tokens with a leading space for the embedded tokenizer; the two
prompts have the same token length), plus set-specific fields kept in `PromptPair.meta`.
"""

from __future__ import annotations

from importlib import resources

from heads._util.validation import check_int, short_repr
from heads.errors import HeadsteerValueError
from heads.scorers.patching.pairs import PromptPair, load_pairs

__all__ = ["CORRUPTIONS", "PAIR_SETS", "PAIR_SPLITS", "load_task_pairs", "pairs_path"]

PAIR_SETS = ("ioi", "colored_objects", "comp_mech")
PAIR_SPLITS = ("train", "test")
CORRUPTIONS = {"ioi": ("abc", "s_flip"), "colored_objects": ("object",), "comp_mech": ("swap",)}
"""Per set, its corruptions; the first one is the default."""


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise HeadsteerValueError(f"unknown {name} {short_repr(value)}: use one of {', '.join(allowed)}")
    return value


def pairs_path(name: str) -> str:
    """The path of the shipped JSONL file of set `name`.

    Raises:
        ValueError: unknown set name.
    """
    _check_choice("pair set", name, PAIR_SETS)
    return str(resources.files("probes").joinpath(f"data/pairs/{name}.jsonl"))


def load_task_pairs(
    name: str, split: str | None = "test", *, corruption: str | None = None, n: int | None = None
) -> list[PromptPair]:
    """The pairs of shipped set `name`, in file order.

    Args:
        name: one of `PAIR_SETS` ("ioi", "colored_objects", "comp_mech").
        split: "test" (default), "train", or None for both.
        corruption: for `ioi`, "abc" (default: the three names replaced by others) or "s_flip"
            (the second subject mention replaced by the indirect object), or "all"; the other
            sets have one corruption each (None or its name, or "all").
        n: keep the first `n` pairs, at most (None: all; a larger `n` than the set holds
            keeps every pair, as a list slice does).

    Raises:
        ValueError: unknown set, split or corruption, or `n` < 1.
    """
    _check_choice("pair set", name, PAIR_SETS)
    if split is not None:
        _check_choice("split", split, PAIR_SPLITS)
    kinds = CORRUPTIONS[name]
    if corruption is not None:
        _check_choice("corruption", corruption, (*kinds, "all"))
    if n is not None:
        check_int("n", n, lo=1)
    keep = kinds[0] if corruption is None else corruption
    pairs = load_pairs(pairs_path(name), split=split)
    if name == "ioi" and keep != "all":
        pairs = [p for p in pairs if p.meta.get("corruption") == keep]
    return pairs if n is None else pairs[:n]
