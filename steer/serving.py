"""Serving steered generation: per-request steering specs, and batches of requests that
each carry their own steering, decoded together through the engine's per-row edits.

The HTTP layer (`viz.server.app`) turns an OpenAI-style body into a `ServeRequest`
(`parse_steer`, `SamplingParams.from_body`), `BatchGenerator.prepare` validates it
alone (so a bad request fails before it joins a batch), and `BatchGenerator.run`
decodes a list of prepared requests as one left-padded batch. Every request's edits
are restricted to its own batch row (`Edit.row_heads`), and its sampling uses its own
`torch.Generator`, so a request gets the same tokens alone or in any batch (up to
float round-off between batch shapes, which does not change greedy answers in the
tests). `Batcher` is the dynamic batcher: one worker thread that collects the requests
arriving within `wait_s` (up to `max_batch`) and runs them as one batch.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar, cast

import torch

from heads._util.validation import is_int, is_number, short_repr
from heads.engine.context import editing, validate_edits
from heads.engine.edits import (
    AttentionCall,
    Edit,
    HeadOutputEdit,
    LogitBias,
    ProbEdit,
    QueryEdit,
    ResidualEdit,
    SpanShareEdit,
)
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, Prompt, encode_prompts, position_ids
from heads.model.adapter import HeadModel
from heads.scorers.attention_mass import span_attention
from steer.ablate import Ablate
from steer.act.method import Act
from steer.adaptvis import AdaptVis, ScalingVis
from steer.caa import Caa
from steer.instaboost import InstaBoost
from steer.kv_window import check_window_room
from steer.noop import refusing_noop
from steer.pasta.method import Pasta
from steer.pattern_injection import PatternInjection
from steer.profiles import shipped_profile
from steer.sampling import draw, fresh_seed, row_generator
from steer.spotlight import Spotlight
from steer.steered_model import Intervention, check_new_tokens
from steer.visual_modulation import VisualModulation

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "Batcher",
    "BatchGenerator",
    "Job",
    "RequestCancelled",
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


def _heads_spec(value, method: str):
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


def _number(value, name: str) -> float:
    if not is_number(value) or not math.isfinite(float(value)):
        raise HeadsteerValueError(f"{name} must be a finite number, got {short_repr(value)}")
    return float(value)


def parse_steer(spec, caa_vectors: Mapping[str, Caa] | None = None) -> list[Intervention]:
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


def _pad_to(enc: EncodedPrompts, width: int, pad_id: int) -> EncodedPrompts:
    """A one-row encoding left-padded to `width` columns (spans shifted by the padding)."""
    pad = width - enc.length
    if pad == 0:
        return enc
    ids = torch.cat([torch.full((1, pad), pad_id, dtype=torch.long), enc.input_ids], dim=1)
    mask = torch.cat([torch.zeros((1, pad), dtype=torch.long), enc.attention_mask], dim=1)
    spans = [[(t0 + pad, t1 + pad) for t0, t1 in enc.spans[0]]]
    return EncodedPrompts(ids, mask, spans, enc.texts, enc.char_spans)


def _row_call(call: AttentionCall) -> AttentionCall:
    """The attention call as one batch row sees it."""
    return AttentionCall(call.layer, 1, call.n_heads, call.q_len, call.k_len, call.q_offset, call.device)


@dataclass(eq=False, repr=False)
class _RowEdits:
    """Edits of one layer and kind, each applied to its own batch row only (`members`)."""

    layer: int
    members: list = field(default_factory=list)  # [(row, edit)]

    def _rows(self, x: torch.Tensor, call: AttentionCall, head_dim: int) -> torch.Tensor:
        """Apply each member's `apply` to its row slice of `x` (heads on dim `head_dim`)."""
        out = x.clone()
        sub_call = _row_call(call)
        for b, e in self.members:
            sub = out[b : b + 1]
            shape = [1] * x.ndim
            shape[head_dim] = call.n_heads
            mask = e.head_mask(1, call.n_heads, x.device).reshape(shape)
            out[b : b + 1] = torch.where(mask, e.apply(sub, sub_call), sub)
        return out


class _RowHeads(_RowEdits):
    """Row edits whose `head_mask` is each row's own members' heads (`[B, H]`), not all heads."""

    def head_mask(self, batch: int, n_heads: int, device: torch.device) -> torch.Tensor:
        mask = torch.zeros(batch, n_heads, dtype=torch.bool, device=device)
        for b, e in self.members:
            mask[b] |= e.head_mask(1, n_heads, device)[0]
        return mask


