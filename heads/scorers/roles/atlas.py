"""`head_atlas`: gather every per-head score of a model into one `HeadAtlas` and label each head's
role.

The atlas runs the role detectors (`heads.scorers.roles.detectors`) when none are given and
takes any other `HeadScores` a user has (span attention, sink statistics, MAPS, Ships, probes,
patching, ...) as columns. The result class, the role order, the default thresholds
(`ROLE_THRESHOLDS`), the sink columns and the NaN rule are written once, in
`heads.results.atlas`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from heads._util.validation import check_int, check_seed, short_repr
from heads.engine.context import editing
from heads.engine.edits import Recorder
from heads.engine.forward import forward
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.results.atlas import (  # the result and its role labels: defined there, imported here as before
    _LABELS,
    _RESERVED,
    ROLE_COLUMNS,
    HeadAtlas,
    _check_role,
    role_labels,
)
from heads.results.roles import RoleScores
from heads.results.scores import HeadScores
from heads.scorers.maps.static import MapsScores
from heads.scorers.roles.detectors import PATTERN_DETECTORS, detect_roles, repeated_tokens
from heads.scorers.roles.lens import AttentionLens
from heads.scorers.roles.request import ROLE_THRESHOLDS, AtlasRequest
from heads.scorers.sinks import SinkStats

__all__ = [
    "ROLE_COLUMNS",
    "ROLE_THRESHOLDS",
    "HeadAtlas",
    "head_atlas",
    "pattern_thumbnails",
    "role_labels",
    "run_head_atlas",
]


MAX_THUMBNAIL = 64
"""Largest `size` of `pattern_thumbnails`."""


@torch.no_grad()
def pattern_thumbnails(model: HeadModel, *, size: int = 24, seed: int = 0) -> torch.Tensor:
    """`[L, H, s, s]` fp16 attention patterns of every head on one [BOS] + R + R row (R of 24
    tokens drawn with `seed`), average-pooled to `size` x `size` (the induction stripe and the
    previous-token diagonal stay visible).

    Args:
        size: the side s, 1..`MAX_THUMBNAIL` (default 24).
        seed: an int in 0..2**32 - 1 (default 0).

    Raises:
        HeadsteerValueError: bad `size` or `seed`; a model too small for the row (checked first).
    """
    size = check_int("size", size, lo=1, hi=MAX_THUMBNAIL)
    seed = check_seed("seed", seed)
    enc = repeated_tokens(model, n_seqs=1, length=(24, 24), seed=seed)
    recs = [Recorder(layer=la) for la in range(model.n_layers)]
    with editing(model, recs):
        forward(model, enc)
    pats = torch.stack([torch.cat(r.records, dim=2)[0] for r in recs]).float().cpu()  # [L, H, T, T]
    pooled = torch.nn.functional.adaptive_avg_pool2d(pats.flatten(0, 1)[:, None], size)[:, 0]
    return pooled.view(model.n_layers, model.n_heads, size, size).half()


def _check_scores(name: object, s: object, model: HeadModel) -> HeadScores:
    """A score column for `model`'s atlas: HeadScores `[L, H]` of this model, under a free name."""
    if not isinstance(name, str) or not name.strip():
        raise HeadsteerValueError(f"score column names must be non-empty strings, got {short_repr(name)}")
    if not isinstance(s, HeadScores):
        raise HeadsteerTypeError(f"score {short_repr(name)} must be HeadScores, got {type(s).__name__}")
    L, H = model.n_layers, model.n_heads
    if (s.n_layers, s.n_heads) != (L, H):
        raise HeadsteerValueError(
            f"score {short_repr(name)} is [{s.n_layers}, {s.n_heads}], the model has [{L}, {H}] heads"
        )
    if s.model and s.model != model.name:
        raise HeadsteerValueError(
            f"score {short_repr(name)} was computed on {short_repr(s.model)}, not on {short_repr(model.name)}"
        )
    return s


