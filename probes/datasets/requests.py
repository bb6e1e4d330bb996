"""Harmful and harmless request sets for safety-head attribution (docs/methods/safety.md).

Written for this project: short, AdvBench-style requests with no operational content
(`probes/data/harmful.jsonl`) and matched everyday requests (`probes/data/harmless.jsonl`),
one `{"prompt", "category"}` object a line. A fixed split holds every 5th request of each
file out as `"test"`; the rest is `"train"`.
"""

from __future__ import annotations

import json
from importlib import resources

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError

__all__ = ["load_requests"]

_KINDS = ("harmful", "harmless")
_SPLITS = (None, "train", "test")


def load_requests(kind: str, split: str | None = None) -> list[dict]:
    """Requests of `kind` ("harmful" or "harmless"), optionally one split ("train" / "test").

    Returns `{"prompt", "category"}` dicts in file order.

    Raises:
        ValueError: unknown kind or split.
    """
    if kind not in _KINDS:
        raise HeadsteerValueError(f"unknown request set {short_repr(kind)}: use one of {_KINDS}")
    if split not in _SPLITS:
        raise HeadsteerValueError(f"unknown split {short_repr(split)}: use None, 'train' or 'test'")
    text = resources.files("probes").joinpath(f"data/{kind}.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if split is None:
        return rows
    return [r for i, r in enumerate(rows) if (i % 5 == 4) == (split == "test")]