@dataclass(eq=False, repr=False)
class _RowBias(_RowHeads, LogitBias):
    """Every row's logit bias of one layer as one tensor that broadcasts like a per-call bias.

    When each row has at most one member and every member's bias is shared by its heads
    (PASTA: `[1, 1, 1, K]`), the bias is `[B, 1, 1, K]` and `row_heads` (`[B, H]`, each row's
    own heads) restricts it, so a batch costs what one per-call edit costs; otherwise
    `[B, H, 1|Q, K]` (members combined per head). `per_column` when every member is.
    """

    def bias(self, call: AttentionCall) -> torch.Tensor:
        sub_call = _row_call(call)
        parts = [(b, e, e.bias(sub_call).float()) for b, e in self.members]
        q = max(p.shape[2] for _, _, p in parts)
        rows = [b for b, _, _ in parts]
        if len(set(rows)) == len(rows) and all(p.shape[1] == 1 for _, _, p in parts):
            out = torch.zeros(call.batch, 1, q, call.k_len, device=call.device)
            for b, _, p in parts:
                out[b] = p[0].to(call.device)
            return out
        out = torch.zeros(call.batch, call.n_heads, q, call.k_len, device=call.device)
        for b, e, p in parts:
            mask = e.head_mask(1, call.n_heads, call.device)[0, :, None, None]
            out[b] += torch.where(mask, p[0].to(call.device), 0.0)
        return out


