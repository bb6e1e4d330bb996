"""Build the clean / corrupted prompt-pair sets in `probes/data/pairs/` (written for this project).

Run `python -m probes.datasets.make_pairs` to (re)write the JSONL files; the build is seeded and
deterministic, so re-running gives byte-identical files (a test rebuilds them and compares).
Every pair is checked against the embedded SmolLM2 tokenizer: the clean and the corrupted
prompt have the same token length (positions aligned) and the answer and counterfactual
strings are single tokens with their leading space.

Sets (see `probes/datasets/pairs.py` for the loader):

- `ioi` (indirect-object identification; Wang et al. 2022, Sec. 2): 15 templates of our own
  wording in the BABA and ABBA orders ("Then, B and A went to the park. B gave a ball to" ->
  A), each clean prompt with two corruptions: `"abc"` (the three name slots replaced by three
  other names, Wang et al.'s ABC distribution) and `"s_flip"` (the second subject mention
  replaced by the indirect object, which flips the right answer). Answer = the indirect
  object, counterfactual = the subject.
- `colored_objects` (after BIG-bench's reasoning_about_colored_objects, as used by Merullo et
  al. 2024): three coloured objects on a surface and "What color is the X?"; the corruption
  asks about another object of the list. Answer = X's colour, counterfactual = the other
  object's colour. One phrasing (`template` 0).
- `comp_mech` (competition of mechanisms; Ortu et al. 2024), built from the project's
  `counterfact` task (`probes/data/tasks/counterfact.jsonl`): "Previously, S was O. Currently,
  S is N. S is" -> N; the corruption swaps the two values. Answer = the current value N,
  counterfactual = the earlier value O. `template`: the cue's phrasing (`COMP_MECH_PHRASES`).
  The subjects are fictional, so the competing mechanism is the earlier in-context statement,
  not knowledge stored in the weights.

Every record also carries `positions`: the named positions of its clean prompt as `[start, end]`
character spans (`encode_pairs` maps each to the token that ends it; the corrupted prompt is
aligned token by token). IOI: `IO` (the indirect object's mention), `S1` and `S2` (the
subject's first and second mention); Colored Objects: `COLOR` and `OBJECT` (the queried
object's colour and name in the listing), `QUERY` (the object named in the question);
comp_mech: `OLD` and `NEW` (the earlier and the current value in the context). `END`, the last
token, is every pair's without being stored.
"""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError

__all__ = [
    "OUT_DIR",
    "PAIR_SETS",
    "SEED",
    "build_colored_objects",
    "build_comp_mech",
    "build_ioi",
    "build_pairs",
    "dump_jsonl",
    "main",
]

SEED = 20240923
OUT_DIR = Path(__file__).resolve().parents[1] / "data" / "pairs"
PAIR_SETS = ("ioi", "colored_objects", "comp_mech")

# --------------------------------------------------------------------------- word lists

# Common first names; only those that are one token after a space are used.
NAMES = (
    "Mary", "John", "Tom", "James", "Anna", "Sarah", "Paul", "Mark", "David", "Michael", "Lisa",
    "Kate", "Emma", "Jack", "Alex", "Sam", "Ben", "Peter", "Mike", "Chris", "Laura", "Rachel", "Amy",
    "Jane", "Steve", "Brian", "Kevin", "Jason", "Eric", "Adam", "Ryan", "Daniel", "Robert", "Richard",
    "Thomas", "Charles", "Joseph", "George", "Edward", "Henry", "Frank", "Luke", "Simon", "Max", "Leo",
    "Anne", "Alice", "Lucy", "Helen", "Grace", "Rose", "Ruth", "Julia", "Claire", "Susan", "Linda",
    "Karen", "Nancy", "Emily", "Hannah", "Olivia", "Sophie", "Ella", "Jessica", "Tim", "Dan", "Joe",
    "Bob", "Bill", "Jim", "Fred", "Carl", "Scott", "Matt", "Nick", "Greg", "Andrew", "Tony", "Martin",
    "Oliver", "Harry", "Jacob", "William", "Kelly", "Amanda", "Nicole", "Victoria", "Sophia", "Diana",
    "Monica", "Patrick", "Sean", "Ian", "Neil", "Roger", "Larry", "Gary", "Walter", "Arthur",
)  # fmt: skip
PLACES = (
    "store", "garden", "school", "park", "restaurant", "office", "hospital", "station", "house",
    "library", "kitchen", "beach", "market", "church", "museum", "hotel", "lake", "river", "forest",
    "farm", "zoo", "shop",
)  # fmt: skip
OBJECTS = (
    "ring", "bone", "basketball", "necklace", "snack", "computer", "book", "bag", "ball", "box", "pen",
    "cup", "key", "hat", "phone", "card", "flower", "letter", "gift", "coin", "toy", "map", "watch",
    "cake",
)  # fmt: skip

