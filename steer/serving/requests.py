"""A served request: its steering entries (`parse_steer`), its decoding fields
(`SamplingParams.from_body`), the request (`ServeRequest`), its prepared form (`Prepared`) and
its answer (`Completion`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from heads._util.validation import is_int, is_number, short_repr
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, Prompt
from steer.ablate import Ablate
from steer.act.method import Act
from steer.adaptvis import AdaptVis, ScalingVis
from steer.caa import Caa
from steer.instaboost import InstaBoost
from steer.noop import refusing_noop
from steer.pasta.method import Pasta
from steer.pattern_injection import PatternInjection
from steer.spotlight import Spotlight
from steer.steered_model import Intervention
from steer.visual_modulation import VisualModulation

if TYPE_CHECKING:
    pass

__all__ = [
    "AUTO_SPAN_TOP_K",
    "MAX_SEED",
    "MAX_STEER",
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "MAX_TOKENS_DEFAULT",
    "Completion",
    "Prepared",
    "SamplingParams",
    "ServeRequest",
    "parse_steer",
]


MAX_TOKENS_DEFAULT = 128
"""`max_tokens` when a request gives none."""
MAX_STOP = 4
"""Most stop strings per request (as the OpenAI API)."""
MAX_STOP_CHARS = 256
"""Longest stop string."""
MAX_STEER = 16
"""Most interventions in one request's `"steer"` list."""
MAX_SEED = 2**63 - 1
"""Largest `seed` (a torch generator seed is a signed 64-bit integer)."""
AUTO_SPAN_TOP_K = 20
"""Heads chosen by `"heads": "auto"` on a model without a shipped profile (span heuristic)."""

_METHODS = {
    "pasta": ("heads", "alpha", "scale_position"),
    "spotlight": ("tau", "layers"),
    "instaboost": ("multiplier", "region", "layers"),
    "act": ("heads", "beta"),
    "ablate": ("heads", "mode", "eps"),
    "adaptvis": ("weight1", "weight2", "threshold", "layers"),
    "scalingvis": ("weight", "layers"),
    "caa": ("vector", "coefficient"),
    "pattern_injection": ("heads", "pattern", "weight", "mode"),
    "modulation": ("gamma", "local_ratio", "regions", "layers"),
    "carve": ("general", "keep"),
}
MAX_SERVED_TEMPLATE = 512
"""Largest T of a `[T, T]` pattern template given in a request (a JSON list of T lists)."""


def _heads_spec(value: object, method: str) -> Any:
    """A head spec from JSON: "auto", a `{"layer": [heads]}` dict or a list of [layer, head] pairs.

    File paths are refused: a client must not name files on the server.
    """
    if value == "auto":
        return "auto"
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items()}
    if isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        return [tuple(p) for p in value]
    raise HeadsteerValueError(
        f'steer {method}: heads must be "auto", a {{"layer": [heads]}} object or a list of '
        f"[layer, head] pairs, got {short_repr(value)}"
    )


def _number(value: object, name: str) -> float:
    if not is_number(value) or not math.isfinite(float(value)):
        raise HeadsteerValueError(f"{name} must be a finite number, got {short_repr(value)}")
    return float(value)