@dataclass(eq=False, repr=False)
class _RowScoreBias(_RowHeads, LogitBias):
    """Every row's logit-reading bias (AdaptVis / ScalingVis) of one layer: each member's
    `score_bias` on its own row's logits and heads, `[B, H, q_len, k_len]` (blocked kernel)."""

    reads_scores: ClassVar[bool] = True

    def bias(self, call: AttentionCall) -> torch.Tensor:
        raise NotImplementedError("a function of the logits: see score_bias")

    def score_bias(self, scores: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        sub_call = _row_call(call)
        out = torch.zeros(call.batch, scores.shape[1], call.q_len, call.k_len, device=call.device)
        for b, e in self.members:
            mask = e.head_mask(1, call.n_heads, call.device)[0, :, None, None]
            part = e.score_bias(scores[b : b + 1], sub_call).float().to(call.device)
            out[b] += torch.where(mask, part[0].expand(scores.shape[1], call.q_len, call.k_len), 0.0)
        return out


@dataclass(eq=False, repr=False)
class _RowResiduals(_RowEdits, ResidualEdit):
    """Every row's residual edit (CAA) of one layer, each applied to its own batch row."""

    def apply(self, x: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
        sub_call = _row_call(call)
        out = None
        for b, e in self.members:
            new = e.apply(x[b : b + 1] if out is None else out[b : b + 1], sub_call)
            if new is None:
                continue
            if out is None:
                out = x.clone()
            out[b : b + 1] = new.to(dtype=x.dtype, device=x.device)
        return out


@dataclass(eq=False, repr=False)
class _RowSpans(_RowHeads, SpanShareEdit):
    """Every row's span-share edit (SpotLight) of one layer as one `SpanShareEdit`, so a long
    prompt runs on the fused kernel exactly as `SteeredModel` runs it (at most one member per row)."""

    def span_columns(self, call: AttentionCall) -> torch.Tensor:
        m = torch.zeros(call.batch, call.k_len, dtype=torch.bool, device=call.device)
        sub_call = _row_call(call)
        for b, e in self.members:
            m[b] = e.span_columns(sub_call)[0].to(call.device)
        return m

    def span_beta(self, num: torch.Tensor, den: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
        sub_call = _row_call(call)
        beta = None
        for b, e in self.members:
            heads = e.head_mask(1, call.n_heads, num.device)[:, :, None]  # [1, H, 1]
            r = e.span_beta(
                torch.where(heads, num[b : b + 1], 0.0), torch.where(heads, den[b : b + 1], 0.0), sub_call
            )
            if r is None:
                continue
            if beta is None:
                beta = torch.zeros_like(num)
            beta[b] = torch.where(heads[0], r.float().expand(1, num.shape[1], num.shape[2])[0], 0.0)
        return beta


@dataclass(eq=False, repr=False)
class _RowProbs(_RowEdits, ProbEdit):
    def apply(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return self._rows(probs, call, 1)  # [B, H, q, k]


@dataclass(eq=False, repr=False)
class _RowOutputs(_RowEdits, HeadOutputEdit):
    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return self._rows(z, call, 2)  # [B, q, H, d]


@dataclass(eq=False, repr=False)
class _RowQueries(_RowEdits, QueryEdit):
    def apply(self, q: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return self._rows(q, call, 2)  # [B, q, H, d]


_RowWrapper = _RowBias | _RowScoreBias | _RowSpans | _RowProbs | _RowOutputs | _RowQueries | _RowResiduals
_WRAPPERS: dict[type[Edit], type[_RowWrapper]] = {  # first match wins: SpanShareEdit before ProbEdit
    LogitBias: _RowBias,
    SpanShareEdit: _RowSpans,
    ProbEdit: _RowProbs,
    HeadOutputEdit: _RowOutputs,
    QueryEdit: _RowQueries,
    ResidualEdit: _RowResiduals,
}


def _wrapper(e: Edit) -> type[_RowWrapper]:
    """The per-row wrapper class of edit `e` (`_WRAPPERS`; a logit-reading bias gets its own)."""
    if isinstance(e, LogitBias) and e.reads_scores:
        return _RowScoreBias
    for kind, wrapper in _WRAPPERS.items():
        if isinstance(e, kind):
            return wrapper
    raise HeadsteerTypeError(f"{type(e).__name__} cannot be served: no per-row form of its edit site")


class RequestCancelled(Exception):
    """The client of a request went away; its row stopped decoding after `completion_tokens`."""

    def __init__(self, message: str = "the client went away", completion_tokens: int = 0):
        super().__init__(message)
        self.completion_tokens = completion_tokens


class BatchGenerator:
    """Runs batches of `ServeRequest`s, each with its own steering, on one model.

    Args:
        model: a `HeadModel` with a tokenizer.
        max_prompt_tokens: longest rendered prompt a request may have, in tokens (default
            None: the model's positions, less `max_tokens`).
    """

    def __init__(self, model: HeadModel, *, max_prompt_tokens: int | None = None):
        if not isinstance(model, HeadModel) or model.tokenizer is None:
            raise HeadsteerTypeError("BatchGenerator needs a HeadModel with a tokenizer (heads.load_model)")
        if max_prompt_tokens is not None and (
            isinstance(max_prompt_tokens, bool)
            or not isinstance(max_prompt_tokens, int)
            or max_prompt_tokens < 1
        ):
            raise HeadsteerValueError(
                f"max_prompt_tokens must be a positive int, got {short_repr(max_prompt_tokens)}"
            )
        self.model = model
        self.max_prompt_tokens = max_prompt_tokens
        tok = model.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos = model.model.generation_config.eos_token_id
        if eos is None:
            eos = tok.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}

    def _resolve_auto(self, s, enc: EncodedPrompts, request: ServeRequest):
        """Replace `heads="auto"` with the shipped profile (or the span heuristic for PASTA)."""
        if getattr(s, "heads", None) != "auto":
            return s
        kind = "pasta" if isinstance(s, Pasta) else "act"
        try:
            return replace(s, heads=shipped_profile(kind, self.model.name))
        except ValueError:
            if kind != "pasta":
                raise
        warnings.warn(
            f'no shipped PASTA profile for {self.model.name}: heads "auto" falls back to the span '
            f"heuristic (top {AUTO_SPAN_TOP_K} heads by attention on the span)",
            UserWarning,
            stacklevel=2,
        )
        if not any(enc.spans):
            raise HeadsteerValueError(
                "PASTA needs an emphasized span: mark it with **...** or pass emphasize"
            )
        scores = span_attention(self.model, request.prompt, emphasize=request.emphasize, chat=request.chat)
        return replace(s, heads=scores.top(AUTO_SPAN_TOP_K))

    def prepare(self, request: ServeRequest) -> Prepared:
        """Validate `request` alone: encode it, resolve "auto" heads, build its edits once.

        Raises:
            ValueError: bad prompt or span, unknown heads, a method that needs a span
                without one, a prompt longer than `max_prompt_tokens`, prompt + max_tokens
                beyond the model's positions, or an attention edit on a sliding-window layer
                that the decoding would reach (`steer.kv_window.check_window_room`).
        """
        enc = encode_prompts(
            self.model.tokenizer, request.prompt, emphasize=request.emphasize, chat=request.chat
        )
        if enc.batch != 1:
            raise HeadsteerValueError("one prompt per request")
        if self.max_prompt_tokens is not None and enc.length > self.max_prompt_tokens:
            raise HeadsteerValueError(
                f"the prompt has {enc.length} tokens, more than this server's limit of "
                f"{self.max_prompt_tokens} (--max-prompt-tokens)"
            )
        check_new_tokens(self.model, enc.length, request.params.max_tokens, "max_tokens")
        steer = [self._resolve_auto(s, enc, request) for s in request.steer]
        validate_edits(self.model, [e for s in steer for e in s.edits(self.model, enc)])  # as editing() will
        check_window_room(self.model, enc, steer, request.params.max_tokens, "max_tokens")  # not part-way
        seed = request.params.seed
        if seed is None:
            seed = fresh_seed()
        return Prepared(request, enc, steer, seed)

    def _stack(self, items: Sequence[Prepared]) -> EncodedPrompts:
        """Left-pad the requests' encodings into one batch (spans shifted by the padding)."""
        width = max(p.enc.length for p in items)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        spans = []
        for b, p in enumerate(items):
            pad = width - p.enc.length
            ids[b, pad:] = p.enc.input_ids[0]
            mask[b, pad:] = p.enc.attention_mask[0]
            spans.append([(t0 + pad, t1 + pad) for t0, t1 in p.enc.spans[0]])
        texts = [p.enc.texts[0] for p in items]
        return EncodedPrompts(ids, mask, spans, texts, [p.enc.char_spans[0] for p in items])

    def _edits(self, items: Sequence[Prepared], width: int) -> list[Edit]:
        """Every request's edits, each seeing only its own batch row; one wrapper per (layer, kind).

        A request's interventions build their edits on its own one-row encoding, left-padded
        to the batch width `width`, so they see exactly the row (and absolute positions) they
        run on, and the cost per layer stays one pass over the batch.
        """
        groups: dict[tuple[int, type, int], _RowWrapper] = {}
        for b, p in enumerate(items):
            enc = _pad_to(p.enc, width, self.pad_id)
            for s in p.steer:
                for e in s.edits(self.model, enc):
                    if e.is_identity():
                        continue
                    kind = _wrapper(e)
                    # a span-share wrapper holds one edit per row: a second one on a row opens another
                    slot = 0
                    while kind is _RowSpans and any(
                        row == b for row, _ in getattr(groups.get((e.layer, kind, slot)), "members", ())
                    ):
                        slot += 1
                    key = (e.layer, kind, slot)
                    if key not in groups:
                        groups[key] = kind(layer=e.layer)
                    groups[key].members.append((b, e))
        for w in groups.values():
            if isinstance(w, _RowBias):  # broadcast like the members (`[B, 1, 1, K]` for PASTA)
                w.per_column = all(e.per_column for _, e in w.members)  # type: ignore[misc]
        return list(groups.values())

    @staticmethod
    def _pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
        """Next token of one row from logits `[V]`, numerically safe over the whole documented range.

        Works in float64 on `(logits - max) / temperature`, so the top token's term is exactly
        `exp(0) = 1` at any temperature in (0, 2]: a tiny temperature (1e-45, the smallest
        double) is greedy rather than `inf / inf`; the top token is always kept by `top_p`
        (a tiny top_p keeps just it). Non-finite logits fall back to greedy on the finite ones.
        """
        x = logits.double()
        if not bool(torch.isfinite(x).all()):
            x = torch.nan_to_num(x, nan=-math.inf, posinf=torch.finfo(x.dtype).max)
        if params.temperature == 0 or not bool(torch.isfinite(x.max())):
            return int(torch.argmax(x))
        probs = torch.softmax((x - x.max()) / params.temperature, dim=-1)
        if params.top_p < 1:
            sp, idx = torch.sort(probs, descending=True)
            keep = (sp.cumsum(0) - sp) < params.top_p  # the smallest prefix reaching top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sp[keep])
        return draw(probs, gen)

    @torch.no_grad()
    def run(
        self,
        items: Sequence[Prepared],
        on_delta: Callable[[int, str], None] | None = None,
        cancelled: Callable[[int], bool] | None = None,
    ) -> list[Completion | Exception]:
        """Decode prepared requests as one batch (KV cache, per-row steering and sampling).

        Args:
            items: requests from `prepare`.
            on_delta: called as `on_delta(row, text)` from this thread with each new piece
                of a row's text (held back while it may be the start of a stop string).
            cancelled: `cancelled(row)` is asked before every step; a row for which it is
                True stops decoding at once (its client went away) and gets `RequestCancelled`.

        Returns:
            one `Completion` per item, in order, or the exception that ended that row alone
            (its sampling or its `on_delta` failed; the other rows go on). An error of the
            whole forward pass raises.
        """
        from transformers import DynamicCache

        hm = self.model
        enc = self._stack(items)
        n = enc.batch
        params = [p.request.params for p in items]
        # each row its own generator (steer.sampling); a rerun of the same request draws the same tokens
        seeds = [p.seed if p.seed is not None else p.request.params.seed for p in items]
        gens = [row_generator(fresh_seed() if s is None else s) for s in seeds]
        errors: dict[int, Exception] = {}
        tokens: list[list[int]] = [[] for _ in range(n)]
        texts = [""] * n
        sent = [0] * n
        reason: list[str | None] = [None] * n
        hold = [max((len(s) for s in prm.stop), default=1) - 1 for prm in params]
        device = hm.device
        mask = enc.attention_mask.to(device)
        pos = position_ids(enc.attention_mask).to(device)
        ids = enc.input_ids.to(device)
        cache = DynamicCache(config=hm.model.config)
        with editing(hm, self._edits(items, enc.length), require_fired=False):
            for _step in range(max(p.max_tokens for p in params)):
                out = hm.run(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=pos,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                logits = out.logits[:, -1].float().cpu()
                nxt = []
                for b in range(n):
                    if reason[b] is None and cancelled is not None and cancelled(b):
                        reason[b] = "cancelled"
                        errors[b] = RequestCancelled(completion_tokens=len(tokens[b]))
                    if reason[b] is not None:
                        nxt.append(self.pad_id)
                        continue
                    try:
                        t = self._pick(logits[b], params[b], gens[b])
                        tokens[b].append(t)
                        self._advance(b, t, tokens, texts, reason, params[b])
                        if on_delta is not None:
                            end = len(texts[b]) if reason[b] is not None else len(texts[b]) - hold[b]
                            while end > sent[b] and texts[b][end - 1] == "\ufffd":  # incomplete UTF-8
                                end -= 1
                            if end > sent[b]:
                                on_delta(b, texts[b][sent[b] : end])
                                sent[b] = end
                    except Exception as exc:  # noqa: BLE001 - this row's failure is this row's alone
                        reason[b] = "error"
                        errors[b] = exc
                        t = self.pad_id
                    nxt.append(t)
                if all(r is not None for r in reason):
                    break
                ids = torch.tensor(nxt, dtype=torch.long, device=device)[:, None]
                mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
                pos = pos[:, -1:] + 1
        return [
            errors[b]
            if b in errors
            else Completion(
                texts[b], tokens[b], reason[b] or "length", int(items[b].enc.attention_mask.sum())
            )
            for b in range(n)
        ]

    def _advance(self, b, t, tokens, texts, reason, prm: SamplingParams) -> None:
        """Update row b's text after token t; set its finish reason on EOS, stop or length."""
        tok = cast("PreTrainedTokenizerBase", self.model.tokenizer)  # checked in __init__
        if t in self.eos_ids:
            reason[b] = "stop"
            return
        text = cast(str, tok.decode(tokens[b], skip_special_tokens=True))  # one sequence -> one str
        cut = min((i for i in (text.find(s) for s in prm.stop) if i >= 0), default=-1)
        if cut >= 0:
            texts[b] = text[:cut]
            reason[b] = "stop"
            return
        texts[b] = text
        if len(tokens[b]) >= prm.max_tokens:
            reason[b] = "length"


class Job:
    """A queued request (from `Batcher.submit`); `cancel()` stops its row as soon as possible."""

    __slots__ = ("prepared", "on_delta", "on_done", "_cancelled")

    def __init__(self, prepared, on_delta, on_done):
        self.prepared, self.on_delta, self.on_done = prepared, on_delta, on_done
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Its client went away: drop it from the queue, or stop its row before the next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class Batcher:
    """Dynamic batching: one worker thread runs the queued requests in batches.

    Args:
        generator: the `BatchGenerator`.
        max_batch: most requests per batch (default 32).
        wait_s: after the first request arrives, wait this long for more (default 0.02 s).
        max_queue: most requests waiting; `submit` raises `queue.Full` beyond it (default 256).

    `submit(prepared, on_delta, on_done)` queues a request and returns its `Job`; `on_delta(text)`
    gets its text pieces and `on_done(completion_or_exception)` its end, both from the worker
    thread. `Job.cancel()` (a client that went away) ends that row alone with `RequestCancelled`.
    One request's failure is that request's alone: a row whose sampling fails ends with its
    error while the batch goes on, and a batch whose forward pass fails is rerun one request
    at a time (a streamed request resumes after the text it already sent), so only the
    offender gets the error. `close()` stops taking requests, finishes the queued ones and
    joins the thread.
    """

    def __init__(
        self, generator: BatchGenerator, *, max_batch: int = 32, wait_s: float = 0.02, max_queue: int = 256
    ):
        if max_batch < 1 or wait_s < 0:
            raise HeadsteerValueError(f"max_batch must be >= 1 and wait_s >= 0, got {max_batch}, {wait_s}")
        self.generator = generator
        self.max_batch = max_batch
        self.wait_s = wait_s
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._closing = threading.Event()
        self.batches: list[int] = []  # sizes of the batches run (for tests and benchmarks)
        self._thread = threading.Thread(target=self._loop, name="headsteer-batcher", daemon=True)
        self._thread.start()

    def submit(self, prepared: Prepared, on_delta: Callable[[str], None] | None, on_done: Callable) -> Job:
        """Queue a prepared request; returns its `Job` (to `cancel()` it).

        Raises:
            RuntimeError: the batcher is closing.
            queue.Full: too many requests waiting.
        """
        if self._closing.is_set():
            raise RuntimeError("the server is shutting down")
        job = Job(prepared, on_delta, on_done)
        self._queue.put_nowait(job)
        return job

    def _take(self) -> list[Job]:
        try:
            first = self._queue.get(timeout=0.1)
        except queue.Empty:
            return []
        jobs = [first]
        deadline = time.monotonic() + self.wait_s
        while len(jobs) < self.max_batch:
            left = deadline - time.monotonic()
            try:
                jobs.append(self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait())
            except queue.Empty:
                break
        return jobs

    def _run(self, jobs: list[Job], sent: list[str] | None = None) -> list:
        """Run `jobs` as one batch; the result or the exception of each, in order.

        `sent[i]`: text job i already streamed (a rerun skips it, and fails that job alone if
        its new text does not start with it).
        """
        self.batches.append(len(jobs))
        sent = [""] * len(jobs) if sent is None else sent
        fresh = [""] * len(jobs)  # text of this run, per row

        def delta(row: int, text: str) -> None:
            cb = jobs[row].on_delta
            if cb is None:
                return
            before = len(fresh[row])
            fresh[row] += text
            old = sent[row]
            if len(fresh[row]) <= len(old):
                if not old.startswith(fresh[row]):
                    raise RuntimeError("the rerun of this request diverged from the text already sent")
                return
            if not fresh[row].startswith(old):
                raise RuntimeError("the rerun of this request diverged from the text already sent")
            new = fresh[row][max(before, len(old)) :]
            sent[row] = fresh[row]
            try:
                cb(new)
            except Exception:  # noqa: BLE001 - a vanished client ends its own row only
                jobs[row].cancel()

        try:
            return self.generator.run(
                [j.prepared for j in jobs], delta, cancelled=lambda row: jobs[row].cancelled
            )
        except Exception as exc:  # noqa: BLE001 - every waiting request must hear of it
            if len(jobs) == 1:
                return [exc]
        # One request's failure must not take the others down: rerun each alone.
        return [self._run([j], [sent[i]])[0] for i, j in enumerate(jobs)]

    def _loop(self) -> None:
        while not (self._closing.is_set() and self._queue.empty()):
            jobs = self._take()
            gone = [j for j in jobs if j.cancelled]
            jobs = [j for j in jobs if not j.cancelled]
            results = self._run(jobs) if jobs else []
            for j, r in [
                *((j, RequestCancelled()) for j in gone),
                *zip(jobs, results, strict=True),
            ]:
                try:
                    j.on_done(r)
                except Exception:  # noqa: BLE001, S110 - a vanished client must not stop the worker
                    pass

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting requests, finish the queued ones, join the worker."""
        self._closing.set()
        self._thread.join(timeout)
