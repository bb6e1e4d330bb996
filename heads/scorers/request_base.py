"""`Request`: an analysis' parameters as one frozen, checked, JSON-able value.

Every analysis (activation patching, circuits, the detectors, Ships, ...) has a request class
beside it (`heads/scorers/<analysis>/request.py`): a frozen dataclass whose fields are the
analysis' parameters, checked in `__post_init__` (a bad value raises, naming the field and the
value), whose geometry is checked against a model's `transformers` config before any weight is
read (`check_config`), and which reads and writes JSON (`to_json` / `from_json`). The Python
functions (`patch(model, pairs, "head_out")`), the CLI, the explorer and the server all build the
same request, so a value is checked in one place; `heads.run(model, request, inputs)` runs one.

    req = PatchRequest(kind="head_out", layers=[0, 1])
    req.check_config(AutoConfig.from_pretrained(folder))   # layers in range, the family has the kind
    text = req.to_json()   # '{"request": "patch", "version": 1, "kind": "head_out", ...}'
    PatchRequest.from_json(text) == req

A request holds *what* to compute; *how* (rows per forward, progress, shards) is a
`heads.engine.options.SweepOptions` passed beside it.
"""

from __future__ import annotations

import contextvars
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from heads._util.validation import check_int, is_int, parse_json, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.storage import _no_duplicate_keys

if TYPE_CHECKING:  # pragma: no cover
    from heads.model.families import Family

__all__ = [
    "Geometry",
    "Request",
    "check_choice",
    "check_head_pairs",
    "check_layers",
    "check_positions",
    "request_class",
    "request_classes",
]

R = TypeVar("R", bound="Request")

_REGISTRY: dict[str, type[Request]] = {}


# ------------------------------------------------------------------------------ geometry
@dataclass(frozen=True)
class Geometry:
    """What a request's geometry is checked against: a model's size and family.

    Attributes:
        n_layers: the text model's decoder layers.
        n_heads: its query heads per layer.
        n_kv_heads: its KV heads per layer.
        model_type: the config's `model_type` (a vision-language model's own).
        family: the `heads.model.families.Family` entry (None only for a `HeadModel` without one).
        max_positions: the longest sequence the position embeddings allow, None if unbounded.
        residual_multiplier: the factor each sub-layer output is scaled by before it joins the
            residual stream (Granite / HyperCLOVA X `residual_multiplier`, MiniCPM3
            `scale_depth / sqrt(n_layers)`); None where it is 1.
        d_vocab: the vocabulary size (None when the config does not say).
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    model_type: str | None = None
    family: Family | None = field(default=None, repr=False, compare=False)
    max_positions: int | None = None
    residual_multiplier: float | None = None
    d_vocab: int | None = None

    @classmethod
    def of(cls, source: object) -> Geometry:
        """The geometry of a `transformers` config (a `PretrainedConfig`, or a `config.json`
        mapping), of a loaded `HeadModel`, or a `Geometry` itself.

        Raises:
            HeadsteerValueError: a family headsteer refuses (`heads.model.families.family_of`
                names the missing feature), or a config without layer / head counts.
            HeadsteerTypeError: anything else.
        """
        from heads.model.families import family_of

        if isinstance(source, Geometry):
            return source
        if hasattr(source, "n_kv_heads") and hasattr(source, "family") and hasattr(source, "n_layers"):
            m: Any = source  # a HeadModel: its sizes were read from the weights
            config = getattr(getattr(m, "model", None), "config", None)
            return cls(
                int(m.n_layers),
                int(m.n_heads),
                int(m.n_kv_heads),
                m.family.vlm or m.family.model_type,
                m.family,
                m.max_positions,
                _residual_multiplier(getattr(config, "text_config", None) or config),
                int(m.d_vocab),
            )
        config = _as_config(source)
        family = family_of(config)
        text = getattr(config, "text_config", None) or config
        try:
            n_layers = int(text.num_hidden_layers)
            n_heads = int(text.num_attention_heads)
        except (AttributeError, TypeError, ValueError):
            raise HeadsteerValueError(
                f"config of model_type {short_repr(getattr(config, 'model_type', None))} has no "
                "num_hidden_layers / num_attention_heads"
            ) from None
        kv = getattr(text, "num_key_value_heads", None)
        if not is_int(kv) or kv < 1:
            kv = 1 if getattr(text, "multi_query", False) else n_heads
        limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        return cls(
            n_layers,
            n_heads,
            int(kv),
            getattr(config, "model_type", None),
            family,
            int(limit) if limit else None,
            _residual_multiplier(text),
            int(text.vocab_size) if is_int(getattr(text, "vocab_size", None)) else None,
        )

    # ---------------------------------------------------------------- checks
    def check_layer(self, name: str, layer: int) -> None:
        """Refuse a layer outside `0..n_layers-1`, naming `name` and the model's range."""
        if not 0 <= layer < self.n_layers:
            raise HeadsteerValueError(
                f"{name}: unknown layer {short_repr(layer)}: this model has {self.n_layers} "
                f"(layers 0..{self.n_layers - 1})"
            )

    def check_head(self, name: str, layer: int, head: int, *, kv: bool = False) -> None:
        """Refuse a (layer, head) outside the model (`kv`: a KV head, `0..n_kv_heads-1`)."""
        self.check_layer(name, layer)
        n, what = (self.n_kv_heads, "KV head") if kv else (self.n_heads, "head")
        if not 0 <= head < n:
            raise HeadsteerValueError(
                f"{name}: unknown {what} {short_repr(head)} in layer {layer}: this model has {n} "
                f"({what}s 0..{n - 1})"
            )

    def check_position(self, name: str, position: int) -> None:
        """Refuse a position the model cannot reach (`|position| >= max_positions`)."""
        limit = self.max_positions
        if limit is not None and not -limit <= position < limit:
            raise HeadsteerValueError(
                f"{name}: position {short_repr(position)} is beyond the model's {limit} positions"
            )


