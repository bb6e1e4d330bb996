"""The shipped lens corpus: rebuilt byte-identically, loads, bad n refused."""

import pytest

from heads import HeadsteerValueError
from probes.datasets.corpus import build_corpus, load_corpus


def test_corpus_rebuilds_identically(tmp_path):
    from importlib import resources

    shipped = resources.files("probes").joinpath("data/corpus.jsonl").read_text(encoding="utf-8")
    assert build_corpus(tmp_path / "c.jsonl").read_text(encoding="utf-8") == shipped
    texts = load_corpus()
    assert len(texts) >= 200 and len(set(texts)) > 150
    assert load_corpus(3) == texts[:3]
    with pytest.raises(HeadsteerValueError, match="positive"):
        load_corpus(0)
