"""Build the evaluation task sets in `probes/data/tasks/` (written for this project).

Run `python -m probes.datasets.make_tasks` to (re)write the six JSONL files; the build is seeded and
deterministic, so re-running gives byte-identical files. Every example is assembled from the
hand-written lists of `probes.datasets.task_words` and fixed templates; the people, landmarks,
provinces, countries and firms named are fictional (real cities, countries, languages and
companies appear only as values), except in `context_qa`, whose passages contradict real,
well-known facts.
Choice tasks are checked against the embedded tokenizer: the first token of
`" " + choice` differs between the choices of every example.

See `probes/datasets/tasks.py` for the row format, the splits and the loader.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from probes.datasets.task_words import (
    BIO_CITIES,
    BIO_OCCUPATIONS,
    CHOICE_CITIES,
    COMPANIES,
    CONTEXT_CAPITALS,
    CONTEXT_FILLERS,
    CONTEXT_LANDMARKS,
    CONTEXT_LANGUAGES,
    CONTEXT_SOURCES,
    COUNTRIES,
    DEMO_NEGATIVE,
    DEMO_POSITIVE,
    FEMALE_NAMES,
    FICTIONAL_COUNTRIES,
    FIRM_KINDS,
    FOODS,
    HOBBIES,
    INSTRUMENTS,
    LANDMARKS,
    LANGUAGES,
    MALE_NAMES,
    OCCUPATION_VOCAB,
    OCCUPATIONS,
    PET_NAMES,
    PETS,
    PLACE_STEMS,
    RELATIVES,
    REVIEW_DOMAINS,
    SENTIMENT_CHOICES,
    SPORTS,
    STUDY_SUBJECTS,
    SURNAMES,
    VOLUNTEER_PLACES,
)

__all__ = ["N_EXAMPLES", "OUT_DIR", "SEED", "build_tasks", "check_choices", "dump_jsonl", "main"]


SEED = 20240611
N_EXAMPLES = 200
N_TRAIN, N_VALIDATION = 90, 30
OUT_DIR = Path(__file__).resolve().parents[1] / "data" / "tasks"

JSON_INSTRUCTION = 'Answer in JSON format with the keys "name" and "occupation".'
PRONOUN_INSTRUCTION = (
    "Substitute 'she' and 'he' with 'they' and generate the occupation of {name} after changing pronouns."
)


def _a(word: str) -> str:
    """`word` with its indefinite article ("a nurse", "an architect")."""
    return ("an " if word[0].lower() in "aeiou" else "a ") + word


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _first_token(tokenizer: Any, text: str) -> int:
    first: int = tokenizer(" " + text, add_special_tokens=False)["input_ids"][0]
    return first


def check_choices(tokenizer: Any, choices: Sequence[str]) -> None:
    """Check that the first tokens of `" " + choice` are pairwise distinct.

    Raises:
        ValueError: two choices share their first token (both named).
    """
    seen: dict[int, str] = {}
    for choice in choices:
        tid = _first_token(tokenizer, choice)
        if tid in seen:
            raise HeadsteerValueError(
                f"choices {short_repr(seen[tid])} and {short_repr(choice)} share their first token {tid}"
            )
        seen[tid] = choice


def _single_token(tokenizer: Any, words: Sequence[str]) -> tuple[str, ...]:
    """The words that are one token with a leading space (the preferred choice candidates)."""
    return tuple(w for w in words if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1)


class _People:
    """Draws fictional people with unique full names: `(full, first, pronoun)` with pronoun "she"/"he"."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def draw(self, gender: str | None = None) -> tuple[str, str, str]:
        gender = gender or self.rng.choice("fm")
        first_names = FEMALE_NAMES if gender == "f" else MALE_NAMES
        while True:
            first, last = self.rng.choice(first_names), self.rng.choice(SURNAMES)
            full = f"{first} {last}"
            if full not in self.used:
                self.used.add(full)
                return full, first, "she" if gender == "f" else "he"


def _pronouns(pronoun: str) -> dict[str, str]:
    """Template slots: p/P subject, q/Q possessive, o object (she/She, her/Her, her)."""
    possessive, obj = ("her", "her") if pronoun == "she" else ("his", "him")
    return {"p": pronoun, "P": _cap(pronoun), "q": possessive, "Q": _cap(possessive), "o": obj}