# IOI templates in our own words: {X} and {Y} are the first two name slots, {S} the second
# mention of the subject; BABA puts the subject first (X = S), ABBA second (Y = S).
IOI_TEMPLATES = (
    "Then, {X} and {Y} walked to the {PLACE}. {S} handed a {OBJECT} to",
    "Later, {X} and {Y} spent the afternoon at the {PLACE}. {S} passed a {OBJECT} to",
    "Yesterday, {X} and {Y} were busy at the {PLACE}. {S} decided to give a {OBJECT} to",
    "Then, {X} and {Y} planned a trip to the {PLACE}. {S} wanted to bring a {OBJECT} to",
    "Then, {X} and {Y} had a long chat, and afterwards {S} wrote a letter to",
    "After {X} and {Y} arrived at the {PLACE}, {S} gave a {OBJECT} to",
    "When {X} and {Y} found a {OBJECT} at the {PLACE}, {S} decided to give it to",
    "While {X} and {Y} were waiting at the {PLACE}, {S} offered a {OBJECT} to",
    "While {X} and {Y} were travelling to the {PLACE}, {S} showed a {OBJECT} to",
    "After lunch, {X} and {Y} went to the {PLACE}. {S} threw a {OBJECT} to",
    "Afterwards, {X} and {Y} cleaned the {PLACE}. {S} sold a {OBJECT} to",
    "This morning, {X} and {Y} visited the {PLACE}. {S} lent a {OBJECT} to",
    "Then, {X} and {Y} had a small argument. Afterwards {S} apologised to",
    "At the {PLACE}, {X} and {Y} bought a {OBJECT}. {S} gave it to",
    "Friends {X} and {Y} found a {OBJECT} near the {PLACE}. {S} sent it to",
)
IOI_PER_TEMPLATE = 16  # clean prompts per template (half BABA, half ABBA): 240 in all

COLORS = (
    "red", "blue", "green", "yellow", "black", "white", "orange", "purple", "pink", "brown", "grey",
    "silver", "gold",
)  # fmt: skip
COLORED_THINGS = (
    "pen", "cup", "book", "key", "hat", "ball", "box", "bowl", "plate", "fork", "spoon", "lamp", "vase",
    "clock", "phone", "bag", "shoe", "sock", "shirt", "card", "coin", "ring", "bottle", "pencil",
    "chair", "candle", "notebook", "glass",
)  # fmt: skip
SURFACES = ("table", "desk", "floor", "shelf", "counter", "bed", "sofa", "chair")
N_COLORED = 240
N_OBJECTS_SHOWN = 3
COLORED_TEMPLATE = "On the {surface}, I see {items}. What color is the {query}? The {query} is"


# --------------------------------------------------------------------------- helpers


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def _single(tokenizer: Any, words: Sequence[str]) -> tuple[str, ...]:
    """The words that are one token after a space."""
    return tuple(w for w in words if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1)


def _check_pair(tokenizer: Any, row: dict) -> None:
    """Raise unless the two prompts align on token ids and both answers are single tokens."""
    a, b = _ids(tokenizer, row["clean"]), _ids(tokenizer, row["corrupted"])
    if len(a) != len(b):
        raise HeadsteerValueError(
            f"{row['id']}: clean is {len(a)} tokens, corrupted is {len(b)} tokens "
            f"({short_repr(row['clean'])})"
        )
    for key in ("answer", "counterfactual"):
        if len(tokenizer(row[key], add_special_tokens=False)["input_ids"]) != 1:
            raise HeadsteerValueError(f"{row['id']}: {key} {short_repr(row[key])} is not one token")
    if row["answer"] == row["counterfactual"]:
        raise HeadsteerValueError(f"{row['id']}: answer equals counterfactual")
    for name, (a, b) in row.get("positions", {}).items():
        word = row["clean"][a:b]
        if not (0 <= a < b <= len(row["clean"])) or word != word.strip() or not word:
            raise HeadsteerValueError(
                f"{row['id']}: position {name} [{a}, {b}] is not a word of the clean prompt"
            )


def _split_by_stratum(strata: Sequence[str], rng: random.Random) -> list[str]:
    """Half "train", half "test" within every stratum (seeded shuffle; odd extras go to test)."""
    out = [""] * len(strata)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(strata):
        groups[s].append(i)
    for key in sorted(groups):
        idx = groups[key][:]
        rng.shuffle(idx)
        for j, i in enumerate(idx):
            out[i] = "train" if j < len(idx) // 2 else "test"
    return out


def _word_spans(text: str, word: str) -> list[list[int]]:
    """`[start, end]` character spans of every whole-word occurrence of `word` in `text`."""
    return [[m.start(), m.end()] for m in re.finditer(rf"(?<!\w){re.escape(word)}(?!\w)", text)]


