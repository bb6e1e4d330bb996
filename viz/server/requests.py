"""`headsteer serve`'s request bodies as pydantic models (OpenAI's fields plus `steer` and
`emphasize`).

`ChatRequest` (`/v1/chat/completions`) and `CompletionRequest` (`/v1/completions`) check each
field with the message the client gets in its HTTP 400 (`"messages[2].role 'tool' is not
supported"`, `"stream must be true or false, got 1"`, ...); the model id, the CAA vectors a
request may name and the prompt limit come from the validation context (`ServeContext`).
OpenAI fields the server does not implement are refused by name unless they ask for nothing
(`UNSUPPORTED`); fields that change nothing here are type-checked (`TYPED`); any other field is
ignored, as OpenAI-compatible servers do. `.serve_request()` is the `steer.serving.ServeRequest`
the batcher runs.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationInfo, field_validator, model_validator

from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError

__all__ = [
    "MAX_EMPHASIZE",
    "MAX_MESSAGES",
    "MAX_PROMPT_CHARS",
    "TYPED",
    "UNSUPPORTED",
    "ChatRequest",
    "CompletionRequest",
    "ServeContext",
]

MAX_PROMPT_CHARS = 100_000
"""Longest prompt text (all messages together) a request may send."""
MAX_MESSAGES = 256
"""Most chat messages in one request."""
MAX_EMPHASIZE = 16
"""Most `emphasize` strings in one request."""

UNSUPPORTED: dict[str, tuple[object, ...]] = {
    # OpenAI fields headsteer serve does not implement, each with the values that ask for
    # nothing (compared with their type: `true` is not 1, `0` is not false); any other value is
    # HTTP 400 naming the field, never silently ignored
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None,),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),
    "function_call": (None, "none", "auto"),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0, 0.0),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
}
TYPED: dict[str, type] = {
    "user": str,
    "stream_options": Mapping,
    "parallel_tool_calls": bool,
    "metadata": Mapping,
}
"""Accepted OpenAI fields that change nothing here, type-checked so a malformed one is named."""
SAMPLING = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n")
"""The decoding fields read by `steer.serving.SamplingParams.from_body`."""


@dataclass(frozen=True)
class ServeContext:
    """What a request is checked against: the served model's id and the named CAA vectors."""

    model_id: str
    caa_vectors: Mapping[str, Any] = field(default_factory=dict)


def _same(a: object, b: object) -> bool:
    """`a == b` with the same type (so `True` is not `1` and `0` is not `False`)."""
    return type(a) is type(b) and a == b


def _text_content(content: object, i: int) -> str:
    """Message content: a string, or a list of `{"type": "text", "text": ...}` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, Mapping) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise HeadsteerValueError(
                    f"messages[{i}].content: only text parts are supported, got {short_repr(p)}"
                )
            parts.append(p["text"])
        return "".join(parts)
    raise HeadsteerValueError(f"messages[{i}].content must be a string or a list of text parts")


def _encodable(texts: list[str], chat: bool) -> None:
    from heads.inputs.prompts import check_encodable

    for i, text in enumerate(texts):
        check_encodable(text, f"messages[{i}].content" if chat else "prompt")


class _OpenAIRequest(BaseModel):
    """The validators of the fields both endpoints share (each endpoint declares its fields, in
    the order their errors are reported: model, the prompt, stream, steer, emphasize)."""

    model_config = ConfigDict(extra="allow", arbitrary_types_allowed=True, validate_default=True)

    _params: Any = PrivateAttr(default=None)

    @field_validator("model", mode="before", check_fields=False)
    @classmethod
    def _model(cls, v: object, info: ValidationInfo) -> str | None:
        model_id = _context(info).model_id
        if v not in (None, model_id):
            raise HeadsteerValueError(
                f"unknown model {short_repr(v)}: this server serves {short_repr(model_id)}"
            )
        return model_id

    @field_validator("stream", mode="before", check_fields=False)
    @classmethod
    def _stream(cls, v: object) -> bool:
        if v is None:
            return False
        if not isinstance(v, bool):
            raise HeadsteerValueError(f"stream must be true or false, got {short_repr(v)}")
        return v

    @field_validator("steer", mode="before", check_fields=False)
    @classmethod
    def _steer(cls, v: object, info: ValidationInfo) -> list:
        from steer.serving import parse_steer

        return parse_steer(v, dict(_context(info).caa_vectors))

    @field_validator("emphasize", mode="before", check_fields=False)
    @classmethod
    def _emphasize(cls, v: object) -> list[str] | None:
        if v is None:
            return None
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and len(v) > MAX_EMPHASIZE:
            raise HeadsteerValueError(
                f"emphasize has {len(v)} strings, more than the limit of {MAX_EMPHASIZE}"
            )
        if isinstance(v, list) and all(isinstance(x, str) and x for x in v):
            return list(v)
        raise HeadsteerValueError(
            f"emphasize must be a string or a list of non-empty strings, got {short_repr(v)}"
        )

    @field_validator("stream_options", mode="before", check_fields=False)
    @classmethod
    def _stream_options(cls, v: object) -> dict | None:
        if v is None:
            return None
        if not isinstance(v, Mapping):
            raise HeadsteerValueError(f"stream_options must be an object, got {short_repr(v)}")
        usage = v.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise HeadsteerValueError(
                f"stream_options.include_usage must be true or false, got {short_repr(usage)}"
            )
        return dict(v)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, body: Any) -> Any:
        """OpenAI fields not implemented here (unless they ask for nothing), `n` other than 1,
        and a malformed field that changes nothing: refused by name before the others."""
        if not isinstance(body, Mapping):
            raise HeadsteerValueError("the request body must be a JSON object")
        for key, off in UNSUPPORTED.items():
            if key in body and not any(_same(body[key], o) for o in off):
                raise HeadsteerValueError(
                    f"{key} is not supported by headsteer serve, got {short_repr(body[key])}"
                )
        n = body.get("n")
        if n is not None and not _same(n, 1):
            raise HeadsteerValueError(f"n must be 1 (one answer per request), got {short_repr(n)}")
        for key, kind in TYPED.items():
            if key != "stream_options" and body.get(key) is not None and not isinstance(body[key], kind):
                want = "an object" if kind is Mapping else f"a {kind.__name__}"
                raise HeadsteerValueError(f"{key} must be {want}, got {short_repr(body[key])}")
        return body

    @model_validator(mode="wrap")
    @classmethod
    def _sampling(cls, body: Any, handler: Any) -> Any:
        """The decoding parameters (`steer.serving.SamplingParams.from_body`), checked after the
        prompt and before the steering entries, as a client reads them."""
        from steer.serving import SamplingParams

        out = handler(body)
        out._params = SamplingParams.from_body({k: body[k] for k in SAMPLING if k in body})
        return out

    @property
    def params(self) -> Any:
        """The request's `steer.serving.SamplingParams`."""
        return self._params

    @property
    def include_usage(self) -> bool:
        opts = getattr(self, "stream_options", None) or {}
        return bool(opts.get("include_usage"))