def parse_steer(spec: object, caa_vectors: Mapping[str, Caa] | None = None) -> list[Intervention]:
    """Interventions from a request's `"steer"` field.

    Args:
        spec: None, or a list of objects `{"method": M, ...}` with M one of
            * `"pasta"`: `heads` ("auto" = the shipped profile of the embedded model, else the
              top-20 heads by attention on the span), `alpha` (default 0.01),
              `scale_position` (default "exclude");
            * `"spotlight"`: `tau` (default 0.1), `layers` (default all);
            * `"instaboost"`: `multiplier` (default 5), `region` "span" | "prefix" (default
              "span"), `layers` (default all);
            * `"act"`: `heads` ("auto" = the shipped ACT profile; default: layers 2..L-2),
              `beta` (default 0.4);
            * `"ablate"`: `heads` (required), `mode` "ua" | "sc" (default "ua"), `eps` (default 0);
            * `"adaptvis"`: `weight1` (default 0.5), `weight2` (default 1.5), `threshold`
              (default 0.4), `layers` (default all): AdaptVis on the emphasized passage (the
              server is text-only, so the text variant);
            * `"scalingvis"`: `weight` (default 0.8), `layers` (default all);
            * `"caa"`: `vector` (the name of a vector the server loaded, `caa_vectors`; may be
              left out when it loaded exactly one), `coefficient` (default 1). A request can
              only name vectors: it never gives a file or the numbers;
            * `"pattern_injection"`: `heads` (required: a `{"layer": [heads]}` object or
              [layer, head] pairs), `pattern` (a name, default "previous-token", or a `[T, T]`
              list of lists of non-negative numbers, T <= 512), `weight` (default 1), `mode`
              "mix" | "mask" (default "mix");
            * `"modulation"`: head-specific visual modulation on the emphasized passage (the text
              variant): `gamma` (default 1), `local_ratio` (default 0.1), `regions` (default 2),
              `layers` (default the deeper half);
            * `"carve"`: refused with a one-line reason: CARVE refines the request's image, and
              this server takes text only.
        caa_vectors: the server's named CAA vectors (`steer.caa.load_caa_vectors`; default none).

    Returns:
        the interventions in order; `"heads": "auto"` stays the string "auto" until
        `BatchGenerator.prepare` resolves it against the model.

    Raises:
        ValueError: not a list, an unknown method or field, a bad value (one line, naming it);
            a value that makes the entry a no-op or silently do something else (PASTA alpha 1 or
            above 1, no heads, ACT beta 1, ...): the `NoOpWarning` text the CLI and the Python
            API print before running (`steer.noop.refusing_noop`).
    """
    if spec is None:
        return []
    if not isinstance(spec, list):
        raise HeadsteerValueError(
            f"steer must be a list of {{'method': ...}} objects, got {short_repr(spec)}"
        )
    if len(spec) > MAX_STEER:
        raise HeadsteerValueError(f"steer has {len(spec)} items, more than the limit of {MAX_STEER}")
    out: list[Intervention] = []
    for i, item in enumerate(spec):
        if not isinstance(item, Mapping) or "method" not in item:
            raise HeadsteerValueError(f"steer[{i}] must be an object with a 'method', got {short_repr(item)}")
        method = item["method"]
        if not isinstance(method, str) or method not in _METHODS:
            raise HeadsteerValueError(
                f"steer[{i}].method: unknown method {short_repr(method)}, use one of {sorted(_METHODS)}"
            )
        extra = set(item) - {"method", *_METHODS[method]}
        if extra:
            names = sorted(short_repr(x) for x in extra)
            raise HeadsteerValueError(f"steer[{i}] ({method}): unknown field(s) {names}")
        try:
            with refusing_noop():  # a steering request that changes nothing is a bad request
                out.append(_intervention(method, item, caa_vectors or {}))
        except (TypeError, ValueError) as exc:
            raise HeadsteerValueError(f"steer[{i}] ({method}): {exc}") from None
    return out


def _layers_field(item: Mapping) -> dict:
    if item.get("layers") is None:
        return {}
    if not isinstance(item["layers"], list):
        raise HeadsteerValueError(f"layers must be a list of layer indices, got {short_repr(item['layers'])}")
    return {"layers": tuple(item["layers"])}


def _caa(item: Mapping, vectors: Mapping[str, Caa]) -> Caa:
    if not vectors:
        raise HeadsteerValueError("this server has no CAA vectors (start it with --caa-vector FILE)")
    name = item.get("vector")
    if name is None:
        if len(vectors) != 1:
            raise HeadsteerValueError(f"vector is required: this server has {sorted(vectors)}")
        name = next(iter(vectors))
    if not isinstance(name, str) or name not in vectors:
        raise HeadsteerValueError(f"unknown vector {short_repr(name)}: this server has {sorted(vectors)}")
    base = vectors[name]
    c = _number(item["coefficient"], "coefficient") if "coefficient" in item else 1.0
    return Caa(base.vector, base.layer, c, base.from_position)


