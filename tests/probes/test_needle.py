"""The needle-in-a-haystack generator: exact lengths, exact needle ranges, deterministic for a seed."""

from __future__ import annotations

import pytest

from heads.errors import HeadsteerValueError
from probes.datasets.needle import needle_task, needle_tasks


@pytest.mark.parametrize("length", [64, 1000, 4096])
def test_exact_length_and_needle(tokenizer, length):
    task = needle_task(tokenizer, length, depth=0.25, seed=3)
    assert task.length == length
    a, b = task.needle
    assert tokenizer.decode(task.input_ids[a:b]).strip() == task.code
    assert task.input_ids[a:b] == task.answer_ids
    # the question at the end names the needle's key; the haystack before the needle holds it once
    text = task.text(tokenizer)
    assert text.count(f"The secret code of the {task.key} is {task.code}.") == 1
    assert text.endswith(f"Answer: the secret code of the {task.key} is")
    # the QRHead passages: the needle sentence is in the gold passage only
    needle = f"The secret code of the {task.key} is {task.code}."
    assert [needle in p for p in task.passages].index(True) == task.gold
    assert sum(needle in p for p in task.passages) == 1 and len(task.passages) >= 2


def test_depth_and_seed(tokenizer):
    early, late = (needle_task(tokenizer, 2048, depth=d, seed=1) for d in (0.05, 0.95))
    assert early.needle[0] < 2048 * 0.15 < 2048 * 0.85 < late.needle[0]
    assert needle_task(tokenizer, 512, seed=7) == needle_task(tokenizer, 512, seed=7)
    assert needle_task(tokenizer, 512, seed=7).input_ids != needle_task(tokenizer, 512, seed=8).input_ids
    tasks = needle_tasks(tokenizer, lengths=(128, 256), depths=(0.0, 1.0))
    assert [t.length for t in tasks] == [128, 128, 256, 256] and tasks[0].depth == 0.0


def test_bad_input(tokenizer):
    for kw in ({"length": 10}, {"length": 128, "depth": 1.5}, {"length": 128, "seed": -1}):
        with pytest.raises(HeadsteerValueError):
            needle_task(tokenizer, **kw)
    with pytest.raises(TypeError, match="tokenizer"):
        needle_task("not a tokenizer", 128)
    with pytest.raises(HeadsteerValueError, match="non-empty"):
        needle_tasks(tokenizer, lengths=())


def test_the_docstring_examples_show_what_the_code_returns(tokenizer):
    """The module docstring's example runs as a doctest (its values were placeholders: key
    "blue door" and code "4821" are not what seed 0 draws); the attributes' examples name seed
    0's key and code; a task's repr leaves out its thousands of ids."""
    import doctest

    from probes.datasets import needle

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(needle, "needle"):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 6 and result.failed == 0
    task = needle_task(tokenizer, 64, seed=0)
    doc = needle.NeedleTask.__doc__ or ""
    assert f'"{task.key}" for seed 0' in doc and f'"{task.code}" for seed 0' in doc
    assert "input_ids" not in repr(task) and len(repr(task)) < 400