def _assign_splits(strata: Sequence[str], rng: random.Random) -> list[str]:
    """Deterministic stratified splits: 90 train, 30 validation, the rest test.

    Indices are shuffled within each stratum and interleaved round-robin over the strata
    (sorted), so each split holds the strata in (about) their overall proportions.
    """
    groups: dict[str, list[int]] = defaultdict(list)
    for i, key in enumerate(strata):
        groups[key].append(i)
    queues = []
    for key in sorted(groups):
        idx = groups[key][:]
        rng.shuffle(idx)
        queues.append(idx)
    order: list[int] = []
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    splits = [""] * len(strata)
    for rank, i in enumerate(order):
        splits[i] = "train" if rank < N_TRAIN else "validation" if rank < N_TRAIN + N_VALIDATION else "test"
    return splits


def _rows(
    task: str,
    items: list[dict],
    strata: Sequence[str],
    rng: random.Random,
    *,
    chat: bool,
    scoring: str,
) -> list[dict]:
    """Full rows (fixed key order) from per-example dicts, with ids and splits."""
    splits = _assign_splits(strata, rng)
    rows = []
    for i, (item, split) in enumerate(zip(items, splits, strict=True)):
        rows.append(
            {
                "id": f"{task}-{i:03d}",
                "split": split,
                "prompt": item["prompt"],
                "emphasize": item.get("emphasize"),
                "target": item.get("target"),
                "choices": item.get("choices"),
                "label": item.get("label"),
                "fields": item.get("fields"),
                "chat": chat,
                "scoring": scoring,
            }
        )
    return rows


def _biography(
    rng: random.Random, people: _People, full: str, first: str, pronoun: str, occupation: str
) -> str:
    """A 4-6 sentence biography of a fictional person that states name and occupation."""
    s = _pronouns(pronoun)
    city, city2 = rng.sample(BIO_CITIES, 2)
    opening = rng.choice(
        (
            f"{full} is {_a(occupation)} who lives in {city}.",
            f"{full} works as {_a(occupation)} in {city}.",
            f"Born in {city}, {full} has worked as {_a(occupation)} for {rng.randint(3, 25)} years.",
            f"{full} has been {_a(occupation)} since {rng.randint(1995, 2020)}.",
        )
    )
    relative, rel_gender = rng.choice(RELATIVES)
    other_first = first
    while other_first == first:  # the relative's full name is reserved, never reused
        _, other_first, _ = people.draw(rel_gender)
    other_occ = rng.choice([o for o in BIO_OCCUPATIONS if o != occupation])
    lang, lang2 = rng.sample(LANGUAGES, 2)
    details = [
        f"{s['P']} grew up in {city2} and moved house several times as a child.",
        f"{s['Q']} {relative}, {other_first}, is {_a(other_occ)} in {rng.choice(BIO_CITIES)}.",
        f"In {s['q']} free time, {s['p']} enjoys {rng.choice(HOBBIES)}.",
        f"{s['P']} speaks {lang} and {lang2}.",
        f"{s['P']} has a {rng.choice(PETS)} called {rng.choice(PET_NAMES)}.",
        f"On weekends, {s['p']} volunteers at {rng.choice(VOLUNTEER_PLACES)}.",
        f"{s['Q']} favourite food is {rng.choice(FOODS)}.",
        f"{s['P']} studied {rng.choice(STUDY_SUBJECTS)} at a university in {city2}.",
        f"{s['P']} is saving up for a trip to {rng.choice(COUNTRIES)}.",
    ]
    return " ".join([opening, *rng.sample(details, rng.randint(3, 5))])


def _bio_task(task: str, rng: random.Random, instruction: Callable[[str], str], target: str) -> list[dict]:
    people = _People(rng)
    items, strata = [], []
    for i in range(N_EXAMPLES):
        full, first, pronoun = people.draw("f" if i % 2 == 0 else "m")
        occupation = BIO_OCCUPATIONS[i % len(BIO_OCCUPATIONS)]
        bio = _biography(rng, people, full, first, pronoun, occupation)
        instr = instruction(full)
        items.append(
            {
                "prompt": f"{bio} {instr}",
                "emphasize": instr,
                "target": target,
                "fields": {"name": full, "occupation": occupation},
            }
        )
        strata.append(pronoun)
    return _rows(task, items, strata, rng, chat=True, scoring="generate")


