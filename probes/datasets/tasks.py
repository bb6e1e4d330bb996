"""Evaluation task sets for attention steering, written for this project.

`probes/data/tasks/<name>.jsonl` holds one example a line, built by `python -m probes.datasets.make_tasks`
(seeded, deterministic) from hand-written lists and templates about fictional people:

- `json_format`: a biography + `Answer in JSON format with the keys "name" and "occupation".`
  (chat, scoring "generate"; `fields` = expected name and occupation, `target` = "{").
- `pronoun_change`: a she/he biography + an instruction to substitute 'they' and give the
  occupation (chat, "generate"; `fields` as above, `target` = "They").
- `occupation`: BiasBios-style; the first sentence (`emphasize`) states the occupation, then
  distracting details, then `"{First}'s occupation is"` (plain, "choice" over 15 occupations).
- `counterfact`: `Previously, ... {old}. Currently, ... {new}. {cue}` (plain, "choice";
  `choices` = [new, old], `label` = 0, `emphasize` = the "Currently, ..." sentence).
- `sentiment`: 4 balanced few-shot demonstrations + a query review (plain, "choice";
  `choices` = ["positive", "negative"], no emphasis).
- `context_qa`: a passage (`emphasize`) that contradicts a well-known real fact (a capital, an
  official language, a landmark's city), then a question about it (plain, "choice";
  `choices` = [the passage's value, the true value], `label` = 0: context-faithful).

Every task has 200 examples with fixed splits: 90 "train", 30 "validation" and 80 "test",
stratified by label (or relation kind / pronoun). For choice tasks the first token of
`" " + choice` differs between the choices of an example.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import cast

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError

__all__ = ["SPLITS", "TASKS", "Task", "TaskExample", "load_task"]

TASKS = ("json_format", "pronoun_change", "occupation", "counterfact", "sentiment", "context_qa")
SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class TaskExample:
    """One example of a task.

    Attributes:
        id: `"<task>-<nnn>"`, unique within the task.
        split: "train", "validation" or "test".
        prompt: the model input (a user message for chat tasks, raw text otherwise).
        emphasize: a substring of `prompt` (occurring exactly once) to steer attention to, or None.
        target: expected first token of a good answer for "generate" tasks; None for choice tasks.
        choices: answer strings for "choice" tasks (scored as `" " + choice`); None otherwise.
        label: index of the correct entry of `choices`; None for "generate" tasks.
        fields: expected values ({"name", "occupation"}) for "generate" tasks; None otherwise.
        chat: whether the prompt is meant to go through the chat template.
        scoring: "generate" (score generated text) or "choice" (compare choice log-probs).
    """

    id: str
    split: str
    prompt: str
    emphasize: str | None
    target: str | None
    choices: tuple[str, ...] | None
    label: int | None
    fields: dict[str, str] | None
    chat: bool
    scoring: str

    @property
    def answer(self) -> str:
        """The text whose first token is the right start of the answer: `target` for generate
        tasks, `" " + choices[label]` for choice tasks (used by PASTA profiling)."""
        if self.choices is None:
            return cast(str, self.target)  # a generate task always has a target
        return " " + self.choices[cast(int, self.label)]  # a choice task always has a label

    @classmethod
    def from_row(cls, row: dict) -> TaskExample:
        """Build from one JSONL row (lists become tuples)."""
        choices = row.get("choices")
        return cls(
            id=row["id"],
            split=row["split"],
            prompt=row["prompt"],
            emphasize=row.get("emphasize"),
            target=row.get("target"),
            choices=tuple(choices) if choices is not None else None,
            label=row.get("label"),
            fields=row.get("fields"),
            chat=bool(row["chat"]),
            scoring=row["scoring"],
        )


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise HeadsteerValueError(f"unknown split {short_repr(split)}: use one of {SPLITS}")


@dataclass(frozen=True)
class Task:
    """A task set: its examples (file order) and how to run and score them.

    Attributes:
        name: one of `TASKS`.
        examples: the examples, in file order.
        chat: whether prompts go through the chat template.
        scoring: "generate" or "choice".
    """

    name: str
    examples: tuple[TaskExample, ...]
    chat: bool
    scoring: str

    def split(self, name: str) -> list[TaskExample]:
        """The examples of split `name` ("train", "validation" or "test"), in file order.

        Raises:
            ValueError: unknown split name.
        """
        _check_split(name)
        return [e for e in self.examples if e.split == name]

    def __len__(self) -> int:
        return len(self.examples)


def load_task(name: str, split: str | None = None) -> Task:
    """Load the shipped task `name`, optionally keeping one split.

    Args:
        name: one of `TASKS`.
        split: None (all 200 examples), "train" (90), "validation" (30) or "test" (80).

    Raises:
        ValueError: unknown task or split (the bad value is named).
    """
    if name not in TASKS:
        raise HeadsteerValueError(f"unknown task {short_repr(name)}: use one of {TASKS}")
    if split is not None:
        _check_split(split)
    text = resources.files("probes").joinpath(f"data/tasks/{name}.jsonl").read_text(encoding="utf-8")
    examples = tuple(TaskExample.from_row(json.loads(line)) for line in text.splitlines() if line.strip())
    if not examples:
        raise HeadsteerValueError(f"task {short_repr(name)} has no examples")
    task = Task(name, examples, examples[0].chat, examples[0].scoring)
    if split is None:
        return task
    return Task(name, tuple(task.split(split)), task.chat, task.scoring)
