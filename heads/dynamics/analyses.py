"""The analysis `over_checkpoints` runs on each checkpoint: a name or a callable plus its
JSON parameters, and how any result becomes tidy rows.

An `Analysis` is one object: the function to run on a `HeadModel` and its keyword parameters.
The parameters must be JSON values (numbers, strings, lists, dicts: prompts and pairs are
given as data, e.g. `pairs=[{"clean": ..., "corrupted": ..., "answer": ...}]`), because a
resumed run compares them with the ones it started with. A future request object (a frozen
dataclass with `run(model)` and `to_json()`) is accepted as it is.

Built-in analyses (`ANALYSES`), each a thin call of the toolkit's own function:

| name | calls | rows |
|---|---|---|
| `detectors` | `pattern_scores` on repeated random tokens | one metric per detector |
| `atlas` | `head_atlas` | every score column, and the role labels |
| `dla` | `direct_logit_attribution(...).head_scores()` on `pairs` | `patching.dla` |
| `patching` | `patch(model, pairs, kind).head_scores()` | `patching.<kind>` |
| `circuit` | `find_circuit(model, pairs, ...)` | per-head importance, and the circuit's edges |
| `ships` | `ships(model, prompts).scores` | `ships` |
| `maps` | `maps_scores` on `{relation: [[source, target], ...]}` | `maps.<relation>` |
| `icl` | `heads.dynamics.icl.icl_score` | scalars `icl_score`, `loss_first`, `loss_second` |
| `induction_phase` | `icl` + the previous-token and induction detectors, one load | both |
| `composition` | `composition_scores` or `data_composition_scores` | top pairs as edges; per head in / out |
| `qk_attribution` | `qk_attribution(model, prompts, head)` at the last position | upstream heads' marginal |

A result becomes rows by its type (`tidy`): `HeadScores` (metric: its `method`, or the key of
a mapping), a mapping of them, a `HeadAtlas` (score columns + roles), a `Circuit` (head
importance + edges), anything with `head_scores()`, numbers (scalars), or a `Tidy` of rows.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from heads._util.validation import check_int, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.results.scores import HeadScores

__all__ = ["ANALYSES", "Analysis", "Tidy", "tidy"]


def _detectors(
    model: HeadModel,
    *,
    detectors: list[str] | None = None,
    n_seqs: int = 8,
    length: list[int] | None = None,
    seed: int = 0,
) -> dict[str, HeadScores]:
    from heads.scorers.roles.detectors import PATTERN_DETECTORS, pattern_scores

    enc = _repeated(model, length, n_seqs, seed)
    return pattern_scores(model, enc, detectors=tuple(detectors or PATTERN_DETECTORS), seed=seed)


def _repeated(model: HeadModel, length: list[int] | None, n_seqs: int, seed: int) -> Any:
    """The detectors' repeated random tokens, R of (25, 50) tokens capped by the model's positions."""
    from heads.scorers.roles.detectors import repeated_tokens

    if length is None:
        cap = 50 if model.max_positions is None else max(1, (model.max_positions - 1) // 2)
        span = (min(25, cap), min(50, cap))
    else:
        span = (int(length[0]), int(length[1]))
    return repeated_tokens(model, n_seqs=n_seqs, length=span, seed=seed)


def _atlas(model: HeadModel, *, seed: int = 0, retrieval: bool | None = None, successor: bool = True) -> Any:
    """`head_atlas` with `detect_roles`; `retrieval` None: only when the model has at least 512
    positions (the needle prompts are about 300 tokens)."""
    from heads.scorers.roles.atlas import head_atlas
    from heads.scorers.roles.detectors import detect_roles

    if retrieval is None:
        retrieval = model.max_positions is None or model.max_positions >= 512
    enc = _repeated(model, None, 8, seed)
    det = detect_roles(model, enc, seed=seed, retrieval=retrieval, successor=successor)
    return head_atlas(model, detectors=det, thumbnails=False, seed=seed)


def _pairs(model: HeadModel, pairs: list, chat: bool = False) -> Any:
    from heads.scorers.patching.pairs import encode_pairs

    try:
        return encode_pairs(model, pairs, chat=chat)
    except HeadsteerValueError as e:
        if "positions must align" not in str(e):
            raise
        raise HeadsteerValueError(
            f"{model.name or 'this checkpoint'}: its tokenizer splits the clean and corrupted prompts of "
            f"the pairs into different lengths ({e}); the pairs were written for another tokenizer "
            "(a cut vocabulary such as the model organism's breaks the shipped ioi / colored_objects "
            "pairs): pass pairs written for this checkpoint's tokenizer, or drop the pair analyses "
            "(dla, patching, circuit)"
        ) from None


def _dla(model: HeadModel, *, pairs: list, which: str = "clean", chat: bool = False) -> HeadScores:
    from heads.scorers.patching.logit import direct_logit_attribution

    return direct_logit_attribution(model, _pairs(model, pairs, chat), which=which).head_scores()


def _patching(
    model: HeadModel, *, pairs: list, kind: str = "head_out", metric: str = "logit_diff", chat: bool = False
) -> HeadScores:
    from heads.engine.options import SweepOptions
    from heads.scorers.patching.activation import patch

    res = patch(model, _pairs(model, pairs, chat), kind, metric=metric, options=SweepOptions(progress=False))
    return res.head_scores()


def _circuit(
    model: HeadModel,
    *,
    pairs: list,
    method: str = "eap-ig",
    n: int | None = None,
    size: float | None = None,
    steps: int = 5,
    metric: str = "logit_diff",
    chat: bool = False,
) -> Any:
    from heads.engine.options import SweepOptions
    from heads.scorers.circuits import find_circuit

    return find_circuit(
        model,
        _pairs(model, pairs, chat),
        method=method,
        n=n,
        size=size,
        steps=steps,
        metric=metric,
        curve=False,
        options=SweepOptions(progress=False),
    )


def _ships(model: HeadModel, *, prompts: list[str], ablation: str = "ua") -> HeadScores:
    from heads.engine.options import SweepOptions
    from heads.scorers.safety.ships import ships

    return ships(model, prompts, ablation=ablation, options=SweepOptions(progress=False)).scores  # type: ignore[arg-type]


def _maps(model: HeadModel, *, relations: dict[str, list[list[str]]], k: int = 10) -> dict[str, HeadScores]:
    from heads.scorers.maps.static import RelationPairs, maps_scores

    tok = model.tokenizer
    if tok is None:
        raise HeadsteerValueError("maps needs a model with a tokenizer")
    rels = []
    for name, pairs in relations.items():
        ids = []
        for src, tgt in pairs:
            s = tok(" " + src, add_special_tokens=False)["input_ids"]
            t = tok(" " + tgt, add_special_tokens=False)["input_ids"]
            if len(s) == 1 and len(t) == 1:
                ids.append((s[0], t[0]))
        if ids:
            rels.append(RelationPairs(name, ids, k))
    if not rels:
        raise HeadsteerValueError("maps: no relation has a pair of single-token words in this tokenizer")
    from heads.engine.options import SweepOptions

    out = maps_scores(model, rels, options=SweepOptions(progress=False))
    return {f"maps.{n}": s for n, s in out.relation.items()}


def _icl(model: HeadModel, *, n: int = 16, length: int | None = None, seed: int = 0) -> dict[str, float]:
    from heads.dynamics.icl import icl_score

    return icl_score(model, n=n, length=length, seed=seed)


def _induction_phase(
    model: HeadModel,
    *,
    n: int = 16,
    length: int | None = None,
    seed: int = 0,
    composition: bool = True,
    composition_rows: int | None = None,
) -> dict[str, Any]:
    """ICL score, the previous-token and induction detectors (on the same repeated tokens), and
    the K-composition of the top previous-token head into the top induction head.

    The induction head is the best `induction` head of layers >= 1; the previous-token head the
    best `previous_token` head of an earlier layer. Scalars `k_composition` (measured on the
    first `composition_rows` rows: `data_composition_scores`, exact with RoPE, logit units) and
    `k_composition_weights` (`composition_scores`, from the weights without RoPE, minus the random
    baseline); per-head `k_composition_into_induction` (every earlier head's measured
    K-composition into the induction head; NaN for heads not earlier).

    Raises:
        HeadsteerValueError: as `icl_sequences`; `composition_rows` not an int in 1..n or None
            (default: 2, or the one row when n = 1; 0 or a negative was raised to 1 and a larger
            count cut to n silently), before any forward.
    """
    from heads.dynamics.icl import icl_score, icl_sequences
    from heads.scorers.roles.detectors import pattern_scores

    enc = icl_sequences(model, n=n, length=length, seed=seed)
    rows = enc.input_ids.shape[0]
    if composition_rows is None:
        composition_rows = min(2, rows)
    else:
        composition_rows = check_int("composition_rows", composition_rows, lo=1, hi=rows)
    out: dict[str, Any] = dict(icl_score(model, enc))
    det = pattern_scores(model, enc, detectors=("previous_token", "induction"))
    out.update(det)
    if composition and model.n_layers > 1:
        from heads.scorers.qk.composition import composition_scores, data_composition_scores

        ind = det["induction"].scores.nan_to_num(-1.0)
        ind[0] = -1.0
        rl, rh = divmod(int(ind.argmax()), model.n_heads)
        prev = det["previous_token"].scores[:rl].nan_to_num(-1.0)
        wl, wh = divmod(int(prev.argmax()), model.n_heads)
        data = data_composition_scores(model, enc.input_ids[:composition_rows])
        into = data.raw["k"][:, :, rl, rh].clone()
        out["k_composition_into_induction"] = HeadScores(into, "k_composition", model=model.name)
        out["k_composition"] = float(into[wl, wh])
        out["k_composition_weights"] = float(composition_scores(model).k[wl, wh, rl, rh])
    return out


def _composition(
    model: HeadModel,
    *,
    kinds: list[str] | None = None,
    top: int = 200,
    data: bool = False,
    n: int = 4,
    seed: int = 0,
) -> Tidy:
    """Q- / K- / V-composition between heads (`composition_scores`, minus the random baseline; or
    measured on `n` repeated-token rows with `data=True`): the `top` writer -> reader pairs of each
    kind as edges (`"L0.H3" -> "L1.H0"`, metric `"<kind>_composition"`), and per head the largest
    composition out of it and into it (`"<kind>_composition_out"` / `"_in"`)."""
    import torch

    from heads.dynamics.icl import icl_sequences
    from heads.scorers.qk.composition import composition_scores, data_composition_scores

    if data:
        cs = data_composition_scores(model, icl_sequences(model, n=n, seed=seed).input_ids)
    else:
        cs = composition_scores(model, seed=seed)
    out = Tidy()
    for kind in kinds or ["q", "k", "v"]:
        for (l1, h1), (l2, h2), v in cs.top(kind, top):
            out.edges.append(
                {
                    "metric": f"{kind}_composition",
                    "source": f"L{l1}.H{h1}",
                    "target": f"L{l2}.H{h2}",
                    "score": v,
                }
            )
        t = cs.get(kind)
        for name, red in (
            ("out", t.flatten(2).nan_to_num(-torch.inf).amax(-1)),
            ("in", t.flatten(0, 1).nan_to_num(-torch.inf).amax(0)),
        ):
            red = torch.where(torch.isinf(red), torch.nan, red)
            out.scores += _head_rows(HeadScores(red, "composition"), f"{kind}_composition_{name}")
    return out


def _qk_attribution(
    model: HeadModel,
    *,
    head: list[int],
    side: str = "key",
    prompts: list[str] | None = None,
    n: int = 4,
    length: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """`qk_attribution` of one head at the last position (`prompts`, default `n` repeated-token
    rows): each upstream head's mean `side` marginal (`head_scores(side)`), and `max_error`."""
    from heads.dynamics.icl import icl_sequences
    from heads.scorers.qk.attribution import qk_attribution

    src: Any = (
        prompts if prompts is not None else icl_sequences(model, n=n, length=length, seed=seed).input_ids
    )
    r = qk_attribution(model, src, (int(head[0]), int(head[1])))
    return {f"qk_attribution.{side}": r.head_scores(side), "qk_max_error": float(r.max_error())}