def build_json_format(rng: random.Random) -> list[dict]:
    """json_format: biography + the JSON instruction; a good answer starts with "{"."""
    return _bio_task("json_format", rng, lambda _name: JSON_INSTRUCTION, "{")


def build_pronoun_change(rng: random.Random) -> list[dict]:
    """pronoun_change: biography + the instruction to rewrite she/he as they."""
    return _bio_task("pronoun_change", rng, lambda name: PRONOUN_INSTRUCTION.format(name=name), "They")


def build_occupation(rng: random.Random, tokenizer: Any) -> list[dict]:
    """occupation: BiasBios-style; the first sentence states the occupation, then distractors."""
    check_choices(tokenizer, OCCUPATIONS)
    people = _People(rng)
    items, strata = [], []
    for i in range(N_EXAMPLES):
        label = i % len(OCCUPATIONS)
        occupation = OCCUPATIONS[label]
        full, first, pronoun = people.draw()
        s = _pronouns(pronoun)
        city, city2 = rng.sample(BIO_CITIES, 2)
        lead = rng.choice(
            (
                f"{full} is {_a(occupation)} based in {city}.",
                f"{full} is {_a(occupation)} who lives in {city}.",
                f"{full} works as {_a(occupation)} in {city}.",
            )
        )
        others = rng.sample([o for o in OCCUPATIONS if o != occupation], 5)
        vocab = [rng.choice(OCCUPATION_VOCAB[o]) for o in others]
        relative, _ = rng.choice(RELATIVES)
        trade = [
            f"{s['P']} grew up next door to a family of {others[0]}s in {city2}.",
            f"{s['Q']} {relative} is {_a(others[1])} who often talks about {vocab[1]}.",
            f"At dinner parties, {s['p']} likes to ask guests about {vocab[2]}.",
            f"{s['P']} recently read a long magazine article about {vocab[3]}.",
            f"Last spring, {s['p']} attended a charity dinner hosted by a local {others[4]}.",
            f"{s['Q']} best friend from school sends {s['o']} funny stories about {vocab[0]}.",
        ]
        plain = [
            f"In {s['q']} spare time, {s['p']} enjoys {rng.choice(HOBBIES)}.",
            f"{s['P']} has a {rng.choice(PETS)} called {rng.choice(PET_NAMES)}.",
            f"{s['P']} is saving up for a trip to {rng.choice(COUNTRIES)}.",
        ]
        n = rng.randint(3, 5)
        n_trade = rng.randint(2, n)
        details = rng.sample(trade, n_trade) + rng.sample(plain, n - n_trade)
        rng.shuffle(details)
        items.append(
            {
                "prompt": " ".join([lead, *details, f"{first}'s occupation is"]),
                "emphasize": lead,
                "choices": list(OCCUPATIONS),
                "label": label,
            }
        )
        strata.append(occupation)
    return _rows("occupation", items, strata, rng, chat=False, scoring="choice")


def _counterfact_relations(tokenizer: Any) -> list[tuple[str, str, str, str, tuple[str, ...]]]:
    """(kind, subject kind, past template, present template, single-token values)."""
    cities = _single_token(tokenizer, CHOICE_CITIES)
    countries = _single_token(tokenizer, COUNTRIES)
    return [
        ("located_city", "landmark", "{s} was located in", "{s} is located in", cities),
        ("located_country", "landmark", "{s} was located in", "{s} is located in", countries),
        ("official_language", "country", "the official language of {s} was",
         "the official language of {s} is", _single_token(tokenizer, LANGUAGES)),
        ("capital", "province", "the capital of {s} was", "the capital of {s} is", cities),
        ("headquarters", "firm", "the headquarters of {s} were in", "the headquarters of {s} are in", cities),
        ("employer", "person", "{s} worked for", "{s} works for", _single_token(tokenizer, COMPANIES)),
        ("instrument", "person", "{s} played the", "{s} plays the", _single_token(tokenizer, INSTRUMENTS)),
        ("sport", "person", "{s} played", "{s} plays", _single_token(tokenizer, SPORTS)),
        ("citizenship", "person", "{s} was a citizen of", "{s} is a citizen of", countries),
    ]  # fmt: skip


