"""Prompts and labels of the shipped probe tasks (`probe_data`): harmful vs harmless requests,
review sentiment, and the answer-conditioned designs on counterfact and sentiment (see
`probes.head_probes` for the labelling)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from heads._util.validation import is_int, short_repr
from heads.errors import HeadsteerValueError

if TYPE_CHECKING:
    from probes.datasets.tasks import TaskExample

__all__ = ["PROBE_TASKS", "ProbeData", "probe_data"]


PROBE_TASKS = ("harmful", "sentiment", "counterfact", "sentiment_answer")


# --------------------------------------------------------------------------- shipped data
@dataclass
class ProbeData:
    """Prompts and labels for one probe task (`probe_data`).

    Attributes:
        name: one of `PROBE_TASKS`.
        prompts: N prompt texts (or chats).
        labels: N labels, 0/1.
        groups: N group ids (the example each row came from).
        chat: whether prompts go through the chat template.
        description: what label 1 and label 0 mean.
    """

    name: str
    prompts: list
    labels: list[int]
    groups: list[int]
    chat: bool
    description: str


def _right_choice(example: TaskExample) -> str:
    """The right answer of a choice-task example (its `choices` and `label` are set)."""
    return cast(tuple[str, ...], example.choices)[cast(int, example.label)]


def _answer_rows(examples: Sequence[TaskExample]) -> tuple[list[str], list[int], list[int]]:
    prompts, labels, groups = [], [], []
    for g, e in enumerate(examples):
        for i, choice in enumerate(cast(tuple[str, ...], e.choices)):  # choice tasks have choices
            prompts.append(e.prompt + " " + choice)
            labels.append(int(i == e.label))
            groups.append(g)
    return prompts, labels, groups


def probe_data(name: str, split: str = "train", limit: int | None = None) -> ProbeData:
    """Prompts and labels for a shipped probe task (see the module docstring for the labelling).

    Args:
        name: "harmful", "sentiment", "counterfact" or "sentiment_answer".
        split: "train" (default) or "test" ("validation" too, except for "harmful", whose
            files have only train/test).
        limit: at most `limit` examples (harmful: per class; answer tasks: examples, two rows
            each); default all.

    Raises:
        ValueError: unknown name or split, or a bad limit.
    """
    from probes.datasets.requests import load_requests
    from probes.datasets.tasks import load_task

    if name not in PROBE_TASKS:
        raise HeadsteerValueError(f"unknown probe task {short_repr(name)}: use one of {PROBE_TASKS}")
    if limit is not None and (not is_int(limit) or limit < 1):
        raise HeadsteerValueError(f"limit must be a positive int, got {short_repr(limit)}")
    if name == "harmful":
        if split not in ("train", "test"):
            raise HeadsteerValueError(
                f"the request sets have splits 'train' and 'test', got {short_repr(split)}"
            )
        bad = load_requests("harmful", split)[:limit]
        good = load_requests("harmless", split)[:limit]
        chats = [[{"role": "user", "content": r["prompt"]}] for r in bad + good]
        labels = [1] * len(bad) + [0] * len(good)
        return ProbeData(name, chats, labels, list(range(len(chats))), True, "1 = harmful, 0 = harmless")
    task = "sentiment" if name.startswith("sentiment") else "counterfact"
    examples = load_task(task, split).examples[:limit]
    if name == "sentiment":
        prompts = [e.prompt for e in examples]
        labels = [int(_right_choice(e) == "positive") for e in examples]
        return ProbeData(
            name, prompts, labels, list(range(len(prompts))), False, "1 = positive review, 0 = negative"
        )
    prompts, labels, groups = _answer_rows(examples)
    what = (
        "1 = answer from the context (current fact), 0 = from memory (previous fact)"
        if task == "counterfact"
        else "1 = right sentiment label, 0 = wrong label"
    )
    return ProbeData(name, prompts, labels, groups, False, what)