ANALYSES: dict[str, Callable[..., Any]] = {
    "detectors": _detectors,
    "atlas": _atlas,
    "dla": _dla,
    "patching": _patching,
    "circuit": _circuit,
    "ships": _ships,
    "maps": _maps,
    "icl": _icl,
    "induction_phase": _induction_phase,
    "composition": _composition,
    "qk_attribution": _qk_attribution,
}
"""Built-in analyses by name (see the module docstring); each takes `(model, **params)`."""


def _check_json(params: Mapping[str, Any], where: str) -> dict:
    if not isinstance(params, Mapping):
        raise HeadsteerTypeError(f"{where} must be a dict of JSON values, got {type(params).__name__}")
    bad = next((k for k in params if not isinstance(k, str)), None)
    if bad is not None:
        raise HeadsteerTypeError(f"{where} keys must be strings, got {short_repr(bad)}")
    try:
        text = json.dumps(params, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise HeadsteerValueError(
            f"{where} must be JSON values (a resumed run compares them): {err}"
        ) from None
    out: dict = json.loads(text)
    return out


@dataclass(frozen=True)
class Analysis:
    """One analysis to run on every checkpoint: a function and its JSON parameters.

    Build it with `Analysis.of(analysis, params)`.

    Attributes:
        name: the `ANALYSES` name, `module:qualname` of a callable, or a request's type name.
        params: the keyword parameters (JSON values; a request's `to_json()`).
        fn: `fn(model, **params)`, or None for a request (its `run(model)` is called).
        request: the request object, or None.
    """

    name: str
    params: dict = field(default_factory=dict)
    fn: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    request: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, analysis: Any, params: Mapping[str, Any] | None = None, inputs: Any = None) -> Analysis:
        """An `Analysis` from a name in `ANALYSES`, a callable `fn(model, **params)`, an
        `Analysis` (then `params` must be None), an analysis request of `heads`
        (`PatchRequest(...)`, `CircuitRequest(...)`, ...: run by `heads.run(model, request,
        inputs)`) or another request object (with `run(model)` and `to_json()`).

        Args:
            analysis: as above.
            params: the keyword parameters of a name or a callable (JSON values).
            inputs: a `heads` request's one input (prompt pairs as `PromptPair`s or their
                dicts, prompts, texts: JSON values or dataclasses of them, so that a resumed run
                can compare them); None for a request that takes none. Only with a request.

        Raises:
            HeadsteerValueError: an unknown name; parameters that are not JSON values or that the
                function does not take; `inputs` without a `heads` request, or not JSON values
                (checked before any model is loaded).
            HeadsteerTypeError: `analysis` of another kind.
        """
        from heads.scorers.request_base import Request

        if isinstance(analysis, Request):
            if params is not None:
                raise HeadsteerValueError("a request carries its own parameters: drop params=")
            given = _plain_inputs(inputs)
            data = _check_json({"request": analysis.to_json(), "inputs": given}, "the request and its inputs")
            return cls(analysis.NAME, data, None, _RequestRun(analysis, inputs))
        if inputs is not None:
            raise HeadsteerValueError(
                "inputs= goes with an analysis request (heads.PatchRequest, ...); a name or a "
                "callable takes its inputs in params="
            )
        if isinstance(analysis, Analysis):
            if params is not None:
                raise HeadsteerValueError("params are given twice: in the Analysis and as params=")
            return analysis
        if hasattr(analysis, "run") and hasattr(analysis, "to_json") and not isinstance(analysis, str):
            if params is not None:
                raise HeadsteerValueError("a request carries its own parameters: drop params=")
            data = _check_json(analysis.to_json(), "the request's to_json()")
            return cls(type(analysis).__name__, data, None, analysis)
        p = _check_json({} if params is None else params, "params")
        if isinstance(analysis, str):
            if analysis not in ANALYSES:
                raise HeadsteerValueError(
                    f"unknown analysis {short_repr(analysis)}: one of {', '.join(ANALYSES)}, or a callable"
                )
            fn, name = ANALYSES[analysis], analysis
        elif callable(analysis):
            fn = analysis
            name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"
        else:
            raise HeadsteerTypeError(
                f"analysis must be a name ({', '.join(ANALYSES)}), a callable or a request, got "
                f"{type(analysis).__name__}"
            )
        _check_takes(fn, p, name)
        return cls(name, p, fn, None)

    def identity(self) -> dict:
        """What a resumed run must match: `{"analysis": name, "params": params}`."""
        return {"analysis": self.name, "params": self.params}

    def run(self, model: HeadModel) -> Any:
        """Run it on one model."""
        if self.request is not None:
            return self.request.run(model)
        assert self.fn is not None
        return self.fn(model, **self.params)


