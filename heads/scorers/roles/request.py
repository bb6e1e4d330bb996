"""The requests of the head-role analyses: the detectors (`DetectRolesRequest`), Attention Lens
training (`LensTrainRequest`) and the head atlas (`AtlasRequest`), as checked values (see
`heads.scorers.request_base`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from heads._util.validation import check_bool, check_int, check_number, check_seed, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.atlas import ROLE_THRESHOLDS
from heads.results.stability import check_stability
from heads.scorers.request_base import Geometry, Request, check_choice, check_head_pairs

__all__ = [
    "FORMS",
    "MAX_EPOCHS",
    "MAX_FULL_HEADS",
    "MAX_LR",
    "ROLE_THRESHOLDS",
    "AtlasRequest",
    "DetectRolesRequest",
    "LensTrainRequest",
    "check_thresholds",
]

FORMS = ("tuned", "full")
"""Attention Lens forms: a d_model x d_model map into the unembedding (`"tuned"`), or a full
d_model x |V| matrix per head (`"full"`, the paper's)."""

MAX_FULL_HEADS = 8
"""The most heads of a `"full"` lens (each is d_model x |V| parameters)."""

MAX_LR = 1.0
"""The largest lens learning rate accepted."""

MAX_EPOCHS = 100_000
"""The most lens training epochs accepted."""


_RESERVED = ("layer", "head", "kv_head", "role", "best_relation", "none", "nan")


def check_thresholds(thresholds: object) -> dict[str, float]:
    """`{role: float}`: each role a non-empty string that is no reserved column, each threshold a
    finite number > 0 (the roles' columns are checked against the scores when the atlas runs).

    Raises:
        HeadsteerTypeError: not a mapping.
        HeadsteerValueError: a bad role name or threshold, named.
    """
    if not isinstance(thresholds, Mapping):
        raise HeadsteerTypeError(
            f"thresholds must be a {{role: threshold}} mapping, got {short_repr(thresholds)}"
        )
    out = {}
    for k, v in thresholds.items():
        if not isinstance(k, str) or not k or k in _RESERVED:
            raise HeadsteerValueError(f"role {short_repr(k)} in thresholds is not a role name")
        out[k] = check_number(f"threshold of {k!r}", v, lo=0.0, lo_open=True)
    return out


@dataclass(frozen=True)
class DetectRolesRequest(Request):
    """Every head-role detector (`heads.detect_roles`).

    Attributes:
        apply_first_mlp: the OV-circuit detectors (copying, successor) read token embeddings
            through the first MLP, as the papers do (default True).
        seed: seeds the random token sequences (default 0).
        retrieval: also run the needle retrieval detector (default True).
        successor: also run the successor detector (default True; needs a tokenizer).
        stability: bootstrap resamples of the detector sequences (0: none).

    Raises:
        HeadsteerTypeError: a flag that is not a bool.
        HeadsteerValueError: a bad seed or stability.
    """

    NAME = "detect_roles"

    apply_first_mlp: bool = True
    seed: int = 0
    retrieval: bool = True
    successor: bool = True
    stability: int = 0

    def __post_init__(self) -> None:
        for name in ("apply_first_mlp", "retrieval", "successor"):
            check_bool(name, getattr(self, name))
        object.__setattr__(self, "seed", check_seed("seed", self.seed))
        object.__setattr__(self, "stability", check_stability(self.stability))


@dataclass(frozen=True)
class LensTrainRequest(Request):
    """Training an Attention Lens on texts (`heads.train_lens`).

    Attributes:
        heads: the heads to train a lens for (`(layer, head)` pairs or `{layer: [heads]}`; default
            None: every head).
        form: `"tuned"` (default) or `"full"` (at most `MAX_FULL_HEADS` heads).
        epochs: passes over the training positions (default 10; 1..`MAX_EPOCHS`).
        lr: Adam learning rate (default 1e-3; in (0, `MAX_LR`]).
        batch_positions: positions per step (default 128).
        held_out: share of positions held out for early stopping (default 0.2; in (0, 1)).
        patience: epochs without held-out improvement before stopping (default 2).
        max_positions: positions collected from the texts (default 4096; at least 2).
        seed: seeds the split and the initialisation (default 0).

    Raises:
        HeadsteerValueError: a value out of range, named; `check_config`: heads out of range, a
            full lens of too many heads.
    """

    NAME = "train_lens"

    heads: Sequence[tuple[int, int]] | None = None
    form: Literal["tuned", "full"] = "tuned"
    epochs: int = 10
    lr: float = 1e-3
    batch_positions: int = 128
    held_out: float = 0.2
    patience: int = 2
    max_positions: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        hs = check_head_pairs("heads", self.heads)
        if hs is not None and not hs:
            raise HeadsteerValueError("no heads to train a lens for")
        object.__setattr__(self, "heads", hs)
        check_choice("form", self.form, FORMS)
        if self.form == "full" and hs is not None and len(hs) > MAX_FULL_HEADS:
            raise HeadsteerValueError(
                f"a full d_model x |V| lens is large; {len(hs)} heads asked, at most {MAX_FULL_HEADS} "
                "(use form='tuned' for many heads)"
            )
        object.__setattr__(self, "epochs", check_int("epochs", self.epochs, lo=1, hi=MAX_EPOCHS))
        object.__setattr__(self, "batch_positions", check_int("batch_positions", self.batch_positions, lo=1))
        object.__setattr__(self, "patience", check_int("patience", self.patience, lo=1))
        object.__setattr__(self, "max_positions", check_int("max_positions", self.max_positions, lo=2))
        object.__setattr__(self, "seed", check_seed("seed", self.seed))
        object.__setattr__(self, "lr", check_number("lr", self.lr, lo=0.0, hi=MAX_LR, lo_open=True))
        held = check_number(
            "held_out", self.held_out, lo=0.0, hi=1.0, lo_open=True, hi_open=True, what="a number in (0, 1)"
        )
        object.__setattr__(self, "held_out", held)

    def check_geometry(self, geometry: Geometry) -> None:
        for la, h in self.heads or ():
            geometry.check_head("heads", la, h)
        n = len(self.heads) if self.heads is not None else geometry.n_layers * geometry.n_heads
        if self.form == "full" and n > MAX_FULL_HEADS:
            raise HeadsteerValueError(
                f"a full d_model x |V| lens of every head is {n} heads, at most {MAX_FULL_HEADS} "
                "(choose heads, or use form='tuned')"
            )


@dataclass(frozen=True)
class AtlasRequest(Request):
    """The head atlas: every per-head score on one table with a role per head (`heads.head_atlas`).

    The scores it gathers (detectors, sinks, MAPS, a lens) are its inputs; this request holds how
    they are read.

    Attributes:
        thresholds: `{role: threshold}` in precedence order (default `ROLE_THRESHOLDS`).
        thumbnails: keep a small attention pattern per head (default True).
        lens_text: a text the lens reads for its top tokens (default None; needs a lens input).
        seed: seeds the detector sequences it runs itself (default 0).
        stability: bootstrap resamples of the detector sequences (0: none).

    Raises:
        HeadsteerTypeError: thresholds not a mapping, thumbnails not a bool.
        HeadsteerValueError: a bad role or threshold, an empty lens_text, a bad seed or stability.
    """

    NAME = "head_atlas"

    thresholds: Mapping[str, float] = field(default_factory=lambda: dict(ROLE_THRESHOLDS))
    thumbnails: bool = True
    lens_text: str | None = None
    seed: int = 0
    stability: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "thresholds", check_thresholds(self.thresholds))
        check_bool("thumbnails", self.thumbnails)
        if self.lens_text is not None and (not isinstance(self.lens_text, str) or not self.lens_text.strip()):
            raise HeadsteerValueError(
                f"lens_text must be a non-empty string, got {short_repr(self.lens_text)}"
            )
        object.__setattr__(self, "seed", check_seed("seed", self.seed))
        object.__setattr__(self, "stability", check_stability(self.stability))

    def __hash__(self) -> int:
        return hash(
            (tuple(self.thresholds.items()), self.thumbnails, self.lens_text, self.seed, self.stability)
        )
