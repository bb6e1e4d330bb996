"""A small English text corpus for the Attention Lens (written for this project, no download).

`probes/data/corpus.jsonl` holds one `{"text": ...}` a line: short plain sentences built from
the fixed lists and templates below by `python -m probes.datasets.corpus` (seeded, so a rebuild
is byte-identical). They cover everyday facts, counting, days and months, simple stories and
repeated phrases, so that previous-token, induction and successor behaviour all occur.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

from heads._util.validation import check_int

__all__ = ["CORPUS_SEED", "build_corpus", "load_corpus"]

CORPUS_SEED = 20241201
_PEOPLE = [
    "Anna",
    "Ben",
    "Clara",
    "David",
    "Elena",
    "Farid",
    "Grace",
    "Hugo",
    "Iris",
    "Jonas",
    "Keiko",
    "Luis",
]
_PLACES = [
    "the market",
    "the library",
    "the station",
    "the beach",
    "the museum",
    "the garden",
    "the school",
    "the harbor",
    "the bakery",
    "the hospital",
]
_THINGS = [
    "a book",
    "an apple",
    "a red umbrella",
    "a small lamp",
    "a wooden chair",
    "a letter",
    "a bicycle",
    "a cup of tea",
    "a map",
    "a violin",
]
_VERBS = ["found", "bought", "carried", "painted", "borrowed", "fixed", "lost", "sold"]
_ADJ = ["quiet", "busy", "old", "bright", "cold", "warm", "narrow", "famous"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
_NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
_FACTS = [
    "Water boils at one hundred degrees Celsius at sea level.",
    "The sun rises in the east and sets in the west.",
    "A week has seven days and a year has twelve months.",
    "Paris is the capital of France and Berlin is the capital of Germany.",
    "Plants need light, water and air to grow.",
    "The moon goes around the earth about once a month.",
    "Bees make honey from the nectar of flowers.",
    "Ice is frozen water and steam is water as a gas.",
    "Most birds can fly, but penguins cannot.",
    "The heart pumps blood through the body.",
]


def _sentences(rng: random.Random) -> list[str]:
    out = list(_FACTS)
    for _ in range(120):
        p, q = rng.sample(_PEOPLE, 2)
        place, thing, verb, adj = (
            rng.choice(_PLACES),
            rng.choice(_THINGS),
            rng.choice(_VERBS),
            rng.choice(_ADJ),
        )
        day = rng.choice(_DAYS)
        out.append(
            rng.choice(
                [
                    f"On {day}, {p} {verb} {thing} at {place}.",
                    f"{p} met {q} near {place}, which was {adj} that morning.",
                    f"When {p} went to {place}, {q} gave {p} {thing}.",
                    f"{p} said that {place} is {adj} on {day}s, and {q} agreed.",
                    f"Yesterday {p} {verb} {thing}; today {q} {verb} it again.",
                ]
            )
        )
    for _ in range(40):
        i = rng.randrange(len(_DAYS) - 2)
        j = rng.randrange(len(_MONTHS) - 3)
        k = rng.randrange(len(_NUMBERS) - 3)
        out.append(
            rng.choice(
                [
                    f"The days go {', '.join(_DAYS[i : i + 3])} and then {_DAYS[i + 3 - 7 * (i + 3 >= 7)]}.",
                    f"After {_MONTHS[j]} comes {_MONTHS[j + 1]}, and after that {_MONTHS[j + 2]}.",
                    f"Count with me: {', '.join(_NUMBERS[k : k + 3])}, {_NUMBERS[k + 3]}.",
                ]
            )
        )
    for _ in range(40):
        p = rng.choice(_PEOPLE)
        thing = rng.choice(_THINGS)
        place = rng.choice(_PLACES)
        out.append(f"{p} left {thing} at {place}. Later, {p} went back to {place} to get {thing}.")
    rng.shuffle(out)
    return out


def build_corpus(path: str | Path | None = None) -> Path:
    """Write the corpus JSONL (default `probes/data/corpus.jsonl`); returns the path."""
    target = Path(path) if path is not None else Path(__file__).resolve().parents[1] / "data" / "corpus.jsonl"
    lines = [json.dumps({"text": s}) for s in _sentences(random.Random(CORPUS_SEED))]
    target.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return target


def load_corpus(n: int | None = None) -> list[str]:
    """The shipped corpus texts (the first `n`, at most, or all).

    Raises:
        ValueError: `n` < 1.
    """
    if n is not None:
        check_int("n", n, lo=1)
    text = resources.files("probes").joinpath("data/corpus.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line)["text"] for line in text.splitlines() if line.strip()]
    return rows if n is None else rows[:n]


if __name__ == "__main__":
    print(build_corpus())
