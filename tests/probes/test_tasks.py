"""The shipped evaluation task sets (probes/data/tasks) and their metrics."""

from __future__ import annotations

import math
import random

import pytest

from probes.datasets import make_tasks
from probes.datasets.tasks import SPLITS, TASKS, load_task
from probes.metrics.tasks import choice_correct, json_metrics, mean_interval, no_pronoun, wilson_interval

KINDS = {
    "json_format": (True, "generate"),
    "pronoun_change": (True, "generate"),
    "occupation": (False, "choice"),
    "counterfact": (False, "choice"),
    "sentiment": (False, "choice"),
    "context_qa": (False, "choice"),
}


@pytest.fixture(scope="module")
def tasks():
    return {name: load_task(name) for name in TASKS}


def test_sizes_splits_and_ids(tasks):
    assert set(TASKS) == set(KINDS)
    for name, task in tasks.items():
        assert len(task) >= 150
        assert (task.chat, task.scoring) == KINDS[name]
        assert [len(task.split(s)) for s in SPLITS] == [90, 30, len(task) - 120]
        ids = [e.id for e in task.examples]
        assert len(set(ids)) == len(ids) and all(i.startswith(f"{name}-") for i in ids)
        assert len({e.prompt for e in task.examples}) == len(task)
        assert len(load_task(name, "validation")) == 30


def test_row_fields(tasks):
    for task in tasks.values():
        for e in task.examples:
            assert (e.chat, e.scoring) == (task.chat, task.scoring)
            if e.emphasize is not None:
                assert e.prompt.count(e.emphasize) == 1
            if e.scoring == "choice":
                assert e.fields is None and 0 <= e.label < len(e.choices)
                assert not e.prompt.endswith(" ")
            else:
                assert e.choices is None and e.label is None and set(e.fields) == {"name", "occupation"}
                assert e.emphasize is not None and e.prompt.endswith(e.emphasize)
                assert e.fields["name"] in e.prompt and e.fields["occupation"] in e.prompt
    assert {e.target for e in tasks["json_format"].examples} == {"{"}
    assert {e.target for e in tasks["pronoun_change"].examples} == {"They"}
    assert all(e.emphasize is None for e in tasks["sentiment"].examples)
    assert all(e.label == 0 for e in tasks["counterfact"].examples)
    occupation = tasks["occupation"]
    assert 10 <= len(occupation.examples[0].choices) <= 16
    assert len({e.choices for e in occupation.examples}) == 1
    for e in occupation.examples:  # the emphasised first sentence states the labelled occupation
        assert e.prompt.startswith(e.emphasize) and e.choices[e.label] in e.emphasize


def test_sentiment_labels_balanced(tasks):
    for split in SPLITS:
        labels = [e.label for e in tasks["sentiment"].split(split)]
        assert abs(labels.count(0) - labels.count(1)) <= 1
    queries = [e.prompt.rsplit("Review: ", 1)[1] for e in tasks["sentiment"].examples]
    assert len(set(queries)) >= 150


def test_choices_first_tokens_distinct(tasks, tokenizer):
    for name in ("occupation", "counterfact", "sentiment"):
        for e in tasks[name].examples:
            first = {tokenizer(" " + c, add_special_tokens=False)["input_ids"][0] for c in e.choices}
            assert len(first) == len(e.choices), (e.id, e.choices)


def test_bad_names():
    with pytest.raises(ValueError, match="unknown task 'biasbios'"):
        load_task("biasbios")
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        load_task("sentiment", "dev")
    with pytest.raises(ValueError, match="unknown split 'eval'"):
        load_task("sentiment").split("eval")


def test_generator_is_deterministic_and_matches_shipped_files(tokenizer, tasks):
    first, second = make_tasks.build_tasks(tokenizer), make_tasks.build_tasks(tokenizer)
    assert first == second
    assert make_tasks.build_tasks(tokenizer, seed=1)["sentiment"] != first["sentiment"]
    for name, rows in first.items():
        shipped = (make_tasks.OUT_DIR / f"{name}.jsonl").read_text(encoding="utf-8")
        assert make_tasks.dump_jsonl(rows) == shipped, (
            f"stale {name}.jsonl: run python -m probes.datasets.make_tasks"
        )