@dataclass(frozen=True)
class _RequestRun:
    """A `heads` analysis request and its input, run by `heads.run` on each checkpoint."""

    request: Any
    inputs: Any

    def run(self, model: HeadModel) -> Any:
        from heads.scorers.dispatch import run

        return run(model, self.request) if self.inputs is None else run(model, self.request, self.inputs)

    def check_config(self, config: object) -> None:
        self.request.check_config(config)


def _plain_inputs(inputs: Any) -> Any:
    """`inputs` as JSON values (dataclasses such as `PromptPair` as dicts), for the run's identity."""
    import dataclasses

    if dataclasses.is_dataclass(inputs) and not isinstance(inputs, type):
        return dataclasses.asdict(inputs)
    if isinstance(inputs, Mapping):
        return {k: _plain_inputs(v) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return [_plain_inputs(v) for v in inputs]
    return inputs


def _check_takes(fn: Callable[..., Any], params: dict, name: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        sig.bind(None, **params)
    except TypeError as err:
        raise HeadsteerValueError(f"analysis {name!r} does not take these params: {err}") from None


@dataclass
class Tidy:
    """One checkpoint's result as rows: `scores` (metric, layer, head, score), `scalars`
    (metric, value), `edges` (metric, source, target, score), `roles` (layer, head, role)."""

    scores: list[dict] = field(default_factory=list)
    scalars: list[dict] = field(default_factory=list)
    edges: list[dict] = field(default_factory=list)
    roles: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        """The rows as JSON-ready lists (NaN as None)."""

        def clean(rows: list[dict]) -> list[dict]:
            return [
                {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                for r in rows
            ]

        return {
            "scores": clean(self.scores),
            "scalars": clean(self.scalars),
            "edges": clean(self.edges),
            "roles": self.roles,
        }


def _head_rows(s: HeadScores, metric: str) -> list[dict]:
    t = s.scores.float()
    return [
        {"metric": metric, "layer": la, "head": h, "score": float(t[la, h])}
        for la in range(t.shape[0])
        for h in range(t.shape[1])
    ]


def tidy(result: Any, name: str = "value") -> Tidy:
    """The rows of one analysis result (see the module docstring).

    Raises:
        HeadsteerTypeError: a result of a type with no tidy form (naming it).
    """
    out = Tidy()
    _add(out, result, name)
    return out


def _add(out: Tidy, result: Any, name: str) -> None:
    from heads.results.atlas import HeadAtlas
    from heads.results.circuits import Circuit
    from heads.results.roles import RoleScores

    if isinstance(result, RoleScores):  # its plain mapping (its dict-style reads warn)
        result = result.as_dict()

    if isinstance(result, Tidy):
        out.scores += result.scores
        out.scalars += result.scalars
        out.edges += result.edges
        out.roles += result.roles
    elif isinstance(result, HeadScores):
        out.scores += _head_rows(result, name)
    elif isinstance(result, HeadAtlas):
        f = result.frame
        for col in result.score_columns:
            if col == "best_relation_score" or f[col].dtype.kind in "fiu":
                out.scores += [
                    {"metric": col, "layer": int(a), "head": int(b), "score": float(v)}
                    for a, b, v in zip(f["layer"], f["head"], f[col], strict=True)
                ]
        out.roles += [
            {"layer": int(a), "head": int(b), "role": str(r)}
            for a, b, r in zip(f["layer"], f["head"], f["role"], strict=True)
        ]
    elif isinstance(result, Circuit):
        out.scores += _head_rows(result.head_scores(), name)
        fr = result.to_frame()
        out.edges += [
            {"metric": name, "source": s, "target": t, "score": float(v)}
            for s, t, v in zip(fr["source"], fr["target"], fr["score"], strict=True)
        ]
        if result.faithfulness is not None:
            out.scalars.append({"metric": f"{name}.faithfulness", "value": float(result.faithfulness)})
    elif isinstance(result, (int, float)) and not isinstance(result, bool):
        out.scalars.append({"metric": name, "value": float(result)})
    elif isinstance(result, Mapping):
        for k, v in result.items():
            _add(out, v, str(k))
    elif callable(getattr(result, "head_scores", None)):
        _add(out, result.head_scores(), name)
    elif hasattr(result, "item") and getattr(result, "numel", lambda: 0)() == 1:
        out.scalars.append({"metric": name, "value": float(result.item())})
    else:
        raise HeadsteerTypeError(
            f"analysis result {type(result).__name__} ({name!r}) has no tidy form: return HeadScores, a "
            "dict of them, a Circuit, a HeadAtlas or numbers"
        )