def _only(spans: list[list[int]], k: int, what: str, text: str) -> list[list[int]]:
    if len(spans) != k:
        raise HeadsteerValueError(f"{what} occurs {len(spans)} times, not {k}, in {short_repr(text)}")
    return spans


def _distinct(rng: random.Random, pool: Sequence[str], k: int, exclude: Sequence[str] = ()) -> list[str]:
    return rng.sample([x for x in pool if x not in exclude], k)


# --------------------------------------------------------------------------- IOI


def build_ioi(rng: random.Random, tokenizer: Any) -> list[dict]:
    """IOI pairs: every clean prompt twice, with the `"abc"` and the `"s_flip"` corruption.

    The ids are `ioi-<nnn>-abc` / `ioi-<nnn>-s_flip` (nnn = the clean prompt); both rows of a
    clean prompt share its split (half train, half test within each template and order).
    """
    names, places, objects = (
        _single(tokenizer, NAMES),
        _single(tokenizer, PLACES),
        _single(tokenizer, OBJECTS),
    )
    cleans, strata = [], []
    for t, template in enumerate(IOI_TEMPLATES):
        for j in range(IOI_PER_TEMPLATE):
            order = "BABA" if j % 2 == 0 else "ABBA"
            io, s = _distinct(rng, names, 2)
            c, d, e = _distinct(rng, names, 3, exclude=(io, s))
            slots = {"PLACE": rng.choice(places), "OBJECT": rng.choice(objects)}
            x, y = (s, io) if order == "BABA" else (io, s)
            cx, cy = (c, d)
            clean = template.format(X=x, Y=y, S=s, **slots)
            abc = template.format(X=cx, Y=cy, S=e, **slots)
            flip = template.format(X=x, Y=y, S=io, **slots)
            cleans.append((t, order, io, s, clean, abc, flip, slots))
            strata.append(f"{t}-{order}")
    splits = _split_by_stratum(strata, rng)
    rows = []
    for n, ((t, order, io, s, clean, abc, flip, slots), split) in enumerate(zip(cleans, splits, strict=True)):
        (io_at,) = _only(_word_spans(clean, io), 1, f"IO {io}", clean)
        s1_at, s2_at = _only(_word_spans(clean, s), 2, f"S {s}", clean)
        positions = {"IO": io_at, "S1": s1_at, "S2": s2_at}
        for corruption, corrupted in (("abc", abc), ("s_flip", flip)):
            rows.append(
                {
                    "id": f"ioi-{n:03d}-{corruption}",
                    "split": split,
                    "clean": clean,
                    "corrupted": corrupted,
                    "answer": " " + io,
                    "counterfactual": " " + s,
                    "template": t,
                    "order": order,
                    "corruption": corruption,
                    "io": io,
                    "s": s,
                    **{k.lower(): v for k, v in slots.items()},
                    "positions": positions,
                }
            )
    return rows


# --------------------------------------------------------------------------- colored objects


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def build_colored_objects(rng: random.Random, tokenizer: Any) -> list[dict]:
    """Colored Objects pairs: the corrupted prompt asks about another object of the list.

    Half train, half test within each queried slot (first, second, third object).
    """
    colors, things = _single(tokenizer, COLORS), _single(tokenizer, COLORED_THINGS)
    items: list[dict] = []
    strata: list[str] = []
    seen: set[tuple] = set()
    while len(items) < N_COLORED:
        k = len(items) % N_OBJECTS_SHOWN
        objs = _distinct(rng, things, N_OBJECTS_SHOWN)
        cols = _distinct(rng, colors, N_OBJECTS_SHOWN)
        other = rng.choice([i for i in range(N_OBJECTS_SHOWN) if i != k])
        surface = rng.choice(SURFACES)
        shown = [f"{_article(c)} {c} {o}" for c, o in zip(cols, objs, strict=True)]
        listing = ", ".join(shown[:-1]) + " and " + shown[-1]
        key = (surface, tuple(objs), tuple(cols), k)
        if key in seen:
            continue
        seen.add(key)
        clean = COLORED_TEMPLATE.format(surface=surface, items=listing, query=objs[k])
        corrupted = COLORED_TEMPLATE.format(surface=surface, items=listing, query=objs[other])
        mention = clean.index(f" {cols[k]} {objs[k]}") + 1  # the queried object in the listing
        question = clean.index(f"What color is the {objs[k]}?") + len("What color is the ")
        positions = {
            "COLOR": [mention, mention + len(cols[k])],
            "OBJECT": [mention + len(cols[k]) + 1, mention + len(cols[k]) + 1 + len(objs[k])],
            "QUERY": [question, question + len(objs[k])],
        }
        items.append(
            {
                "clean": clean,
                "corrupted": corrupted,
                "answer": " " + cols[k],
                "counterfactual": " " + cols[other],
                "template": 0,  # one phrasing (COLORED_TEMPLATE)
                "query": objs[k],
                "query_slot": k,
                "other": objs[other],
                "surface": surface,
                "positions": positions,
            }
        )
        strata.append(str(k))
    splits = _split_by_stratum(strata, rng)
    return [
        {"id": f"colored_objects-{i:03d}", "split": split, **item}
        for i, (item, split) in enumerate(zip(items, splits, strict=True))
    ]