def test_split_assignment_is_stratified():
    strata = ["a"] * 100 + ["b"] * 100
    splits = make_tasks._assign_splits(strata, random.Random(0))
    assert splits.count("train") == 90 and splits.count("validation") == 30
    assert sum(s == "train" for s, k in zip(splits, strata, strict=True) if k == "a") == 45


def test_check_choices_names_colliding_pair(tokenizer):
    with pytest.raises(ValueError, match="'Paris' and 'Paris'"):
        make_tasks.check_choices(tokenizer, ["Paris", "Paris"])


FIELDS = {"name": "Amara Okafor", "occupation": "pharmacist"}


@pytest.mark.parametrize(
    ("text", "valid", "accuracy"),
    [
        ('{"name": "Amara Okafor", "occupation": "pharmacist"}', True, 1.0),
        ('Sure! {"name": " amara okafor ", "occupation": "Senior Pharmacist"} Hope it helps.', True, 1.0),
        ('{"name": "Amara Okafor", "occupation": "nurse"}', True, 0.5),
        ('{"name": "Amara Okafor"}', True, 0.5),
        ('{"name": "Amara Okafor", "occupation": "pharmacist"', False, 0.0),
        ("{'name': 'Amara Okafor', 'occupation': 'pharmacist'}", False, 0.0),
        ("Amara Okafor is a pharmacist.", False, 0.0),
        ('{"name": "Amara Okafor", "details": {"occupation": "x"}, "occupation": "pharmacist"} {', True, 1.0),
        ('{"name": "Amara Okafor {Amy}", "occupation": "pharmacist"}', True, 1.0),
        (
            "{\u201cname\u201d: \u201cAmara Okafor\u201d, \u201coccupation\u201d: \u201cpharmacist\u201d}",
            True,
            1,
        ),
        ('{"name": "Amara \u201cAmy\u201d Okafor", "occupation": "pharmacist"}', True, 0.5),
        ('{"a": 1} {"name": "Amara Okafor", "occupation": "pharmacist"}', True, 0.0),
    ],
)
def test_json_metrics(text, valid, accuracy):
    assert json_metrics(text, FIELDS) == {"json_valid": valid, "field_accuracy": accuracy}


def test_no_pronoun():
    assert no_pronoun("They work as a pharmacist. Then Sheila thanked the hero and Theo.")
    assert no_pronoun("Their occupation is pharmacist; they helped themselves.")
    assert not no_pronoun("They are a pharmacist and she lives in Leeds.")
    assert not no_pronoun("HIS job is pharmacist.")
    assert not no_pronoun("He's a pharmacist.")
    assert not no_pronoun("I met her.")


def test_choice_correct():
    assert choice_correct([-1.0, -2.5], 0)
    assert not choice_correct([-1.0, -2.5], 1)
    assert not choice_correct([-1.0, -1.0], 0)  # ties are wrong
    assert choice_correct([-3.0, -4.0, -0.5], 2)
    with pytest.raises(ValueError, match="label 2 out of range"):
        choice_correct([-1.0, -2.0], 2)


def test_intervals():
    # Wilson 8/10 at z = 1.96, by hand: centre 0.99208 / 1.38416 = 0.71674,
    # half-width (1.96 / 1.38416) * sqrt(0.016 + 0.009604) = 0.22658 -> (0.4902, 0.9433).
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 20)[0] == 0.0 and wilson_interval(20, 20)[1] == 1.0
    with pytest.raises(ValueError, match="n >= 1"):
        wilson_interval(0, 0)
    # mean 2.5, sd sqrt(5/3); Student t at 3 degrees of freedom (table value 3.182446)
    # -> half-width 3.1824463 * 1.2909944 / 2 = 2.0542603
    low, high = mean_interval([1.0, 2.0, 3.0, 4.0])
    assert low == pytest.approx(0.4457397, abs=1e-6) and high == pytest.approx(4.5542603, abs=1e-6)
    assert mean_interval([0.5, 0.5, 0.5]) == (0.5, 0.5)
    with pytest.raises(ValueError, match="at least 2"):
        mean_interval([1.0])
    assert math.isclose(sum(wilson_interval(5, 10)) / 2, 0.5)