def _subject(rng: random.Random, kind: str, people: _People, used: set[str]) -> str:
    if kind == "person":
        return people.draw()[0]
    while True:
        stem = rng.choice(PLACE_STEMS)
        if kind == "landmark":
            subject = f"the {stem} {rng.choice(LANDMARKS)}"
        elif kind == "province":
            subject = f"the {stem} {rng.choice(('Province', 'Region', 'District'))}"
        elif kind == "firm":
            subject = f"{stem} {rng.choice(FIRM_KINDS)}"
        else:
            subject = rng.choice(FICTIONAL_COUNTRIES)
        if subject not in used:
            used.add(subject)
            return subject


def build_counterfact(rng: random.Random, tokenizer: Any) -> list[dict]:
    """counterfact: an old and a new fact about a fictional subject, then a completion cue."""
    relations = _counterfact_relations(tokenizer)
    people, used = _People(rng), set[str]()
    items: list[dict] = []
    strata: list[str] = []
    for i in range(N_EXAMPLES):
        kind, subject_kind, past, present, values = relations[i % len(relations)]
        subject = _subject(rng, subject_kind, people, used)
        while True:
            old, new = rng.sample(values, 2)
            if _first_token(tokenizer, old) != _first_token(tokenizer, new):
                break
        now = present.format(s=subject)
        current = f"Currently, {now} {new}."
        items.append(
            {
                "prompt": f"Previously, {past.format(s=subject)} {old}. {current} {_cap(now)}",
                "emphasize": current,
                "choices": [new, old],
                "label": 0,
            }
        )
        strata.append(kind)
    return _rows("counterfact", items, strata, rng, chat=False, scoring="choice")


def _review_pool() -> dict[int, list[str]]:
    """All composed query reviews by label (0 positive, 1 negative), in a fixed order."""
    pool: dict[int, list[str]] = {0: [], 1: []}
    for subjects, positive, negative in REVIEW_DOMAINS.values():
        for label, predicates in ((0, positive), (1, negative)):
            pool[label].extend(f"{subj} {pred}" for subj in subjects for pred in predicates)
    return pool


def build_sentiment(rng: random.Random, tokenizer: Any) -> list[dict]:
    """sentiment: 4 balanced demonstrations (2 per label, shuffled), then the query review."""
    check_choices(tokenizer, SENTIMENT_CHOICES)
    pool = _review_pool()
    labels = [i % 2 for i in range(N_EXAMPLES)]
    queries = {label: rng.sample(pool[label], labels.count(label)) for label in (0, 1)}
    items = []
    for label in labels:
        query = queries[label].pop()
        demos = [(d, 0) for d in rng.sample(DEMO_POSITIVE, 2)] + [
            (d, 1) for d in rng.sample(DEMO_NEGATIVE, 2)
        ]
        rng.shuffle(demos)
        shots = "".join(f"Review: {d}\nSentiment: {SENTIMENT_CHOICES[y]}\n\n" for d, y in demos)
        items.append(
            {
                "prompt": f"{shots}Review: {query}\nSentiment:",
                "emphasize": None,
                "choices": list(SENTIMENT_CHOICES),
                "label": label,
            }
        )
    return _rows(
        "sentiment", items, [SENTIMENT_CHOICES[y] for y in labels], rng, chat=False, scoring="choice"
    )


CONTEXT_INSTRUCTION = "Answer the question using only the passage, even if it differs from what you know."


