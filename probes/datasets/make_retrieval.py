"""Build `probes/data/retrieval/qrhead.jsonl`, the multi-passage retrieval set of the QRHead study
(written for this project; every person is fictional).

Run `python -m probes.datasets.make_retrieval`; the build is seeded and deterministic (byte-identical
on re-run). Each row: `{"id", "split", "question", "passages" (10), "gold"}`. One passage answers the
question, in words that avoid the question's own (a paraphrase); three *hard negatives* name the same
person with other facts; three *lexical distractors* use the question's wording about other people;
three passages are about other people and facts. So word overlap (BM25) cannot single out the
answer: the relevant passage shares only the person's name with the question, like the hard
negatives do. The first `N_TRAIN` rows are `"train"` (head detection), the rest `"test"`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["N_ITEMS", "N_TRAIN", "OUT", "SEED", "build", "load_retrieval", "main"]

SEED = 20251202
N_ITEMS, N_TRAIN = 80, 40
OUT = Path(__file__).resolve().parents[1] / "data" / "retrieval" / "qrhead.jsonl"

FIRST = [
    "Orlan",
    "Mira",
    "Tobin",
    "Selka",
    "Davor",
    "Ilse",
    "Kerem",
    "Palo",
    "Ysolde",
    "Brann",
    "Nadja",
    "Corvin",
    "Estrel",
    "Fennick",
    "Gisla",
    "Hadrik",
    "Ione",
    "Jorund",
    "Kaelin",
    "Lissa",
]
LAST = [
    "Vesk",
    "Tael",
    "Marrow",
    "Quill",
    "Ostrander",
    "Pell",
    "Rowe",
    "Sarn",
    "Thistle",
    "Umber",
    "Varga",
    "Wexley",
    "Yarrow",
    "Zenner",
    "Brisk",
    "Calder",
    "Dunmore",
    "Elmsworth",
    "Fairbank",
    "Gorse",
]
# attribute: (question, paraphrase of the answer, the question's own wording, values)
FACTS = {
    "born": (
        "Where was {p} born?",
        "{p} came into the world in the harbour town of {v}.",
        "{p} was born in {v}, where the family lived for years.",
        ["Delmar", "Kestra", "Ombrell", "Sallow Point", "Vintry", "Harth", "Caldera Bay", "Newmere"],
    ),
    "job": (
        "What does {p} do for a living?",
        "{p} earns a salary working as a {v} in the city.",
        "For a living, {p} does odd jobs and sometimes works as a {v}.",
        ["carpenter", "nurse", "pilot", "baker", "librarian", "surveyor", "tailor", "chemist"],
    ),
    "pet": (
        "What pet does {p} own?",
        "{p} shares a small flat with a {v} called Pip.",
        "The pet that {p} owns is a {v}, a gift from a neighbour.",
        ["parrot", "tortoise", "ferret", "beagle", "goldfish", "rabbit", "hedgehog", "cat"],
    ),
    "instrument": (
        "Which instrument does {p} play?",
        "Every weekend {p} performs on the {v} at a local hall.",
        "The instrument {p} plays best is the {v}, learnt at school.",
        ["cello", "oboe", "banjo", "harp", "trumpet", "accordion", "violin", "flute"],
    ),
    "color": (
        "What is the favorite color of {p}?",
        "{p} likes {v} more than any other shade and paints the door with it.",
        "The favorite color of {p} is {v}, according to friends.",
        ["teal", "crimson", "amber", "violet", "olive", "indigo", "coral", "silver"],
    ),
}


def build(seed: int = SEED, n: int = N_ITEMS, n_train: int = N_TRAIN) -> list[dict]:
    """The rows (deterministic for a given seed)."""
    rng = random.Random(seed)
    names = [f"{a} {b}" for a in FIRST for b in LAST]
    rng.shuffle(names)
    attrs = sorted(FACTS)
    rows = []
    for k in range(n):
        person = names[k]
        others = rng.sample(names[n:], 6)
        attr = attrs[k % len(attrs)]
        q_t, para_t, _, vals = FACTS[attr]
        passages = [para_t.format(p=person, v=rng.choice(vals))]
        for a in rng.sample([x for x in attrs if x != attr], 3):  # hard negatives: same person
            passages.append(FACTS[a][1].format(p=person, v=rng.choice(FACTS[a][3])))
        for o in others[:3]:  # lexical distractors: the question's wording, other people
            passages.append(FACTS[attr][2].format(p=o, v=rng.choice(vals)))
        for o in others[3:6]:  # other people, other facts
            a = rng.choice([x for x in attrs if x != attr])
            template = (FACTS[a][1], FACTS[a][2])[rng.choice([1, 2]) - 1]
            passages.append(template.format(p=o, v=rng.choice(FACTS[a][3])))
        order = list(range(len(passages)))
        rng.shuffle(order)
        rows.append(
            {
                "id": f"qr{k:03d}",
                "split": "train" if k < n_train else "test",
                "question": q_t.format(p=person),
                "passages": [passages[i] for i in order],
                "gold": order.index(0),
            }
        )
    return rows


def load_retrieval(split: str | None = None, path: Path = OUT) -> list[dict]:
    """The shipped rows, optionally one split (`"train"` / `"test"`)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows if split is None else [r for r in rows if r["split"] == split]


def main() -> None:
    from heads._util.files import write_text

    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in build())
    write_text(OUT, text, overwrite=True)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
