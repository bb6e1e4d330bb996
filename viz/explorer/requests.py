"""The explorer's request bodies as pydantic models: one per `POST` endpoint.

Each field is checked by its validator with the message the page shows (`"prompt must be a
non-empty string"`, `"layer must be an int in 0..2, got 7"`, ...); a field a model does not
have is named before any value is read (`viz.web.body.validated`). Checks against the model
(a head index) read the `HeadModel` from the validation context (`{"model": hm}`). What needs
the tokenizer or the steering parser (token counts, spans, an intervention's edits) is checked
by the endpoint before its job starts (`viz.explorer.state.ExplorerState.encoded`).
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from heads._util.validation import check_int, short_repr
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import check_encodable
from viz.explorer.jobs import JOB_ID, Jobs
from viz.explorer.limits import MAX_ANSWER_CHARS, MAX_NEW_TOKENS, MAX_PROMPT_CHARS, SCORES
from viz.explorer.steering import STEER_FIELDS

__all__ = [
    "CancelRequest",
    "GenerateRequest",
    "HeadRequest",
    "PatchRequest",
    "PatternRequest",
    "PrepareRequest",
    "ScoresRequest",
]


def text(value: object, key: str, limit: int = MAX_PROMPT_CHARS, *, space: bool = False) -> str:
    """`value`, a non-empty string of at most `limit` characters (white space alone only with
    `space`: a patching answer may be the token "\\n" or " "), valid Unicode."""
    if not isinstance(value, str) or not (value if space else value.strip()):
        raise HeadsteerValueError(f"{key} must be a non-empty string")
    if len(value) > limit:
        raise HeadsteerValueError(f"{key} has {len(value)} characters, more than the limit {limit}")
    check_encodable(value, key)  # a lone surrogate, named by field (the tokenizer's own error does not)
    return value


def flag(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise HeadsteerValueError(f"{key} must be true or false, got {short_repr(value)}")
    return value


def tab_id(value: object) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or (value != "" and not JOB_ID.fullmatch(value)):
        raise HeadsteerValueError("tab must be 8-64 characters of letters, digits, '_' or '-'")
    return value


class _Request(BaseModel):
    """Unknown fields are refused; a missing field runs its validator on None (so its message is
    the field's own). The validators of the fields several requests share live here."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @field_validator("prompt", mode="before", check_fields=False)
    @classmethod
    def _prompt(cls, v: object) -> str:
        return text(v, "prompt")

    @field_validator("raw", mode="before", check_fields=False)
    @classmethod
    def _raw(cls, v: object) -> bool | None:
        return None if v is None else flag(v, "raw")

    @field_validator("layer", "head", mode="before", check_fields=False)
    @classmethod
    def _index(cls, v: object, info: ValidationInfo) -> int:
        model = (info.context or {})["model"]
        n = model.n_layers if info.field_name == "layer" else model.n_heads
        return check_int(str(info.field_name), v, lo=0, hi=n - 1)

    @field_validator("job", mode="before", check_fields=False)
    @classmethod
    def _job(cls, v: object) -> str:
        return Jobs.check_id(v)

    @field_validator("tab", mode="before", check_fields=False)
    @classmethod
    def _tab(cls, v: object) -> str:
        return tab_id(v)


class ScoresRequest(_Request):
    """`POST /api/scores`: the overview grid of one score."""

    prompt: str = None  # type: ignore[assignment]  # None: refused by the validator, named
    score: str = "span"
    job: str = None  # type: ignore[assignment]  # None: the server draws an id
    raw: bool | None = None

    @field_validator("score", mode="before")
    @classmethod
    def _score(cls, v: object) -> str:
        if v is None:
            return "span"
        if v not in SCORES:
            raise HeadsteerValueError(f"score must be one of {SCORES}, got {short_repr(v)}")
        return str(v)


class PrepareRequest(_Request):
    """`POST /api/prepare`: record every head's pattern on the prompt for the tab."""

    prompt: str = None  # type: ignore[assignment]
    tab: str = ""
    raw: bool | None = None
    job: str = None  # type: ignore[assignment]


class PatternRequest(_Request):
    """`POST /api/pattern`: one head's `[T, T]` pattern, a long prompt's overview of it (`pool`:
    its blocks' `"max"` or `"mean"`), or the exact window `q0:q1, k0:k1` of it (all four given;
    checked against the prompt's tokens by the endpoint)."""

    prompt: str = None  # type: ignore[assignment]
    layer: int = None  # type: ignore[assignment]
    head: int = None  # type: ignore[assignment]
    tab: str = ""
    raw: bool | None = None
    job: str = None  # type: ignore[assignment]
    pool: str = "max"
    q0: int | None = None
    q1: int | None = None
    k0: int | None = None
    k1: int | None = None

    @field_validator("pool", mode="before")
    @classmethod
    def _pool(cls, v: object) -> str:
        if v is None:
            return "max"
        if v not in ("max", "mean"):
            raise HeadsteerValueError(f"pool must be 'max' or 'mean', got {short_repr(v)}")
        return str(v)

    @field_validator("q0", "q1", "k0", "k1", mode="before")
    @classmethod
    def _bound(cls, v: object, info: ValidationInfo) -> int | None:
        return None if v is None else check_int(str(info.field_name), v, lo=0)

    @model_validator(mode="after")
    def _window_whole(self) -> "PatternRequest":
        given = [k for k in ("q0", "q1", "k0", "k1") if getattr(self, k) is not None]
        if given and len(given) != 4:
            missing = [k for k in ("q0", "q1", "k0", "k1") if k not in given]
            raise HeadsteerValueError(
                f"a pattern window needs q0, q1, k0 and k1; missing {', '.join(missing)}"
            )
        return self

    @property
    def window(self) -> tuple[int, int, int, int] | None:
        """`(q0, q1, k0, k1)` when a window is asked for, else None."""
        if self.q0 is None or self.q1 is None or self.k0 is None or self.k1 is None:
            return None
        return (self.q0, self.q1, self.k0, self.k1)


class HeadRequest(_Request):
    """`POST /api/head`: one head's card."""

    prompt: str = None  # type: ignore[assignment]
    layer: int = None  # type: ignore[assignment]
    head: int = None  # type: ignore[assignment]
    tab: str = ""
    raw: bool | None = None
    job: str = None  # type: ignore[assignment]


class GenerateRequest(_Request):
    """`POST /api/generate`: a greedy continuation, unsteered or steered by one method.

    The steering fields (`method`, `heads`, the method's parameter) are kept as sent and built
    by `viz.explorer.steering.parse_steering`, which needs the model and the prompt's span."""

    prompt: str = None  # type: ignore[assignment]
    steered: bool = False
    max_new_tokens: int = 32
    job: str = None  # type: ignore[assignment]
    raw: bool | None = None
    method: Any = None
    heads: Any = None
    alpha: Any = None
    tau: Any = None
    multiplier: Any = None
    beta: Any = None
    eps: Any = None
    mode: Any = None

    @field_validator("steered", mode="before")
    @classmethod
    def _steered(cls, v: object) -> bool:
        return False if v is None else flag(v, "steered")

    @field_validator("max_new_tokens", mode="before")
    @classmethod
    def _n_new(cls, v: object) -> int:
        return 32 if v is None else check_int("max_new_tokens", v, lo=1, hi=MAX_NEW_TOKENS)

    def steering(self) -> dict[str, Any]:
        """The steering fields the request sent, as sent (`{"method": ..., "alpha": ...}`)."""
        return {k: getattr(self, k) for k in sorted(self.model_fields_set & STEER_FIELDS)}


class PatchRequest(_Request):
    """`POST /api/patch`: activation patching of one clean / corrupted pair."""

    clean: str = None  # type: ignore[assignment]
    corrupted: str = None  # type: ignore[assignment]
    answer: str = None  # type: ignore[assignment]
    counterfactual: str | None = None
    job: str = None  # type: ignore[assignment]
    raw: bool = True  # pair work runs without the chat template by default, as `encode_pairs`

    @field_validator("clean", "corrupted", mode="before")
    @classmethod
    def _prompts(cls, v: object, info: ValidationInfo) -> str:
        return text(v, str(info.field_name))

    @field_validator("answer", mode="before")
    @classmethod
    def _answer(cls, v: object) -> str:
        return text(v, "answer", MAX_ANSWER_CHARS, space=True)

    @field_validator("counterfactual", mode="before")
    @classmethod
    def _cf(cls, v: object) -> str | None:
        return None if v in (None, "") else text(v, "counterfactual", MAX_ANSWER_CHARS, space=True)

    @field_validator("raw", mode="before")
    @classmethod
    def _raw(cls, v: object) -> bool:
        return True if v is None else flag(v, "raw")


class CancelRequest(_Request):
    """`POST /api/cancel`: stop one job (its id is required here)."""

    job: str = None  # type: ignore[assignment]

    @field_validator("job", mode="before")
    @classmethod
    def _job(cls, v: object) -> str:
        if not isinstance(v, str) or not JOB_ID.fullmatch(v):
            raise HeadsteerValueError("job must be 8-64 characters of letters, digits, '_' or '-'")
        return v