_INPUTS = ("detectors", "scores", "sinks", "maps", "lens")
"""The scores the atlas gathers (the keys of `run_head_atlas`'s inputs)."""


def head_atlas(
    model: HeadModel,
    *,
    detectors: Mapping[str, HeadScores] | None = None,
    scores: Mapping[str, HeadScores] | None = None,
    sinks: SinkStats | None = None,
    maps: MapsScores | None = None,
    lens: AttentionLens | None = None,
    lens_text: str | None = None,
    thresholds: Mapping[str, float] = ROLE_THRESHOLDS,
    thumbnails: bool = True,
    seed: int = 0,
    stability: int = 0,
) -> HeadAtlas:
    """Build the atlas of every head of `model`.

    Args:
        model: the model (a `HeadModel`).
        detectors: role detector scores `{name: HeadScores}` (default None: `detect_roles(model,
            seed=seed)`, computed here after every other argument is checked).
        scores: any other `{column: HeadScores}` (span attention, Ships, probe accuracy,
            patching, VHD, ...), each `[L, H]` of this model (default None).
        sinks: a `heads.scorers.sinks.SinkStats` (columns `first_token_mass`, which the `sink`
            role reads, `sink_mass`, the mass on every flagged sink, and `n_sinks`; default None).
        maps: a `MapsScores` (columns `best_relation`, `best_relation_score`; default None).
        lens: an `AttentionLens` of this model, trained (column `lens_kl_ratio`; with `lens_text`,
            the top lens token at each position of that text per head, for the report's cards).
        lens_text: a non-empty text, only with `lens` (default None).
        thresholds: role thresholds (default `ROLE_THRESHOLDS`; see `role_labels`: known roles
            or score columns, finite numbers > 0, numpy numbers too).
        thumbnails: also keep `pattern_thumbnails` (one small forward; default True).
        seed: seeds the detectors and thumbnails (an int in 0..2**32 - 1, default 0).
        stability: bootstrap resamples of the detectors' sequences (default 0: none) when the
            detectors are computed here. Every column whose `HeadScores` carries a `stability`
            gets a `<column>_p_top_k` column (share of resamples with the head in the top k) and
            its summary in `sources[<column>]["stability"]` (k, Jaccard, the stable heads).

    Returns:
        `HeadAtlas` with one row per head (`L * H` rows).

    Raises:
        HeadsteerValueError: a score of another geometry or model (by `HeadScores.model`), a
            column given twice or reserved, bad thresholds, `lens_text` without `lens`, an
            untrained lens or one of another model, a bad seed.
        HeadsteerTypeError: `model` not a `HeadModel`; a score that is not `HeadScores`; any
            other argument of a wrong type (all checked before any forward).
    """
    request = AtlasRequest(
        thresholds=thresholds, thumbnails=thumbnails, lens_text=lens_text, seed=seed, stability=stability
    )
    given = dict(zip(_INPUTS, (detectors, scores, sinks, maps, lens), strict=True))
    return run_head_atlas(model, given, request)


