"""Relation pairs for MAPS (docs/methods/maps.md), written for this project.

`probes/data/relations.jsonl` holds one relation a line:
`{"relation", "kind", "k_rule": "copy" | "default", "pairs": [[source, target], ...]}`.
Pairs are kept for a model only when both sides, prefixed with a space, encode to
one token without special tokens; a relation needs >= 30 surviving pairs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from heads._util.validation import check_int, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.scorers.maps.static import RelationPairs, k_for

__all__ = [
    "MIN_PAIRS",
    "RelationSet",
    "load_relations",
    "parse_relation_names",
    "relation_names",
    "relation_records",
    "single_token_pairs",
]

MIN_PAIRS = 30


def _records() -> list[dict]:
    text = resources.files("probes").joinpath("data/relations.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def relation_records() -> list[dict]:
    """The shipped relations as written: `{"relation", "kind", "k_rule", "pairs"}` dicts."""
    return _records()


def relation_names() -> list[str]:
    """Names of the shipped relations, in file order."""
    return [r["relation"] for r in _records()]


def parse_relation_names(names: Sequence[str] | str | None) -> list[str]:
    """Relation names from a list, a comma-separated string, `"all"` or None (all).

    Blanks and repeats are dropped; order is kept.

    Raises:
        ValueError: an unknown name (named, with the known ones), or no name at all.
    """
    known = relation_names()
    if names is None or (isinstance(names, str) and names.strip() == "all"):
        return known
    raw = names.split(",") if isinstance(names, str) else list(names)
    wanted = list(dict.fromkeys(n.strip() for n in raw if n.strip()))
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise HeadsteerValueError(f"unknown relation(s) {unknown}; known: {sorted(known)}")
    if not wanted:
        raise HeadsteerValueError("no relation named")
    return wanted


def _one_token(tokenizer: Any, word: str) -> int | None:
    ids = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def single_token_pairs(tokenizer: Any, pairs: Sequence[Sequence[str]]) -> list[tuple[str, str, int, int]]:
    """Keep the pairs whose source and target are each one token (with a leading space).

    Returns `(source, target, source_id, target_id)` tuples; multi-token pairs are dropped.
    """
    out = []
    for pair in pairs:
        if isinstance(pair, str) or len(pair) != 2 or not all(isinstance(w, str) and w.strip() for w in pair):
            raise HeadsteerValueError(f"a relation pair must be two non-empty words, got {short_repr(pair)}")
        src, tgt = pair
        s, t = _one_token(tokenizer, src), _one_token(tokenizer, tgt)
        if s is not None and t is not None:
            out.append((src, tgt, s, t))
    return out


@dataclass
class RelationSet:
    """Relations usable on one tokenizer, and the ones dropped by the pair filter.

    Attributes:
        relations: `RelationPairs` with >= `min_pairs` single-token pairs.
        kinds: relation name -> kind (algorithmic, knowledge, linguistic, translation).
        survived: relation name -> (pairs shipped, pairs surviving the filter), for all.
        dropped: names of relations under `min_pairs`, with a message each.
    """

    relations: list[RelationPairs]
    kinds: dict[str, str] = field(default_factory=dict)
    survived: dict[str, tuple[int, int]] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> RelationPairs:
        for r in self.relations:
            if r.name == name:
                return r
        raise KeyError(name)


def load_relations(
    tokenizer: Any,
    names: Sequence[str] | str | None = None,
    *,
    min_pairs: int = MIN_PAIRS,
    d_vocab: int | None = None,
) -> RelationSet:
    """Load shipped relations and keep the single-token pairs for `tokenizer`.

    Args:
        tokenizer: the model's tokenizer.
        names: relation names, a comma-separated string, `"all"` or None (all).
        min_pairs: relations with fewer surviving pairs are dropped (a positive int, default 30).
        d_vocab: vocabulary size for the k rule (default: the tokenizer's length).

    Raises:
        ValueError: an unknown relation name (named, with the known ones), no relation left
            after filtering, `min_pairs` / `d_vocab` not a positive int (a `min_pairs` of 0 or
            below acted as 1).
    """
    if tokenizer is None or not callable(tokenizer):
        raise HeadsteerTypeError("load_relations needs the model's tokenizer")
    min_pairs = check_int("min_pairs", min_pairs, lo=1)
    if d_vocab is not None:  # 0 fell back to the tokenizer's length silently
        d_vocab = check_int("d_vocab", d_vocab, lo=1)
    records = {r["relation"]: r for r in _records()}
    wanted = parse_relation_names(names)
    vocab = d_vocab or len(tokenizer)
    out = RelationSet([])
    for name in wanted:
        rec = records[name]
        kept = single_token_pairs(tokenizer, rec["pairs"])
        out.kinds[name] = rec["kind"]
        out.survived[name] = (len(rec["pairs"]), len(kept))
        if len(kept) < min_pairs:
            out.dropped[name] = (
                f"{name}: only {len(kept)} of {len(rec['pairs'])} pairs are single tokens for this "
                f"tokenizer (need {min_pairs}); relation dropped"
            )
            continue
        out.relations.append(
            RelationPairs(
                name,
                [(s, t) for _, _, s, t in kept],
                k_for(rec["k_rule"], vocab),
                texts=[(a, b) for a, b, _, _ in kept],
            )
        )
    if not out.relations:
        raise HeadsteerValueError(
            "no relation has enough single-token pairs: " + "; ".join(out.dropped.values())
        )
    return out
