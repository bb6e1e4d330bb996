"""The requests of the QK analyses: QK attribution of one head (`QKRequest`) and composition scores
between heads (`CompositionRequest`), as checked values (see `heads.scorers.request_base`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from heads._util.validation import check_bool, check_int, check_seed, is_int, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.scorers.request_base import Geometry, Request, check_choice, check_head_pairs

__all__ = [
    "BY",
    "COMPOSITION_METHODS",
    "QK_FAMILIES",
    "CompositionRequest",
    "QKRequest",
    "check_qk_family",
    "MAX_SAMPLES",
    "parse_head",
    "parse_head_text",
    "qk_positions",
]

BY = ("component", "source_token")
"""`qk_attribution(by=)`: the upstream components, or also the source positions each head read."""

COMPOSITION_METHODS = ("weights", "data")
"""Composition scores from the weights (Elhage et al. 2021) or from the activations on prompts."""

QK_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "olmo2",
    "gpt2",
    "phi3",
    "gpt_oss",
)
"""`model_type`s whose QK decomposition is checked exact against an independent forward."""


MAX_SAMPLES = 100_000
"""The most random factor pairs the composition baseline averages (`n_samples`)."""

_HEAD_TEXT = re.compile(r"\s*(?:L([0-9]{1,6})\.H([0-9]{1,6})|([0-9]{1,6})\.([0-9]{1,6}))\s*", re.ASCII)
"""`"5.1"` or `"L5.H1"` (the form `HeadScores` prints): ASCII digits, at most 6 each."""


def parse_head_text(text: str) -> tuple[int, int]:
    """`(layer, head)` of `"5.1"` or `"L5.H1"` (not checked against a model).

    Raises:
        HeadsteerValueError: any other text (other digits, more than 6 of them, other separators).
    """
    m = _HEAD_TEXT.fullmatch(text)
    if m is None:
        raise HeadsteerValueError(
            f"head must look like 'L.H' (e.g. '5.1') or 'L5.H1', got {short_repr(text)}"
        )
    la, h = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
    return int(la), int(h)


def parse_head(head: object) -> tuple[int, int]:
    """`(layer, head)` from a pair or a `"L.H"` string (range checked against a model later).

    Raises:
        HeadsteerValueError: a malformed string, a negative index.
        HeadsteerTypeError: anything else.
    """
    if isinstance(head, str):
        return parse_head_text(head)
    if isinstance(head, (tuple, list)) and len(head) == 2 and all(is_int(x) for x in head):
        if min(int(x) for x in head) < 0:
            raise HeadsteerValueError(f"head must be (layer >= 0, head >= 0), got {short_repr(head)}")
        return int(head[0]), int(head[1])
    raise HeadsteerTypeError(f"head must be (layer, head) or 'L.H', got {short_repr(head)}")


def check_qk_family(geometry: Geometry) -> None:
    """Refuse a family the QK decomposition does not cover, from the config alone.

    Raises:
        HeadsteerValueError: multi-head latent attention (named), a vision-language wrapper, a
            `model_type` not in `QK_FAMILIES` (listed).
    """
    fam = geometry.family
    if fam is None:
        return
    name = short_repr(fam.model_type)
    if fam.latent:
        raise HeadsteerValueError(
            f"QK attribution does not support model_type {name}: multi-head latent attention decompresses "
            "keys from a shared low-rank latent with a shared rotary key, so there is no per-head key "
            "projection of the residual stream to decompose"
        )
    if fam.vlm is not None:
        raise HeadsteerValueError(
            f"QK attribution does not support vision-language model {short_repr(fam.vlm)} "
            "(text decoders only)"
        )
    if fam.model_type not in QK_FAMILIES:
        raise HeadsteerValueError(
            f"QK attribution does not support model_type {name}: its decomposition is checked exact on "
            f"{', '.join(QK_FAMILIES)} only"
        )


def qk_positions(name: str, value: object) -> tuple[int, ...]:
    """A position or a non-empty list of positions (ints, negative from a prompt's end) as a tuple;
    the check of `QKRequest.query` / `keys` and of `qk_attributions`' (not against a prompt)."""
    if is_int(value):
        return (int(value),)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise HeadsteerValueError(
            f"{name} must be a position or a non-empty list of positions, got {short_repr(value)}"
        )
    if not all(is_int(x) for x in value):
        raise HeadsteerValueError(f"{name} must be ints, got {short_repr(value)}")
    return tuple(int(x) for x in value)


@dataclass(frozen=True)
class QKRequest(Request):
    """QK attribution of one head's attention logits (`heads.qk_attribution`).

    Attributes:
        head: `(layer, head)` or `"L.H"` (stored as the pair). Required.
        query: query position(s) (negative from each prompt's end; default -1).
        keys: key position(s), each at or before every query (default None: every position up
            to the query).
        by: `"component"` (default) or `"source_token"`.
        chat: apply the chat template to text prompts (default False).

    Raises:
        HeadsteerValueError: a malformed head or position, an unknown `by`; `check_config`: the
            head out of range, a family the decomposition does not cover.
    """

    NAME = "qk_attribution"

    head: tuple[int, int] | str = ""
    query: int | Sequence[int] = -1
    keys: int | Sequence[int] | None = None
    by: str = "component"
    chat: bool = False

    def __post_init__(self) -> None:
        if self.head in (None, ""):
            raise HeadsteerValueError("head is required: (layer, head) or 'L.H'")
        object.__setattr__(self, "head", parse_head(self.head))
        object.__setattr__(self, "query", qk_positions("query", self.query))
        if self.keys is not None:
            object.__setattr__(self, "keys", qk_positions("keys", self.keys))
        check_choice("by", self.by, BY)
        check_bool("chat", self.chat)

    def check_geometry(self, geometry: Geometry) -> None:
        check_qk_family(geometry)
        la, h = cast("tuple[int, int]", self.head)
        geometry.check_head("head", la, h)
        for p in (*cast("tuple[int, ...]", self.query), *cast("tuple[int, ...]", self.keys or ())):
            geometry.check_position("query / keys", p)


@dataclass(frozen=True)
class CompositionRequest(Request):
    """Q-, K- and V-composition scores between every writer and reader head
    (`heads.composition_scores`, `method="weights"`; `heads.data_composition_scores`, `"data"`).

    Attributes:
        method: `"weights"` (default: from the weights) or `"data"` (from activations on prompts).
        readers: reader heads scored (`"weights"` only; default None: every head).
        subtract_baseline: subtract the random-matrix baseline (`"weights"`; default True).
        n_samples: random factor pairs of the baseline (`"weights"`; default 100; at most
            100000, `MAX_SAMPLES`).
        seed: the baseline's seed (default 0).
        chat: apply the chat template to text prompts (`"data"`; default False).

    Raises:
        HeadsteerValueError: a bad value, a `"weights"`-only option with `"data"`; `check_config`:
            readers out of range, a family the decomposition does not cover.
    """

    NAME = "composition_scores"

    method: str = "weights"
    readers: Sequence[tuple[int, int]] | None = None
    subtract_baseline: bool = True
    n_samples: int = 100
    seed: int = 0
    chat: bool = False

    def __post_init__(self) -> None:
        check_choice("method", self.method, COMPOSITION_METHODS)
        readers = check_head_pairs("readers", self.readers)
        if readers is not None and not readers:
            raise HeadsteerValueError("readers must be a non-empty list of (layer, head), got []")
        object.__setattr__(self, "readers", readers)
        check_bool("subtract_baseline", self.subtract_baseline)
        object.__setattr__(self, "n_samples", check_int("n_samples", self.n_samples, lo=1, hi=MAX_SAMPLES))
        object.__setattr__(self, "seed", check_seed("seed", self.seed))
        check_bool("chat", self.chat)
        if self.method == "data":
            changed = [
                n
                for n, v, d in (
                    ("readers", readers, None),
                    ("subtract_baseline", self.subtract_baseline, True),
                    ("n_samples", self.n_samples, 100),
                    ("seed", self.seed, 0),
                )
                if v != d
            ]
            if changed:
                raise HeadsteerValueError(
                    f"{changed[0]}= is only used by method='weights', not method='data'"
                )
        elif self.chat:
            raise HeadsteerValueError("chat= is only used by method='data' (prompts), not method='weights'")

    def check_geometry(self, geometry: Geometry) -> None:
        check_qk_family(geometry)
        for la, h in self.readers or ():
            geometry.check_head("readers", la, h)
