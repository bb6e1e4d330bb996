"""The prompting baseline of every task: an instruction that asks for the steered behaviour.

A steering result is only worth reporting if it beats simply asking (Wu et al. 2025, AxBench:
prompting outperformed every steering method they tested). For each shipped task
(`probes.datasets.tasks.TASKS`) `INSTRUCTIONS` holds one sentence, written for this project, that
asks for what the steering methods push towards:

* the span tasks (PASTA, SpotLight, InstABoost, VAR / VHR text: json_format, pronoun_change,
  occupation, counterfact, context_qa): an explicit "pay attention to ..." naming the emphasized
  part, and the format or answer it implies;
* sentiment (ACT, CAA, ITI; no span): the instruction alone.

`with_instruction(example)` puts the sentence on its own line before the prompt (inside the user
message of a chat task); the emphasized span is unchanged, so "prompt + method" steers the same
span of the instructed prompt.
"""

from __future__ import annotations

from dataclasses import replace

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from probes.datasets.tasks import TASKS, TaskExample

__all__ = ["INSTRUCTIONS", "instruction", "with_instruction"]

INSTRUCTIONS: dict[str, str] = {
    "json_format": (
        "Pay attention to the instruction at the end and follow it exactly: reply with one JSON "
        "object and nothing else."
    ),
    "pronoun_change": (
        "Pay attention to the instruction at the end and follow it exactly: write 'they' wherever "
        "the text has 'she' or 'he', and name the person's occupation."
    ),
    "occupation": "Pay attention to the first sentence: it states the person's occupation.",
    "counterfact": 'Pay attention to the sentence that starts with "Currently": it states the current fact.',
    "context_qa": "Pay attention to the passage: answer from it, not from what you know.",
    "sentiment": "Classify the sentiment of the last review as positive or negative.",
}


def instruction(task: str) -> str:
    """The baseline instruction of `task`.

    Raises:
        ValueError: an unknown task.
    """
    if task not in INSTRUCTIONS:
        raise HeadsteerValueError(f"unknown task {short_repr(task)}: use one of {TASKS}")
    return INSTRUCTIONS[task]


def with_instruction(example: TaskExample, task: str | None = None) -> TaskExample:
    """`example` with its task's instruction on a line before the prompt (`task` default: read
    from the example id `"<task>-<nnn>"`); the emphasized span and the answers are unchanged.

    Raises:
        ValueError: an unknown task; an instruction that would repeat the emphasized span.
    """
    name = task if task is not None else example.id.rsplit("-", 1)[0]
    prompt = f"{instruction(name)}\n{example.prompt}"
    if example.emphasize is not None and prompt.count(example.emphasize) != 1:
        raise HeadsteerValueError(f"the {name} instruction repeats the emphasized span of {example.id}")
    return replace(example, prompt=prompt)
