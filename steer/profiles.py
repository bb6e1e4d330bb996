"""Head profiles shipped with headsteer for the embedded model (`steer/data/*.json`).

* `pasta`: PASTA multi-task profile of SmolLM2-135M-Instruct, produced by
  `headsteer profile pasta` (see README, "Shipped head profiles", for the exact command).
* `act`: ACT head filtering of SmolLM2-135M-Instruct on the sentiment task's train split,
  produced by `headsteer profile act`.

Both are `{"layer": [heads]}` JSON files, the shape `Pasta`, `Act`, `HeadSet.parse` and
`headsteer generate --pasta-heads FILE` accept.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from heads.model.loading import EMBEDDED_MODEL

__all__ = ["KINDS", "profile_path", "shipped_profile"]

KINDS = ("pasta", "act")


def profile_path(kind: str) -> str:
    """Path of the shipped `kind` profile file (which may not exist yet in a source checkout)."""
    if kind not in KINDS:
        raise HeadsteerValueError(f"unknown profile kind {short_repr(kind)}: use one of {KINDS}")
    return str(resources.files("steer").joinpath(f"data/{EMBEDDED_MODEL.lower()}.{kind}.json"))


def shipped_profile(kind: str, model_name: str) -> str:
    """The shipped `kind` profile for `model_name`.

    Raises:
        ValueError: unknown kind, or no shipped profile for this model (profile it with
            `headsteer profile pasta|act` and pass the file instead).
    """
    path = profile_path(kind)
    if model_name != EMBEDDED_MODEL or not Path(path).is_file():
        raise HeadsteerValueError(
            f"no shipped {kind} head profile for model {short_repr(model_name)} (only {EMBEDDED_MODEL}); "
            f"run `headsteer profile {kind}` and pass the file"
        )
    return path
