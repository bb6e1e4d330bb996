"""Build the evaluation task sets in `probes/data/tasks/` (written for this project).

Run `python -m probes.datasets.make_tasks` to (re)write the six JSONL files; the build is seeded and
deterministic, so re-running gives byte-identical files. Every example is assembled from the
hand-written lists below and fixed templates; the people, landmarks, provinces, countries and
firms named are fictional (real cities, countries, languages and companies appear only as
values), except in `context_qa`, whose passages contradict real, well-known facts.
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

__all__ = ["N_EXAMPLES", "OUT_DIR", "SEED", "build_tasks", "check_choices", "dump_jsonl", "main"]

SEED = 20240611
N_EXAMPLES = 200
N_TRAIN, N_VALIDATION = 90, 30
OUT_DIR = Path(__file__).resolve().parents[1] / "data" / "tasks"

JSON_INSTRUCTION = 'Answer in JSON format with the keys "name" and "occupation".'
PRONOUN_INSTRUCTION = (
    "Substitute 'she' and 'he' with 'they' and generate the occupation of {name} after changing pronouns."
)

# --------------------------------------------------------------------------- word lists

FEMALE_NAMES = (
    "Amara", "Priya", "Sofia", "Mei", "Ingrid", "Fatima", "Yuki", "Olga", "Chiara", "Aisha",
    "Lucia", "Nadia", "Ana", "Freya", "Leila", "Camille", "Zanele", "Maren", "Rosa", "Hana",
    "Elena", "Ife", "Noor", "Marta", "Siobhan", "Daniela", "Keiko", "Anya", "Thandiwe", "Beatriz",
    "Aroha", "Ximena", "Lena", "Esra", "Kavya", "Nia", "Greta", "Malia", "Dalia", "Sunita",
)  # fmt: skip
MALE_NAMES = (
    "Kwame", "Mateo", "Hiroshi", "Lars", "Omar", "Rahul", "Pavel", "Diego", "Tomasz", "Wei",
    "Emeka", "Luca", "Arjun", "Henrik", "Karim", "Felipe", "Sven", "Tariq", "Kenji", "Nikolai",
    "Malik", "Ravi", "Samuel", "Ibrahim", "Oskar", "Dmitri", "Jamal", "Kofi", "Hamid", "Marco",
    "Anders", "Rafael", "Youssef", "Takeshi", "Vikram", "Emil", "Niall", "Tane", "Bruno", "Joon",
)  # fmt: skip
SURNAMES = (
    "Okafor", "Sharma", "Lindqvist", "Moreau", "Tanaka", "Kowalski", "Haddad", "Fernandes", "Novak",
    "Mensah", "Rossi", "Nakamura", "Petrov", "Alvarez", "Byrne", "Dubois", "Eriksen", "Farouk",
    "Gallagher", "Horvat", "Ito", "Jovanovic", "Kaur", "Laine", "Mwangi", "Nilsson", "Oyelaran",
    "Park", "Quintero", "Rahman", "Sato", "Torres", "Umarov", "Varga", "Wojcik", "Yilmaz", "Zhou",
    "Abara", "Bianchi", "Castillo", "Demir", "Esposito", "Fischer", "Hoang", "Ibarra", "Jansen",
    "Lopes", "Marsh", "Ndiaye", "Ortega", "Pereira", "Reyes", "Sandoval", "Takahashi", "Vogel",
    "Walsh", "Adeyemi", "Holt", "Ferreira", "Kamau", "Lund", "Moyo", "Sorensen", "Tembo",
)  # fmt: skip

# Cities for biographies (any tokenization); single-token ones below are used as choices.
BIO_CITIES = (
    "Leeds", "Lyon", "Porto", "Osaka", "Nairobi", "Accra", "Krakow", "Valencia", "Gothenburg",
    "Bergen", "Adelaide", "Halifax", "Cork", "Bologna", "Curitiba", "Pune", "Busan", "Tampere",
    "Utrecht", "Graz", "Durban", "Rosario", "Cebu", "Kyoto", "Glasgow", "Quebec City", "Tallinn",
    "Seville", "Hanoi", "Izmir", "Wellington", "Bristol", "Marseille", "Ljubljana", "Cusco",
)  # fmt: skip
CHOICE_CITIES = (
    "Oslo", "Lima", "Paris", "London", "Berlin", "Madrid", "Rome", "Tokyo", "Cairo", "Dublin",
    "Vienna", "Prague", "Warsaw", "Athens", "Lisbon", "Boston", "Chicago", "Toronto", "Sydney",
    "Mumbai", "Seoul", "Moscow", "Nairobi", "Havana", "Helsinki", "Stockholm", "Amsterdam",
    "Brussels", "Zurich", "Geneva", "Munich", "Milan", "Venice", "Barcelona", "Budapest", "Istanbul",
    "Manila", "Singapore", "Melbourne", "Vancouver", "Montreal", "Denver", "Seattle", "Dallas",
)  # fmt: skip
COUNTRIES = (
    "France", "Japan", "Germany", "Italy", "Spain", "Brazil", "Canada", "Mexico", "India", "China",
    "Egypt", "Kenya", "Nigeria", "Peru", "Chile", "Argentina", "Sweden", "Norway", "Finland",
    "Denmark", "Poland", "Greece", "Turkey", "Portugal", "Ireland", "Australia", "Korea", "Vietnam",
    "Thailand", "Morocco", "Ghana", "Colombia", "Austria", "Belgium", "Hungary",
)  # fmt: skip
LANGUAGES = (
    "English", "French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Swedish", "Polish",
    "Greek", "Turkish", "Arabic", "Japanese", "Korean", "Russian", "Hindi", "Finnish", "Danish",
    "Norwegian", "Hungarian", "Swahili", "Hebrew",
)  # fmt: skip
COMPANIES = (
    "Google", "Microsoft", "Apple", "Amazon", "Toyota", "Samsung", "Intel", "IBM", "Sony", "Nike",
    "Ford", "Tesla", "Netflix", "Oracle", "Boeing", "Disney", "Canon", "Shell", "Uber", "Adobe",
    "Cisco", "Dell",
)  # fmt: skip
INSTRUMENTS = ("piano", "guitar", "violin", "flute", "trumpet", "drums", "harp", "organ", "bass")
SPORTS = (
    "soccer",
    "tennis",
    "basketball",
    "baseball",
    "hockey",
    "golf",
    "cricket",
    "rugby",
    "volleyball",
    "chess",
)

# Fictional place and organisation names.
PLACE_STEMS = (
    "Larkspur", "Oakhaven", "Brindle", "Ashcombe", "Marrow", "Fenwick", "Corvane", "Thistledown",
    "Wrenfield", "Halloway", "Silverbrook", "Quillon", "Dunmere", "Elderglen", "Rookwood", "Saltmarsh",
    "Westerly", "Harrowgate", "Kestrel", "Moorcroft", "Pennant", "Bellhaven", "Greywater", "Foxmoor",
    "Lindenfall", "Stonebridge", "Copperfield", "Alderney", "Blackthorn", "Merriweather",
)  # fmt: skip
LANDMARKS = (
    "Bridge",
    "Museum",
    "Tower",
    "Library",
    "Observatory",
    "Gallery",
    "Theatre",
    "Aquarium",
    "Stadium",
)
FICTIONAL_COUNTRIES = (
    "Valdoria", "Ostrevia", "Marendia", "Karvonia", "Elbrisia", "Tamoria", "Quessland", "Drovania",
    "Sarnevia", "Lumeria", "Petravia", "Orlandia", "Zembria", "Castavia", "Ferrania", "Norvelle",
    "Belmoria", "Vantria", "Galdoria", "Hestovia", "Irvania", "Jessovia", "Kelmar", "Lorvania",
    "Montavia", "Nirevia", "Oskaria", "Rivalia",
)  # fmt: skip
FIRM_KINDS = ("Labs", "Logistics", "Textiles", "Robotics", "Foods", "Analytics", "Shipping", "Ceramics")

# Occupations stated in the json_format / pronoun_change biographies.
BIO_OCCUPATIONS = (
    "marine biologist", "pharmacist", "software developer", "civil engineer", "museum curator",
    "wedding planner", "graphic designer", "park ranger", "pastry chef", "air traffic controller",
    "speech therapist", "sound engineer", "bookbinder", "beekeeper", "tailor", "locksmith",
    "carpenter", "translator", "optometrist", "veterinarian", "electrician", "urban planner",
    "flight attendant", "data analyst", "landscape gardener", "physiotherapist", "midwife",
    "geologist", "interior designer", "radio presenter", "archivist", "firefighter",
)  # fmt: skip

# BiasBios-style label set (each one token with a leading space), with trade vocabulary.
OCCUPATION_VOCAB = {
    "accountant": ("tax returns", "balance sheets", "quarterly audits"),
    "architect": ("blueprints", "building permits", "floor plans"),
    "attorney": ("court filings", "contract disputes", "legal briefs"),
    "composer": ("orchestral scores", "film soundtracks", "string quartets"),
    "dentist": ("dental checkups", "cavities", "orthodontic braces"),
    "dietitian": ("meal plans", "nutrition labels", "balanced diets"),
    "journalist": ("newspaper deadlines", "interviews with officials", "breaking news"),
    "nurse": ("hospital wards", "patient charts", "night shifts on the ward"),
    "painter": ("oil paints", "gallery openings", "watercolour landscapes"),
    "photographer": ("camera lenses", "portrait sessions", "darkroom prints"),
    "poet": ("sonnets", "poetry readings", "collections of verse"),
    "professor": ("university lectures", "research seminars", "graduate students"),
    "psychologist": ("therapy sessions", "cognitive tests", "behavioural studies"),
    "surgeon": ("operating theatres", "surgical instruments", "long operations"),
    "teacher": ("lesson plans", "classroom projects", "parent evenings"),
}
OCCUPATIONS = tuple(OCCUPATION_VOCAB)

HOBBIES = (
    "birdwatching", "rock climbing", "baking sourdough bread", "playing chess", "restoring old bicycles",
    "knitting scarves", "kayaking", "collecting vinyl records", "painting miniature figures",
    "hiking in the mountains", "learning to juggle", "building model trains", "solving crossword puzzles",
    "growing herbs", "swimming in the sea", "reading mystery novels", "salsa dancing", "making pottery",
)  # fmt: skip
PETS = ("cat", "dog", "parrot", "rabbit", "tortoise", "goldfish", "hamster")
PET_NAMES = (
    "Biscuit",
    "Pepper",
    "Mango",
    "Luna",
    "Ziggy",
    "Noodle",
    "Pip",
    "Olive",
    "Clover",
    "Rusty",
    "Maple",
)
VOLUNTEER_PLACES = (
    "a community garden", "the local animal shelter", "a children's library", "a food bank",
    "a beach clean-up group", "a youth football club", "a repair cafe",
)  # fmt: skip
FOODS = (
    "spicy lentil soup", "mango sticky rice", "mushroom risotto", "grilled sardines", "jollof rice",
    "apple pie", "pork dumplings", "falafel wraps", "lemon cheesecake",
)  # fmt: skip
STUDY_SUBJECTS = ("history", "mathematics", "economics", "biology", "philosophy", "geography", "music")
RELATIVES = (
    ("sister", "f"), ("aunt", "f"), ("brother", "m"), ("uncle", "m"), ("cousin", None), ("neighbour", None),
)  # fmt: skip

# Sentiment: query reviews are composed from (subject, predicate) pairs per domain; the
# demonstrations come from a separate, hand-written pool.
REVIEW_DOMAINS = {
    "product": (
        (
            "The blender", "This backpack", "The desk lamp", "This kettle", "The phone case",
            "This vacuum cleaner", "The rain jacket", "This office chair", "The electric toothbrush",
            "This suitcase",
        ),
        (
            "worked perfectly from the very first day.", "is sturdy, well made and worth every penny.",
            "exceeded all of my expectations.", "still looks brand new after a year of daily use.",
            "is easy to use and a real pleasure to own.", "arrived quickly and works like a charm.",
            "is the best purchase I have made this year.",
            "feels solid and does exactly what it promises.",
        ),
        (
            "broke after only two weeks.", "is flimsy and a complete waste of money.",
            "stopped working the day after the warranty ran out.",
            "arrived damaged and smelled of burnt plastic.", "is noisy, awkward and hard to clean.",
            "fell apart the first time I used it.", "was a huge disappointment from start to finish.",
            "feels cheap and does not work as advertised.",
        ),
    ),
    "film": (
        (
            "The film", "This documentary", "The sequel", "This animated movie", "The thriller",
            "This romantic comedy", "The war drama", "This science fiction film", "The musical",
            "This detective story",
        ),
        (
            "had a clever plot and wonderful acting.", "kept me gripped until the final scene.",
            "is a moving, beautifully shot masterpiece.", "made the whole audience laugh and cheer.",
            "was a delight from beginning to end.", "has a brilliant script and a stunning soundtrack.",
            "is the most touching story I have seen in years.", "left me smiling for days afterwards.",
        ),
        (
            "was dull and far too long.", "had wooden acting and a confusing plot.",
            "bored me so much that I left halfway through.", "is a lazy, predictable mess.",
            "wasted a talented cast on a terrible script.", "was painful to sit through.",
            "has clumsy dialogue and no real story.", "was the worst thing I have watched all year.",
        ),
    ),
    "restaurant": (
        (
            "This little bistro", "The new ramen bar", "The corner cafe", "The seafood restaurant",
            "This pizza place", "The vegetarian diner", "This family trattoria", "The noodle shop",
            "This rooftop restaurant", "The breakfast spot",
        ),
        (
            "served the freshest food I have had in years.", "has friendly staff and delicious dishes.",
            "made us feel welcome and fed us wonderfully.", "is worth every penny and then some.",
            "serves generous portions of superb food.", "gave us a perfect evening with amazing dessert.",
            "never fails to impress me and my friends.", "has the tastiest menu in town.",
        ),
        (
            "had rude staff and cold food.", "kept us waiting an hour for a bland meal.",
            "served soggy, overpriced dishes.", "left us hungry, annoyed and out of pocket.",
            "was dirty and the food tasted stale.", "got our order wrong and never apologised.",
            "is overpriced and deeply disappointing.", "served the worst meal I have eaten in years.",
        ),
    ),
}  # fmt: skip
DEMO_POSITIVE = (
    "A charming hotel with spotless rooms and a lovely view.",
    "The concert was joyful and the band played flawlessly.",
    "These running shoes are light, comfortable and great value.",
    "What a heartwarming novel; I could not put it down.",
    "The bakery's croissants are flaky, buttery and perfect.",
    "Setting up the printer took two minutes and it prints beautifully.",
    "The museum tour was fascinating and our guide was superb.",
    "I loved this board game; our whole family had a blast.",
    "The garden centre staff were helpful and the plants are thriving.",
    "Our holiday cottage was cosy, clean and wonderfully quiet.",
)
DEMO_NEGATIVE = (
    "The hotel room was filthy and the shower never got warm.",
    "The concert started late and the sound was awful.",
    "These running shoes gave me blisters within a day.",
    "A tedious novel with flat characters and no ending.",
    "The bakery sold me stale bread and refused a refund.",
    "The printer jams constantly and the ink smears everywhere.",
    "The museum tour was rushed and the guide seemed bored.",
    "This board game has confusing rules and broke on the first night.",
    "The plants from the garden centre died within a week.",
    "Our holiday cottage was damp, noisy and nothing like the photos.",
)
SENTIMENT_CHOICES = ("positive", "negative")


# --------------------------------------------------------------------------- helpers


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


# --------------------------------------------------------------------------- biographies


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


# --------------------------------------------------------------------------- occupation


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


# --------------------------------------------------------------------------- counterfact


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


# --------------------------------------------------------------------------- sentiment


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


# --------------------------------------------------------------------------- context_qa

# Real facts the model has likely memorised; the passage of each example contradicts them.
CONTEXT_CAPITALS = (
    ("France", "Paris"), ("Japan", "Tokyo"), ("Germany", "Berlin"), ("Italy", "Rome"),
    ("Spain", "Madrid"), ("Egypt", "Cairo"), ("Ireland", "Dublin"), ("Austria", "Vienna"),
    ("Poland", "Warsaw"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Russia", "Moscow"),
    ("Kenya", "Nairobi"), ("Cuba", "Havana"), ("Finland", "Helsinki"), ("Sweden", "Stockholm"),
    ("Belgium", "Brussels"), ("Hungary", "Budapest"), ("Norway", "Oslo"), ("Peru", "Lima"),
    ("England", "London"), ("South Korea", "Seoul"), ("the Philippines", "Manila"),
)  # fmt: skip
CONTEXT_LANGUAGES = (
    ("France", "French"), ("Germany", "German"), ("Spain", "Spanish"), ("Italy", "Italian"),
    ("Portugal", "Portuguese"), ("Brazil", "Portuguese"), ("Japan", "Japanese"),
    ("the Netherlands", "Dutch"), ("Sweden", "Swedish"), ("Poland", "Polish"), ("Greece", "Greek"),
    ("Turkey", "Turkish"), ("Egypt", "Arabic"), ("Russia", "Russian"), ("Finland", "Finnish"),
    ("Denmark", "Danish"), ("Norway", "Norwegian"), ("Hungary", "Hungarian"), ("Israel", "Hebrew"),
    ("Mexico", "Spanish"), ("South Korea", "Korean"), ("England", "English"),
)  # fmt: skip
CONTEXT_LANDMARKS = (
    ("the Eiffel Tower", "Paris"), ("the Colosseum", "Rome"), ("Big Ben", "London"),
    ("the Brandenburg Gate", "Berlin"), ("the Acropolis", "Athens"), ("the Kremlin", "Moscow"),
    ("the Sydney Opera House", "Sydney"), ("the CN Tower", "Toronto"), ("the Space Needle", "Seattle"),
    ("the Prado Museum", "Madrid"), ("the Louvre", "Paris"), ("the Sagrada Familia", "Barcelona"),
    ("the Rijksmuseum", "Amsterdam"), ("the Vatican Museums", "Rome"), ("St. Basil's Cathedral", "Moscow"),
    ("the Tokyo Skytree", "Tokyo"), ("the Charles Bridge", "Prague"),
    ("the Little Mermaid statue", "Copenhagen"),
)  # fmt: skip
CONTEXT_SOURCES = (
    "According to the 2031 edition of the World Almanac,",
    "A revised encyclopedia entry states that",
    "In the alternate history novel used in this exercise,",
    "The briefing document for this quiz says that",
    "After the reforms described in this report,",
)
CONTEXT_FILLERS = (
    "Officials confirmed the change in a public statement.",
    "Schools have already updated their textbooks.",
    "Visitors are reminded of this at every information desk.",
    "The decision was announced after a long debate.",
    "Maps printed since then show the new information.",
    "Tour guides now repeat this to every group.",
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


# --------------------------------------------------------------------------- build / write


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


if __name__ == "__main__":
    main()