def _context_relations(tokenizer: Any) -> list[tuple[str, tuple, str, str, str]]:
    """(kind, facts, statement, question, answer cue) with `{s}` the subject and `{v}` the value."""
    cities = tuple(sorted({v for _, v in CONTEXT_CAPITALS + CONTEXT_LANDMARKS}))
    langs = tuple(sorted({v for _, v in CONTEXT_LANGUAGES}))
    keep_c, keep_l = set(_single_token(tokenizer, cities)), set(_single_token(tokenizer, langs))
    return [
        ("capital", tuple(f for f in CONTEXT_CAPITALS if f[1] in keep_c),
         "the capital of {s} is {v}", "What is the capital of {s}?", "The capital of {s} is"),
        ("language", tuple(f for f in CONTEXT_LANGUAGES if f[1] in keep_l),
         "the official language of {s} is {v}", "What is the official language of {s}?",
         "The official language of {s} is"),
        ("landmark", tuple(f for f in CONTEXT_LANDMARKS if f[1] in keep_c),
         "{s} is located in {v}", "In which city is {s}?", "{S} is located in"),
    ]  # fmt: skip


def build_context_qa(rng: random.Random, tokenizer: Any) -> list[dict]:
    """context_qa: a passage that contradicts a well-known fact, then a question about that fact.

    The emphasised span is the passage; the choices are [the passage's value, the true value]
    and the label is 0 (context-faithful). Values come from the same relation, single tokens
    after a space, with distinct first tokens.
    """
    relations = _context_relations(tokenizer)
    items: list[dict] = []
    strata: list[str] = []
    seen: set[tuple] = set()
    i = 0
    while len(items) < N_EXAMPLES:
        kind, facts, statement, question, cue = relations[i % len(relations)]
        i += 1
        subject, true = rng.choice(facts)
        values = sorted({v for _, v in facts} - {true})
        new = rng.choice(values)
        if _first_token(tokenizer, new) == _first_token(tokenizer, true):
            continue
        source = rng.choice(CONTEXT_SOURCES)
        claim = statement.format(s=subject, v=new)
        passage = f"{source} {claim}. {' '.join(rng.sample(CONTEXT_FILLERS, 2))}"
        key = (subject, kind, new, source)
        if key in seen:
            continue
        seen.add(key)
        q = question.format(s=subject)
        c = cue.format(s=subject, S=_cap(subject))
        items.append(
            {
                "prompt": f"{CONTEXT_INSTRUCTION}\nPassage: {passage}\nQuestion: {q}\nAnswer: {c}",
                "emphasize": passage,
                "choices": [new, true],
                "label": 0,
            }
        )
        strata.append(kind)
    return _rows("context_qa", items, strata, rng, chat=False, scoring="choice")


def build_tasks(tokenizer: Any, seed: int = SEED) -> dict[str, list[dict]]:
    """All six task sets as rows (dicts in file order); each task has its own seeded stream.

    Raises:
        ValueError: a choice task example whose choices share a first token.
    """
    tasks = {
        "json_format": build_json_format(random.Random(f"{seed}-json_format")),
        "pronoun_change": build_pronoun_change(random.Random(f"{seed}-pronoun_change")),
        "occupation": build_occupation(random.Random(f"{seed}-occupation"), tokenizer),
        "counterfact": build_counterfact(random.Random(f"{seed}-counterfact"), tokenizer),
        "sentiment": build_sentiment(random.Random(f"{seed}-sentiment"), tokenizer),
        "context_qa": build_context_qa(random.Random(f"{seed}-context_qa"), tokenizer),
    }
    for rows in tasks.values():
        for row in rows:
            if row["choices"] is not None:
                check_choices(tokenizer, row["choices"])
            if row["emphasize"] is not None and row["prompt"].count(row["emphasize"]) != 1:
                raise HeadsteerValueError(f"{row['id']}: emphasize must occur exactly once in the prompt")
        prompts = [r["prompt"] for r in rows]
        if len(set(prompts)) != len(prompts):
            raise HeadsteerValueError(f"{rows[0]['id']}: duplicate prompts in the task")
    return tasks


def dump_jsonl(rows: Sequence[dict]) -> str:
    """The JSONL text of `rows` (one compact object a line, trailing newline)."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(out_dir: Path = OUT_DIR) -> None:
    """Write `<out_dir>/<task>.jsonl` for every task and print the split sizes."""
    from heads import load_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in build_tasks(load_tokenizer()).items():
        (out_dir / f"{name}.jsonl").write_text(dump_jsonl(rows), encoding="utf-8", newline="\n")
        sizes = {s: sum(r["split"] == s for r in rows) for s in ("train", "validation", "test")}
        print(f"{name}: {len(rows)} examples {sizes}")
