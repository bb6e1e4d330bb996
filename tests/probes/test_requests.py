"""The shipped harmful / harmless request sets."""

import pytest

from probes.datasets.requests import load_requests


def test_sizes_categories_and_splits():
    harmful, harmless = load_requests("harmful"), load_requests("harmless")
    assert len(harmful) >= 100 and len(harmless) >= 100
    for rows in (harmful, harmless):
        prompts = [r["prompt"] for r in rows]
        assert len(set(prompts)) == len(prompts) and all(p.strip() for p in prompts)
        assert len({r["category"] for r in rows}) >= 8
    assert not {r["prompt"] for r in harmful} & {r["prompt"] for r in harmless}
    train, test = load_requests("harmful", "train"), load_requests("harmful", "test")
    assert len(train) + len(test) == len(harmful) and not {r["prompt"] for r in train} & {
        r["prompt"] for r in test
    }
    assert len(test) == len(harmful) // 5


def test_bad_names():
    with pytest.raises(ValueError, match="unknown request set"):
        load_requests("evil")
    with pytest.raises(ValueError, match="unknown split"):
        load_requests("harmful", "dev")
