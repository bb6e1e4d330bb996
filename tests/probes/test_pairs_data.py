"""The shipped prompt-pair sets (probes/data/pairs): sizes, splits, alignment, regeneration."""

from __future__ import annotations

import pytest

from heads.errors import HeadsteerValueError
from heads.scorers.patching.pairs import encode_pairs
from probes.datasets import make_pairs
from probes.datasets.pairs import CORRUPTIONS, PAIR_SETS, load_task_pairs, pairs_path


def test_generator_is_deterministic_and_matches_shipped_files(tokenizer):
    first = make_pairs.build_pairs(tokenizer)
    assert first == make_pairs.build_pairs(tokenizer)
    assert make_pairs.build_pairs(tokenizer, seed=1)["ioi"] != first["ioi"]
    for name, rows in first.items():
        with open(pairs_path(name), encoding="utf-8") as f:
            shipped = f.read()
        assert make_pairs.dump_jsonl(rows) == shipped, (
            f"stale {name}.jsonl: run python -m probes.datasets.make_pairs"
        )


@pytest.mark.parametrize("name", PAIR_SETS)
def test_sizes_splits_and_alignment(tokenizer, name):
    for corruption in CORRUPTIONS[name]:
        every = load_task_pairs(name, None, corruption=corruption)
        train, test = (
            load_task_pairs(name, "train", corruption=corruption),
            load_task_pairs(name, "test", corruption=corruption),
        )
        assert len(every) >= 100 and len(train) + len(test) == len(every) and min(len(train), len(test)) >= 80
        assert {p.meta["id"] for p in train}.isdisjoint(p.meta["id"] for p in test)
        # token lengths align per pair, answers are single distinct tokens (encode_pairs raises otherwise)
        batch = encode_pairs(tokenizer, every)
        assert batch.n == len(every)
        assert bool((batch.answers[:, 0] != batch.counterfactuals[:, 0]).all())
        for p in every:
            assert p.clean != p.corrupted


def test_ioi_corruptions_are_what_they_say(tokenizer):
    abc = load_task_pairs("ioi", None)
    flip = load_task_pairs("ioi", None, corruption="s_flip")
    assert len(load_task_pairs("ioi", None, corruption="all")) == len(abc) + len(flip)
    assert {p.meta["order"] for p in abc} == {"BABA", "ABBA"}
    assert len({p.meta["template"] for p in abc}) == 15
    for a, f in zip(abc, flip, strict=True):
        assert a.clean == f.clean
        io, s = a.meta["io"], a.meta["s"]
        assert a.answer == " " + io and a.counterfactual == " " + s
        assert a.clean.count(" " + s) == 2 and a.clean.count(" " + io) == 1
        # ABC: neither name appears in the corrupted prompt; S-flip: the subject once, IO twice
        assert f" {io} " not in a.corrupted and f" {s} " not in a.corrupted
        assert f.corrupted.count(" " + io) == 2 and f.corrupted.count(" " + s) == 1
        names = [w.strip(",.") for w in a.clean.split() if w.strip(",.") in make_pairs.NAMES]
        assert len(names) == 3


def test_colored_objects_and_comp_mech_content():
    for p in load_task_pairs("colored_objects", None):
        assert f"{p.answer.strip()} {p.meta['query']}" in p.clean
        assert f"{p.counterfactual.strip()} {p.meta['other']}" in p.clean
        assert p.corrupted.endswith(f"The {p.meta['other']} is")
    for p in load_task_pairs("comp_mech", None):
        new, old = p.answer.strip(), p.counterfactual.strip()
        assert p.clean.index(old) < p.clean.index(new) and p.corrupted.index(new) < p.corrupted.index(old)


def test_bad_arguments():
    for kwargs, word in (
        ({"name": "nope"}, "nope"),
        ({"name": "ioi", "split": "validation"}, "validation"),
        ({"name": "ioi", "corruption": "xyz"}, "xyz"),
        ({"name": "ioi", "n": 0}, "n"),
    ):
        with pytest.raises(HeadsteerValueError, match=word):
            load_task_pairs(**kwargs)
    assert len(load_task_pairs("ioi", n=5)) == 5


def test_every_shipped_pair_carries_its_template():
    from probes.datasets.pairs import load_task_pairs

    want = {"ioi": 15, "colored_objects": 1, "comp_mech": 8}  # phrasings per set
    for name, n in want.items():
        pairs = load_task_pairs(name, split=None, corruption="all" if name == "ioi" else None)
        ids = {p.meta["template"] for p in pairs}
        assert ids == set(range(n)), name