def _residual_multiplier(config: object) -> float | None:
    """The factor a family scales each sub-layer's output by before the residual stream
    (`residual_multiplier`, or MiniCPM3's `scale_depth / sqrt(num_hidden_layers)`); None for 1."""
    value = getattr(config, "residual_multiplier", None)
    depth = getattr(config, "scale_depth", None)
    if depth is not None:
        value = float(depth) / float(getattr(config, "num_hidden_layers", 1)) ** 0.5
    return None if value in (None, 1, 1.0) else float(value)


def _as_config(source: object) -> Any:
    """A `PretrainedConfig` from a config or a `config.json` mapping."""
    if isinstance(source, Mapping):
        from transformers import AutoConfig

        kind = source.get("model_type")
        if not isinstance(kind, str):
            raise HeadsteerValueError(f"a config mapping needs a 'model_type' string, got {short_repr(kind)}")
        rest = {k: v for k, v in source.items() if k != "model_type"}
        try:
            return AutoConfig.for_model(kind, **rest)
        except (ValueError, KeyError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise HeadsteerValueError(f"cannot read a {short_repr(kind)} config: {first}") from None
    if hasattr(source, "model_type") and hasattr(source, "to_dict"):
        return source
    raise HeadsteerTypeError(
        f"check_config takes a transformers config, a config.json mapping or a HeadModel, got "
        f"{type(source).__name__}"
    )


# ------------------------------------------------------------------------------ field checks
def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """`value` if it is one of `choices`, else a `HeadsteerValueError` naming `name` and them."""
    if not isinstance(value, str) or value not in choices:
        raise HeadsteerValueError(f"{name} must be one of {', '.join(choices)}, got {short_repr(value)}")
    return value


def check_layers(name: str, value: object) -> tuple[int, ...] | None:
    """None, or a non-empty list of layer indices >= 0 as a sorted tuple without repeats."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, range)) or not len(value):
        raise HeadsteerValueError(
            f"{name} must be a non-empty list of layer indices, got {short_repr(value)}"
        )
    return tuple(sorted({check_int(name, x, lo=0, what="layer indices >= 0") for x in value}))


def check_positions(
    name: str, value: object, *, names: Sequence[str] = (), allow_names: bool = False
) -> tuple[int | str, ...] | str | None:
    """None, one of `names` (a whole-prompt keyword such as `"image"`), or a non-empty list of
    positions (ints, negative counting from the end; with `allow_names` also position names such
    as `"END"`), as a tuple in the given order, repeats dropped."""
    if value is None:
        return None
    if isinstance(value, str) and value in names:
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, range)) or not len(value):
        want = f"{' or '.join(map(repr, names))} or " if names else ""
        raise HeadsteerValueError(
            f"{name} must be {want}a non-empty list of positions, got {short_repr(value)}"
        )
    out: list[int | str] = []
    for p in value:
        if allow_names and isinstance(p, str) and p:
            item: int | str = p
        elif is_int(p):
            item = int(p)
        else:
            what = "ints or position names" if allow_names else "ints"
            raise HeadsteerTypeError(f"{name} must be {what}, got {short_repr(p)}")
        if item not in out:
            out.append(item)
    return tuple(out)


_FROM_JSON: contextvars.ContextVar[bool] = contextvars.ContextVar("headsteer_from_json", default=False)
"""True while `Request.from_json` builds a request: a head selection may not be a file path."""


def check_head_pairs(name: str, value: object) -> tuple[tuple[int, int], ...] | None:
    """None, or a head selection (`{"layer": [heads]}`, `(layer, head)` pairs, a `HeadSet`, a
    JSON file of the mapping shape) as sorted `(layer, head)` pairs. A list of layers (every head
    of each) needs the model: expand it first (`HeadSet.parse(spec, n_layers, n_heads)`)."""
    if value is None:
        return None
    from heads.results.scores import HeadSet

    if isinstance(value, (str, os.PathLike)) and _FROM_JSON.get():
        raise HeadsteerValueError(
            f"{name}: a request from JSON cannot name a head file ({short_repr(str(value))}, a path on "
            'the machine that runs it): give the heads as {"layer": [heads]} or [[layer, head], ...]'
        )

    if isinstance(value, (list, tuple)) and not value:
        return ()  # no head: the analysis says what that means
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and value:
        if all(is_int(x) for x in value):
            raise HeadsteerValueError(
                f"{name}: a list of layers {short_repr(value)} needs the model's head count; pass "
                "(layer, head) pairs or a {layer: [heads]} mapping"
            )
    try:
        sel = HeadSet.parse(value)  # type: ignore[arg-type]
    except (HeadsteerValueError, HeadsteerTypeError) as exc:
        raise type(exc)(f"{name}: {exc}") from None
    except FileNotFoundError as exc:  # a Python caller's head file: a bad value, named
        raise HeadsteerValueError(f"{name}: {exc}") from None
    return tuple(sel.heads)


def expand_layers(spec: object, n_layers: int, n_heads: int) -> object:
    """A head selection given as a list of layers (every head of each) or `"L.H"` texts, as
    `(layer, head)` pairs of a model with `n_layers` x `n_heads` heads (what a function of the
    functional API does before it builds its request, which holds heads only); any other form is
    returned as given, for the request to check.

    Raises:
        HeadsteerValueError / HeadsteerTypeError: a layer or head out of range or malformed
            (`HeadSet.parse`).
    """
    if (
        isinstance(spec, Sequence)
        and not isinstance(spec, (str, bytes))
        and len(spec)
        and all(not isinstance(x, (list, tuple)) for x in spec)
    ):
        from heads.results.scores import HeadSet

        return list(HeadSet.parse(spec, n_layers, n_heads).heads)
    return spec


def _jsonable(where: str, value: object) -> Any:
    """`value` as plain JSON data (tuples become lists), or an error naming `where`."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if is_int(value):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise HeadsteerValueError(f"{where}={short_repr(value)} cannot be written as JSON (not finite)")
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise HeadsteerValueError(f"{where} has a key {short_repr(k)} JSON cannot hold")
            out[str(k)] = _jsonable(f"{where}[{k!r}]", v)
        return out
    if isinstance(value, (list, tuple, range)):
        return [_jsonable(f"{where}[{i}]", v) for i, v in enumerate(value)]
    raise HeadsteerValueError(
        f"{where}={short_repr(value)} cannot be written as JSON: give it by name (a string) to save "
        "or send the request"
    )


# ------------------------------------------------------------------------------ the base
@dataclass(frozen=True)
class Request:
    """Base of every analysis request (see the module docstring).

    A subclass is a `@dataclass(frozen=True)` with `NAME` (the analysis' function name, the
    `"request"` field of its JSON), `VERSION` (raised when a field changes meaning), its fields
    with defaults where the function has them, `__post_init__` checking each value (normalised
    with `object.__setattr__`), and `check_geometry(geometry)` for what needs the model.
    """

    NAME: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("NAME")
        if name:
            old = _REGISTRY.get(name)
            if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
                raise TypeError(f"two request classes named {name!r}: {old.__qualname__}, {cls.__qualname__}")
            _REGISTRY[name] = cls

    # ---------------------------------------------------------------- geometry
    def check_geometry(self, geometry: Geometry) -> None:
        """Refuse what the model cannot run: layers / heads / positions out of range, a site or
        feature the family does not have. Overridden by each request (default: nothing to check)."""

    def check_config(self, config: object) -> None:
        """Check the request against a model before any weight is loaded.

        Args:
            config: a `transformers` `PretrainedConfig` (`AutoConfig.from_pretrained(folder)`),
                a `config.json` mapping, or a loaded `HeadModel`.

        Raises:
            HeadsteerValueError: a refused family, or what `check_geometry` refuses (a layer,
                head or position out of range; an analysis the family does not support), named.
        """
        self.check_geometry(Geometry.of(config))

    def check_model(self, name_or_path: str | os.PathLike | None = None) -> None:
        """`check_config` on the config of a model `load_model` would load, before its weights.

        Args:
            name_or_path: as `heads.load_model`: a model folder, a hub id or a packaged model's
                name (None: the embedded model). Only `config.json` is read.

        Raises:
            HeadsteerValueError / FileNotFoundError: a missing folder or a config `load_model`
                refuses; what `check_config` refuses.
        """
        from transformers import AutoConfig

        from heads.model.loading import _resolve, check_config

        where, _ = _resolve(name_or_path)
        check_config(where)
        self.check_config(AutoConfig.from_pretrained(where, trust_remote_code=False))

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """`{"request": NAME, "version": VERSION, <field>: <value>, ...}` as plain JSON data.

        Raises:
            HeadsteerValueError: a field holding a Python object JSON cannot hold (a metric
                given as a function, a non-finite number), named.
        """
        out: dict[str, Any] = {"request": self.NAME, "version": self.VERSION}
        for f in fields(self):
            out[f.name] = _jsonable(f"{self.NAME} request field {f.name}", getattr(self, f.name))
        return out

    def to_json(self) -> str:
        """`to_dict()` as JSON text (one line)."""
        return json.dumps(self.to_dict(), allow_nan=False)

    @classmethod
    def from_json(cls: type[R], data: str | bytes | Mapping[str, Any]) -> R:
        """The request written by `to_json` / `to_dict` (text or the parsed mapping).

        On `Request` itself the `"request"` field picks the class; on a subclass it must name
        that class. `"version"` may be left out (the current one).

        Raises:
            HeadsteerValueError: not JSON (a plain word such as `"dla"`: the request names
                accepted), not an object, an unknown or wrong `"request"` name,
                another version (an int: `1.0` is refused), a key given twice (named), an unknown
                field (named, with the known ones), a head selection given as a string (a file
                path: a request from JSON opens no file), or a bad value
                (the request's own checks, naming the field).
        """
        if isinstance(data, (str, bytes)):
            _refuse_bare_name(data)
            data = parse_json(data, "the request", object_pairs_hook=_no_duplicate_keys)
        if not isinstance(data, Mapping):
            raise HeadsteerValueError(f"a request must be a JSON object, got {short_repr(data)}")
        name = data.get("request", cls.NAME or None)
        target = _REGISTRY.get(name) if isinstance(name, str) else None
        if target is None:
            raise HeadsteerValueError(
                f"unknown request {short_repr(name)}; known: {', '.join(sorted(_REGISTRY))}"
            )
        if cls.NAME and target is not cls:
            raise HeadsteerValueError(f"expected a {cls.NAME!r} request, got {short_repr(name)}")
        version = data.get("version", target.VERSION)
        if not is_int(version) or version != target.VERSION:  # 1.0 and True are not versions
            raise HeadsteerValueError(
                f"{target.NAME} request version {short_repr(version)}: this headsteer reads version "
                f"{target.VERSION}"
            )
        known = [f.name for f in fields(target)]
        values = {k: v for k, v in data.items() if k not in ("request", "version")}
        unknown = [k for k in values if k not in known]
        if unknown:
            raise HeadsteerValueError(
                f"unknown key {short_repr(unknown[0])} in a {target.NAME} request; known: {', '.join(known)}"
            )
        token = _FROM_JSON.set(True)  # no head file is opened for a request from JSON
        try:
            return target(**values)  # type: ignore[return-value]
        finally:
            _FROM_JSON.reset(token)

    def replace(self: R, **changes: Any) -> R:
        """A copy with `changes` applied (checked again)."""
        from dataclasses import replace

        return replace(self, **changes)


def _refuse_bare_name(data: str | bytes) -> None:
    """Refuse a plain word such as `"dla"` (not JSON) with the request names accepted, rather
    than a JSON syntax error."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    word = text.strip()
    if not word or not (word[0].isalpha() or word[0] == "_") or word in ("true", "false", "null"):
        return
    # the request's name or its class's short name ("dla" for DLARequest)
    short = {c.__name__.removesuffix("Request").lower(): c for c in _REGISTRY.values()}
    known = _REGISTRY.get(word) or short.get(word.lower()) or short["dla"]
    raise HeadsteerValueError(
        f"unknown request {short_repr(word)}; pass a request object such as heads.{known.__name__}() "
        f'or JSON with one of: {", ".join(sorted(_REGISTRY))} (e.g. \'{{"request": "{known.NAME}"}}\')'
    )


def request_class(name: str) -> type[Request]:
    """The request class whose `NAME` is `name` (`"patch"`, `"find_circuit"`, ...).

    Raises:
        HeadsteerValueError: no such request (the message lists the known ones).
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise HeadsteerValueError(
            f"unknown request {short_repr(name)}; known: {', '.join(sorted(_REGISTRY))}"
        )
    return cls


def request_classes() -> dict[str, type[Request]]:
    """Every request class defined so far, by `NAME` (`heads` imports all of them)."""
    return dict(sorted(_REGISTRY.items()))