def run_head_atlas(
    model: HeadModel, inputs: Mapping[str, Any] | None, request: AtlasRequest, options: object = None
) -> HeadAtlas:
    """Run an `AtlasRequest` (built and checked by `head_atlas`) on `inputs`, the scores it gathers: a
    mapping of any of `_INPUTS` (None: none; see `head_atlas` for each and the errors); no `options`."""
    if not isinstance(request, AtlasRequest):
        raise HeadsteerTypeError(f"request must be an AtlasRequest, got {type(request).__name__}")
    if not isinstance(model, HeadModel):
        raise HeadsteerTypeError(f"model must be a HeadModel, got {type(model).__name__}")
    given = {} if inputs is None else inputs
    if not isinstance(given, Mapping):
        raise HeadsteerTypeError(
            f"the atlas' inputs are a mapping of the scores it gathers ({', '.join(_INPUTS)}), got "
            f"{type(inputs).__name__}"
        )
    for k in given:
        if k not in _INPUTS:
            raise HeadsteerValueError(f"unknown atlas input {k!r}; known: {', '.join(_INPUTS)}")
    detectors, scores, sinks, maps, lens = (given.get(k) for k in _INPUTS)
    for arg, value in (("detectors", detectors), ("scores", scores)):
        if value is not None and not isinstance(value, Mapping):
            raise HeadsteerTypeError(
                f"{arg} must be a {{name: HeadScores}} mapping, got {type(value).__name__}"
            )
    optional: tuple[tuple[str, object, type], ...] = (("sinks", sinks, SinkStats), ("maps", maps, MapsScores))
    for arg, obj, kind in (*optional, ("lens", lens, AttentionLens)):
        if obj is not None and not isinstance(obj, kind):
            article = "an" if kind.__name__[0] in "AEIOU" else "a"
            raise HeadsteerTypeError(
                f"{arg} must be {article} {kind.__name__} or None, got {type(obj).__name__}"
            )
    if request.lens_text is not None and lens is None:
        raise HeadsteerValueError("lens_text needs a lens")
    if isinstance(detectors, RoleScores):  # its plain mapping (its dict-style reads warn)
        detectors = detectors.as_dict()
    if isinstance(scores, RoleScores):
        scores = scores.as_dict()
    L, H = model.n_layers, model.n_heads
    cols: dict[str, HeadScores] = {}
    extra = dict(scores or {})
    if sinks is not None:
        extra.setdefault("first_token_mass", sinks.first_mass)
        extra.setdefault("sink_mass", sinks.sink_mass)
        extra.setdefault("n_sinks", sinks.n_sinks)
    if lens is not None:
        lens.check_model(model)
        extra.setdefault("lens_kl_ratio", lens.kl_scores("ratio"))
    if maps is not None:
        if not maps.relation:
            raise HeadsteerValueError("maps holds no relation")
        for n, s in maps.relation.items():
            _check_scores(f"maps relation {n}", s, model)
    will = [*PATTERN_DETECTORS, "copying", "successor", "retrieval"] if detectors is None else []
    for name, s in [*(detectors or {}).items(), *extra.items()]:
        if name in cols or name in will or name in _RESERVED or name in _LABELS:
            raise HeadsteerValueError(f"score column {short_repr(name)} given twice or reserved")
        cols[name] = _check_scores(name, s, model)
    known = set(cols) | set(will) | ({"best_relation_score"} if maps is not None else set())
    t = dict(request.thresholds)
    for role in t:
        _check_role(role, known)
    if detectors is None:
        det = detect_roles(model, seed=request.seed, stability=request.stability)
        cols = {**det.as_dict(), **cols}
    base = HeadScores(torch.zeros(L, H), "atlas", model=model.name, n_kv_heads=model.n_kv_heads).to_frame()
    frame = base.drop(columns=["score"])
    for name, s in cols.items():
        frame[name] = s.scores.flatten().numpy()
    if maps is not None:
        best, which = maps.best_relation()
        frame["best_relation"] = [n for row in which for n in row]
        frame["best_relation_score"] = best.scores.flatten().numpy()
    frame["role"] = role_labels(frame, t)
    sources: dict[str, dict] = {n: {"method": s.method, "params": s.params} for n, s in cols.items()}
    for n, s in cols.items():
        if s.stability is not None and s.stability.shape == [L, H]:
            frame[f"{n}_p_top_k"] = s.stability.p_top_k.numpy()
            sources[n]["stability"] = s.stability.summary()
    tokens: dict[tuple[int, int], list[str]] = {}
    if lens is not None and request.lens_text is not None:
        for la, h in lens.heads:
            df = lens.top_tokens(model, request.lens_text, la, h, k=1)
            tokens[(la, h)] = [r[0] for r in df["lens_tokens"]]
    thumbs = pattern_thumbnails(model, seed=request.seed) if request.thumbnails else None
    return HeadAtlas(frame, model.name, t, sources, thumbs, tokens)
