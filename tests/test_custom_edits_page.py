"""docs/engine/custom-edits.md runs as pasted: its Python blocks, in order, in one namespace, on
the embedded model (each block asserts what the page says it shows)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs/engine/custom-edits.md"

pytestmark = pytest.mark.real


def test_every_snippet_runs_in_order(capsys, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 3
    page = types.ModuleType("custom_edits_page")  # as pasted into a fresh session
    monkeypatch.setitem(sys.modules, page.__name__, page)
    for code in blocks:
        exec(compile(code, str(PAGE), "exec", dont_inherit=True), page.__dict__)  # the page's snippets
    out = capsys.readouterr().out
    change = float(re.search(r"largest logit change: ([\d.]+)", out).group(1))
    assert change > 0
    first, other = map(float, re.search(r"head 0 -> first token: ([\d.]+), head 1: ([\d.]+)", out).groups())
    assert first > other  # the biased head moved toward the first token, the other did not
