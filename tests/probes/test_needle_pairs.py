"""Clean / corrupted needle pairs (`probes.datasets.needle_pairs`): exact lengths, the prompts
differ only in the needle's code, the answer is the first differing code token (not SmolLM2's
shared space), and on the embedded model the logit difference follows the code in the haystack."""

from __future__ import annotations

import pytest
import torch

from heads.errors import HeadsteerTypeError, HeadsteerValueError
from probes.datasets.needle import needle_task
from probes.datasets.needle_pairs import needle_pair_tasks, needle_pairs


@pytest.mark.parametrize("length", [128, 2048])
def test_pairs_differ_only_in_the_needle_code(tokenizer, length):
    pairs = needle_pairs(tokenizer, length, n=3, depth=0.3, seed=5)
    assert pairs.n == 3 and pairs.width == length and bool(pairs.attention_mask.all())
    for i in range(pairs.n):
        clean, corr = pairs.clean_ids[i], pairs.corrupted_ids[i]
        diff = torch.nonzero(clean != corr)[:, 0]
        task = needle_task(tokenizer, length - 1, depth=0.3, seed=5 + i)  # SmolLM2: one shared space
        lo, hi = task.needle
        assert int(diff.min()) >= lo and int(diff.max()) < hi  # only the code's tokens differ
        needle = int(pairs.positions["needle"][i])
        assert needle == int(diff.min())  # the first differing code token is named
        # the prompt ends with the code's shared start (a bare space), so the next token is a digit
        assert tokenizer.decode(clean[-1:]) == " " and clean[-1] == clean[lo]
        answer, foil = int(pairs.answers[i, 0]), int(pairs.counterfactuals[i, 0])
        assert answer == int(clean[needle]) and foil == int(corr[needle]) and answer != foil
        assert tokenizer.decode([answer]).isdigit() and tokenizer.decode([foil]).isdigit()
        assert int(pairs.positions["end"][i]) == length - 1


def test_same_seed_same_pairs_and_bad_input(tokenizer):
    a, b = needle_pairs(tokenizer, 256, n=2, seed=9), needle_pairs(tokenizer, 256, n=2, seed=9)
    assert torch.equal(a.clean_ids, b.clean_ids) and torch.equal(a.corrupted_ids, b.corrupted_ids)
    assert not torch.equal(a.clean_ids, needle_pairs(tokenizer, 256, n=2, seed=10).clean_ids)
    for bad in ({"length": 10}, {"length": 256, "n": 0}, {"length": 256, "depth": 1.5}, {"seed": -1}):
        with pytest.raises(HeadsteerValueError):
            needle_pairs(tokenizer, **{"length": 256, **bad})
    with pytest.raises(HeadsteerValueError, match="1024 x 1048576"):
        needle_pairs(tokenizer, 1 << 20, n=1024)  # refused at once, not hours of tokenizing
    with pytest.raises(HeadsteerTypeError, match="tokenizer"):
        needle_pairs("gpt2", 256)


def test_embedded_model_reads_the_code_from_the_haystack(smol):
    """SmolLM2 copies the needle's code: the logit difference (clean code's digit minus the
    corrupted code's) is positive on every clean prompt and negative on every corrupted one."""
    pairs = needle_pairs(smol.tokenizer, 256, n=3, seed=0)
    r = torch.arange(pairs.n)
    a, f = pairs.answers[:, 0], pairs.counterfactuals[:, 0]
    with torch.no_grad():
        clean = smol.model(pairs.clean_ids, attention_mask=pairs.attention_mask).logits[:, -1]
        corr = smol.model(pairs.corrupted_ids, attention_mask=pairs.attention_mask).logits[:, -1]
    assert bool(((clean[r, a] - clean[r, f]) > 1).all())
    assert bool(((corr[r, a] - corr[r, f]) < -1).all())


def test_pair_tasks_are_the_documents_behind_the_pairs(tokenizer):
    """`needle_pair_tasks` gives each pair's `NeedleTask` (its QRHead item): the clean prompt is
    the task's ids plus the codes' shared start, the needle and the code are the task's; and the
    batch prints its shapes, not its tensors."""
    pairs = needle_pairs(tokenizer, 512, n=3, depth=0.2, seed=4)
    tasks = needle_pair_tasks(tokenizer, 512, n=3, depth=0.2, seed=4)
    for i, task in enumerate(tasks):
        k = pairs.width - task.length
        assert k >= 0 and pairs.clean_ids[i, : task.length].tolist() == task.input_ids
        assert int(pairs.positions["needle"][i]) == task.needle[0] + k
        assert tokenizer.decode(pairs.clean_ids[i, task.needle[0] : task.needle[1]]).strip() == task.code
        assert sum(f"is {task.code}." in p for p in task.passages) == 1 and task.gold < len(task.passages)
    assert repr(pairs) == "PairBatch(n=3, width=512, answers=1, positions=['needle', 'end'])"