def _pattern_injection(item: Mapping) -> PatternInjection:
    if "heads" not in item:
        raise HeadsteerValueError("pattern_injection needs heads")
    kw: dict = {"heads": _heads_spec(item["heads"], "pattern_injection")}
    if kw["heads"] == "auto":
        raise HeadsteerValueError('pattern_injection has no "auto" heads: name them')
    pattern = item.get("pattern", "previous-token")
    if isinstance(pattern, list):
        rows = len(pattern)
        if not 1 <= rows <= MAX_SERVED_TEMPLATE or not all(
            isinstance(r, list) and len(r) == rows and all(is_number(x) for x in r) for r in pattern
        ):
            raise HeadsteerValueError(
                f"pattern must be a name or a [T, T] list of lists of numbers with T <= {MAX_SERVED_TEMPLATE}"
            )
        pattern = torch.tensor(pattern, dtype=torch.float32)
    kw["pattern"] = pattern
    if "weight" in item:
        kw["weight"] = _number(item["weight"], "weight")
    if "mode" in item:
        kw["mode"] = item["mode"]
    return PatternInjection(**kw)


def _intervention(method: str, item: Mapping, caa_vectors: Mapping[str, Caa]) -> Intervention:
    """One intervention from a checked `"steer"` item (see `parse_steer`)."""
    if method in ("adaptvis", "scalingvis"):
        kw: dict = {"target": "text", **_layers_field(item)}
        for name in _METHODS[method]:
            if name != "layers" and name in item:
                kw[name] = _number(item[name], name)
        return AdaptVis(**kw) if method == "adaptvis" else ScalingVis(**kw)
    if method == "caa":
        return _caa(item, caa_vectors)
    if method == "carve":
        raise HeadsteerValueError(
            "CARVE refines the prompt's image and this server takes text only: use `headsteer vision "
            "generate --steer carve --image ...` or SteeredModel.generate(..., images=...)"
        )
    if method == "modulation":
        kw = {"target": "text", **_layers_field(item)}
        for name in ("gamma", "local_ratio"):
            if name in item:
                kw[name] = _number(item[name], name)
        if "regions" in item:
            kw["regions"] = item["regions"]
        return VisualModulation(**kw)
    if method == "pattern_injection":
        return _pattern_injection(item)
    if method == "pasta":
        kw = {"heads": _heads_spec(item.get("heads", "auto"), method)}
        if "alpha" in item:
            kw["alpha"] = _number(item["alpha"], "alpha")
        if "scale_position" in item:
            kw["scale_position"] = item["scale_position"]
        return Pasta(**kw)
    if method == "spotlight":
        kw = {}
        if "tau" in item:
            kw["tau"] = _number(item["tau"], "tau")
        if item.get("layers") is not None:
            kw["layers"] = tuple(item["layers"]) if isinstance(item["layers"], list) else item["layers"]
        return Spotlight(**kw)
    if method == "instaboost":
        kw = _layers_field(item)
        if "multiplier" in item:
            kw["multiplier"] = _number(item["multiplier"], "multiplier")
        if "region" in item:
            kw["region"] = item["region"]
        return InstaBoost(**kw)
    if method == "act":
        kw = {}
        if item.get("heads") is not None:
            kw["heads"] = _heads_spec(item["heads"], method)
        if "beta" in item:
            kw["beta"] = _number(item["beta"], "beta")
        return Act(**kw)
    if "heads" not in item:  # ablate
        raise HeadsteerValueError("ablate needs heads")
    kw = {"heads": _heads_spec(item["heads"], method)}
    if kw["heads"] == "auto":
        raise HeadsteerValueError('ablate has no "auto" heads: name them')
    if "mode" in item:
        kw["method"] = item["mode"]
    if "eps" in item:
        kw["eps"] = _number(item["eps"], "eps")
    return Ablate(**kw)


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters of one request (OpenAI semantics).

    Attributes:
        max_tokens: most tokens to generate, >= 1 (default 128).
        temperature: 0 = greedy; else logits / temperature (default 1.0, as OpenAI), in [0, 2].
        top_p: nucleus sampling mass in (0, 1] (default 1).
        seed: seed of the request's own `torch.Generator` (default: a random one).
        stop: up to 4 non-empty strings; the text is cut before the first one found.
    """

    max_tokens: int = MAX_TOKENS_DEFAULT
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        m = self.max_tokens
        if not is_int(m) or m < 1:
            raise HeadsteerValueError(f"max_tokens must be a positive integer, got {short_repr(m)}")
        t = _number(self.temperature, "temperature")
        if not 0 <= t <= 2:
            raise HeadsteerValueError(f"temperature must be in [0, 2], got {short_repr(t)}")
        p = _number(self.top_p, "top_p")
        if not 0 < p <= 1:
            raise HeadsteerValueError(f"top_p must be in (0, 1], got {short_repr(p)}")
        s = self.seed
        if s is not None and (not is_int(s) or not 0 <= s <= MAX_SEED):
            raise HeadsteerValueError(f"seed must be an integer in [0, 2**63 - 1], got {short_repr(s)}")
        if len(self.stop) > MAX_STOP or any(
            not isinstance(x, str) or not x or len(x) > MAX_STOP_CHARS for x in self.stop
        ):
            raise HeadsteerValueError(
                f"stop must be up to {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} "
                f"characters, got {short_repr(list(self.stop))}"
            )

    @classmethod
    def from_body(cls, body: Mapping, max_tokens_key: str = "max_tokens") -> SamplingParams:
        """Read `max_tokens` (or `max_completion_tokens`), `temperature`, `top_p`, `seed`, `stop`.

        Raises:
            ValueError: a bad value (named), or `n` other than 1.
        """
        if body.get("n", 1) != 1:
            raise HeadsteerValueError(f"n must be 1, got {short_repr(body.get('n'))}")
        stop = body.get("stop")
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list):
            if len(stop) > MAX_STOP:
                raise HeadsteerValueError(f"stop has {len(stop)} strings, more than the limit of {MAX_STOP}")
            stop = tuple(stop)
        else:
            raise HeadsteerValueError(f"stop must be a string or a list of strings, got {short_repr(stop)}")
        mt = body.get(max_tokens_key)
        if mt is None:
            mt = body.get("max_completion_tokens")
        return cls(
            max_tokens=MAX_TOKENS_DEFAULT if mt is None else mt,
            temperature=1.0 if body.get("temperature") is None else body["temperature"],
            top_p=1.0 if body.get("top_p") is None else body["top_p"],
            seed=body.get("seed"),
            stop=stop,
        )


@dataclass
class ServeRequest:
    """One generation request.

    Attributes:
        prompt: a string (`chat=False`: used as is) or a chat message list (`chat=True`).
        chat: apply the model's chat template.
        steer: interventions (from `parse_steer`).
        emphasize: substrings to emphasize besides `**markup**`.
        params: decoding parameters.
    """

    prompt: Prompt
    chat: bool
    steer: list = field(default_factory=list)
    emphasize: list[str] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    """The answer to one request.

    Attributes:
        text: generated text (special tokens dropped, cut before a stop string).
        token_ids: generated token ids (including a final EOS, if any).
        finish_reason: "stop" (EOS or a stop string) or "length" (max_tokens).
        prompt_tokens: tokens in the rendered prompt.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Prepared:
    """A validated request, ready to join a batch (from `BatchGenerator.prepare`).

    Attributes:
        request: the request.
        enc: its prompt encoded alone, `[1, P]`.
        steer: its interventions with `"auto"` heads resolved.
        seed: the seed drawn for a request without one (so a rerun draws the same tokens).
    """

    request: ServeRequest
    enc: EncodedPrompts
    steer: list
    seed: int | None = None