def _context(info: ValidationInfo) -> ServeContext:
    ctx = (info.context or {}).get("serve")
    if not isinstance(ctx, ServeContext):
        raise HeadsteerValueError("a server request is checked against a ServeContext")
    return ctx


class ChatRequest(_OpenAIRequest):
    """`POST /v1/chat/completions`: `messages` (system / user / assistant / developer roles,
    string or text-part contents), at most `MAX_MESSAGES` of at most `MAX_PROMPT_CHARS` in all."""

    model: str | None = None
    messages: list[dict[str, str]] = None  # type: ignore[assignment]  # None: refused, named
    stream: bool = False
    steer: list[Any] = []
    emphasize: list[str] | None = None
    stream_options: dict[str, Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, v: object) -> list[dict[str, str]]:
        if not isinstance(v, list) or not v:
            raise HeadsteerValueError("messages must be a non-empty list of {role, content} objects")
        if len(v) > MAX_MESSAGES:
            raise HeadsteerValueError(f"messages has {len(v)} items, more than the limit of {MAX_MESSAGES}")
        out = []
        for i, m in enumerate(v):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
                raise HeadsteerValueError(f"messages[{i}] must be an object with a role and a content")
            if m["role"] not in ("system", "user", "assistant", "developer"):
                raise HeadsteerValueError(f"messages[{i}].role {short_repr(m['role'])} is not supported")
            role = "system" if m["role"] == "developer" else m["role"]
            out.append({"role": role, "content": _text_content(m["content"], i)})
        size = sum(len(m["content"]) for m in out)
        if size > MAX_PROMPT_CHARS:
            raise HeadsteerValueError(
                f"prompt has {size} characters, more than the limit of {MAX_PROMPT_CHARS}"
            )
        _encodable([m["content"] for m in out], chat=True)
        return out

    def serve_request(self) -> Any:
        from steer.serving import ServeRequest

        return ServeRequest(list(self.messages), True, list(self.steer), self.emphasize, self.params)


class CompletionRequest(_OpenAIRequest):
    """`POST /v1/completions`: one `prompt` string (or a list of one), at most `MAX_PROMPT_CHARS`."""

    model: str | None = None
    prompt: str = None  # type: ignore[assignment]  # None: refused, named
    stream: bool = False
    steer: list[Any] = []
    emphasize: list[str] | None = None
    stream_options: dict[str, Any] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: object) -> str:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
            v = v[0]
        if not isinstance(v, str):
            raise HeadsteerValueError("prompt must be a string (one prompt per request)")
        if len(v) > MAX_PROMPT_CHARS:
            raise HeadsteerValueError(
                f"prompt has {len(v)} characters, more than the limit of {MAX_PROMPT_CHARS}"
            )
        _encodable([v], chat=False)
        return v

    def serve_request(self) -> Any:
        from steer.serving import ServeRequest

        return ServeRequest(self.prompt, False, list(self.steer), self.emphasize, self.params)