# --------------------------------------------------------------------------- comp-mech


def _counterfact_rows() -> list[dict]:
    path = Path(__file__).resolve().parents[1] / "data" / "tasks" / "counterfact.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


COMP_MECH_PHRASES = (
    "is located in", "the official language of", "the capital of", "the headquarters of", "works for",
    "plays the", "plays", "is a citizen of",
)  # fmt: skip
"""The cue phrasings of the counterfact relations (`make_tasks._counterfact_relations`): a pair's
`template` is the index of the first one its cue contains."""


def _comp_mech_template(cue: str) -> int:
    for i, phrase in enumerate(COMP_MECH_PHRASES):
        if phrase in cue.lower():
            return i
    raise HeadsteerValueError(f"comp_mech: no known phrasing in the cue {short_repr(cue)}")


def build_comp_mech(rng: random.Random, tokenizer: Any) -> list[dict]:
    """Competition-of-mechanisms pairs from the `counterfact` task: the corruption swaps the
    earlier and the current value in the two context sentences (rows whose swap changes the
    token length are skipped). The split is the counterfact row's ("validation" -> "train")."""
    del rng  # the set is a fixed function of the counterfact task
    rows = []
    for r in _counterfact_rows():
        new, old = r["choices"]
        prompt = r["prompt"]
        first, rest = prompt.split(". Currently, ", 1)
        cur, cue = rest.split(". ", 1)
        if not (first.endswith(" " + old) and cur.endswith(" " + new)):
            continue
        corrupted = f"{first[: -len(old)]}{new}. Currently, {cur[: -len(new)]}{old}. {cue}"
        old_at = len(first) - len(old)
        new_at = len(first) + len(". Currently, ") + len(cur) - len(new)
        row = {
            "id": f"comp_mech-{r['id'].rsplit('-', 1)[1]}",
            "split": "test" if r["split"] == "test" else "train",
            "clean": prompt,
            "corrupted": corrupted,
            "answer": " " + new,
            "counterfactual": " " + old,
            "template": _comp_mech_template(cue),
            "source_id": r["id"],
            "positions": {"OLD": [old_at, old_at + len(old)], "NEW": [new_at, new_at + len(new)]},
        }
        if len(_ids(tokenizer, prompt)) != len(_ids(tokenizer, corrupted)):
            continue
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- build / write


def build_pairs(tokenizer: Any, seed: int = SEED) -> dict[str, list[dict]]:
    """Every pair set as rows (dicts in file order); each set has its own seeded stream.

    Raises:
        ValueError: a pair whose prompts differ in token length, a multi-token answer, a
            duplicate id or clean/corrupted record, or a set with fewer than 100 pairs per
            corruption.
    """
    sets = {
        "ioi": build_ioi(random.Random(f"{seed}-ioi"), tokenizer),
        "colored_objects": build_colored_objects(random.Random(f"{seed}-colored_objects"), tokenizer),
        "comp_mech": build_comp_mech(random.Random(f"{seed}-comp_mech"), tokenizer),
    }
    for name, rows in sets.items():
        for row in rows:
            _check_pair(tokenizer, row)
        ids = [r["id"] for r in rows]
        if len(set(ids)) != len(ids):
            raise HeadsteerValueError(f"{name}: duplicate ids")
        by_corruption: dict[str, int] = defaultdict(int)
        for r in rows:
            by_corruption[r.get("corruption", "")] += 1
        if min(by_corruption.values()) < 100:
            raise HeadsteerValueError(f"{name}: fewer than 100 pairs {dict(by_corruption)}")
    return sets


def dump_jsonl(rows: Sequence[dict]) -> str:
    """The JSONL text of `rows` (one compact object a line, trailing newline)."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(out_dir: Path = OUT_DIR) -> None:
    """Write `<out_dir>/<set>.jsonl` for every set and print the split sizes."""
    from heads import load_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in build_pairs(load_tokenizer()).items():
        (out_dir / f"{name}.jsonl").write_text(dump_jsonl(rows), encoding="utf-8", newline="\n")
        sizes = {s: sum(r["split"] == s for r in rows) for s in ("train", "test")}
        print(f"{name}: {len(rows)} pairs {sizes}")


if __name__ == "__main__":
    main()
