"""The explorer's server-side state: the model, its lock, the jobs and the caches.

One `ExplorerState` per app (`app.state.explorer`), shared by the routes. What it keeps
describes the model or a prompt's deterministic scores, never a tab's choices (each request
carries those): the head atlas, MAPS and probe scores (once per server), the DLA / Ships grids
per prompt, the head cards per prompt and head, and each tab's recorded patterns.
"""

import json
import math
import threading
from collections import OrderedDict
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from heads.errors import HeadsteerValueError
from viz.explorer.jobs import Jobs
from viz.explorer.limits import (
    CARD_CACHE,
    MAX_PATTERN_TOKENS,
    MAX_SOURCES_BYTES,
    MAX_WINDOW,
    OVERVIEW_CACHE_BYTES,
    SCORE_CACHE_PROMPTS,
)
from viz.explorer.patterns import PatternCache, Patterns, pattern_bytes
from viz.explorer.scores import Cancelled, grid

if TYPE_CHECKING:
    from heads.inputs.prompts import EncodedPrompts
    from heads.model.adapter import HeadModel
    from viz.explorer.overview import Overview

__all__ = ["ExplorerState", "Lru", "shipped_heads"]


def shipped_heads(model_name: str) -> list[list[int]]:
    """The shipped PASTA profile of the embedded model as [layer, head] pairs ([] for other models)."""
    try:
        from steer.profiles import shipped_profile

        data = json.loads(Path(shipped_profile("pasta", model_name)).read_text())
    except (ValueError, OSError):
        return []
    return [[int(layer), int(h)] for layer, hs in data.items() for h in hs]


class Lru:
    """A small thread-safe least-recently-used map (at most `size` entries)."""

    def __init__(self, size: int):
        self.size = size
        self._d: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            if key not in self._d:
                return None
            self._d.move_to_end(key)
            return self._d[key]

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._d[key] = value
            self._d.move_to_end(key)
            while len(self._d) > self.size:
                self._d.popitem(last=False)


class ExplorerState:
    """Everything the explorer's routes share.

    Args:
        model: the `HeadModel` (with a tokenizer).
        atlas: a `HeadAtlas` of this model, or None (computed on demand).
        pattern_cache_bytes: byte budget of the per-tab pattern cache (0: off).
        full_pattern_tokens: longest prompt whose whole `[T, T]` patterns are sent (default
            `MAX_PATTERN_TOKENS`); a longer one gets the overview and windows.
        overview_cache_bytes: byte budget of the per-tab overview cache (0: off).

    Attributes:
        lock: the model lock: one job runs the model at a time (the engine's edits are per
            thread, but the caches and the model's memory are not meant for two forwards).
        jobs: the `Jobs` registry (limit, cancel flags, superseded requests, stopping).
        cache: `atlas`, `maps`, `probes`, `sources` (MAPS' vocabulary sources) once computed.
    """

    def __init__(
        self,
        model: "HeadModel",
        atlas: Any,
        pattern_cache_bytes: int,
        *,
        full_pattern_tokens: int = MAX_PATTERN_TOKENS,
        overview_cache_bytes: int = OVERVIEW_CACHE_BYTES,
    ):
        from steer.steered_model import SteeredModel

        if model.tokenizer is None:
            raise HeadsteerValueError("the explorer needs a HeadModel with a tokenizer")
        if atlas is not None and len(atlas.frame) != model.n_layers * model.n_heads:
            raise HeadsteerValueError(
                f"the atlas has {len(atlas.frame)} heads, the model {model.n_layers * model.n_heads}"
            )
        self.model = model
        self.lock = threading.Lock()
        self.jobs = Jobs()
        self.steered_model = SteeredModel(model)
        self.page = resources.files("viz.explorer").joinpath("page.html").read_text(encoding="utf-8")
        self.shipped = shipped_heads(model.name)
        self.cache: dict[str, Any] = {"atlas": atlas, "maps": None, "probes": None, "sources": None}
        self.prompt_scores = Lru(SCORE_CACHE_PROMPTS * 2)  # (kind, prompt, chat) -> "dla" / "ships" result
        self.cards = Lru(CARD_CACHE)  # ("lens", text, layer, head) / ("maps", layer, head) -> card parts
        self.patterns: PatternCache[Patterns] = PatternCache(pattern_cache_bytes)
        self.full_pattern_tokens = full_pattern_tokens
        self.overviews: PatternCache[Overview] = PatternCache(overview_cache_bytes)
        self.plotly_gz: bytes | None = None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.model.tokenizer, "chat_template", None))

    def chat(self, raw: bool | None) -> bool:
        """Whether a prompt is rendered with the chat template: not when `raw`, and never without
        a template (`raw` None: the model's default)."""
        return self.has_chat_template and not raw

    def encoded(self, prompt: str, chat: bool, new_tokens: int = 0) -> "EncodedPrompts":
        """The prompt encoded as every endpoint runs it, refused (400) before any job when it does
        not fit the model's positions (`HeadModel.max_positions`), or not with `new_tokens` more."""
        from heads.inputs.prompts import encode_prompts
        from steer.steered_model import check_new_tokens

        enc = encode_prompts(self.model.tokenizer, prompt, chat=chat)
        limit = self.model.max_positions
        if limit is not None and enc.length > limit:
            raise HeadsteerValueError(
                f"the prompt has {enc.length} tokens, more than the model's limit of {limit} positions"
            )
        check_new_tokens(self.model, enc.length, new_tokens, "max_new_tokens")
        return enc

    def is_long(self, n_tokens: int) -> bool:
        """Whether a prompt of `n_tokens` tokens gets the overview (more than `full_pattern_tokens`)."""
        return n_tokens > self.full_pattern_tokens

    def record_overview(self, prompt: str, tab: str, chat: bool, flag: threading.Event) -> "Overview":
        """The prompt's overview (one forward, stopped at the next query block once `flag` is set),
        kept for the tab; call under the model lock, inside a job."""
        from viz.explorer import overview

        got = self.overviews.get(tab, prompt, chat=chat)  # another job may have recorded it meanwhile
        if got is None:
            enc = self.encoded(prompt, chat)
            got = overview.record_overview(self.model, enc, stop=flag)
            self.overviews.put(tab, prompt, got, chat=chat)
        return got

    @staticmethod
    def check_window(window: tuple[int, int, int, int], n_tokens: int) -> None:
        """HTTP 400 naming the value when a window `(q0, q1, k0, k1)` is not inside the prompt's
        `n_tokens` positions or passes `MAX_WINDOW` rows or columns."""
        q0, q1, k0, k1 = window
        for lo, hi, a, b in ((q0, q1, "q0", "q1"), (k0, k1, "k0", "k1")):
            if hi > n_tokens:
                raise HeadsteerValueError(
                    f"{b}={hi} is past the prompt's {n_tokens} tokens (at most {n_tokens})"
                )
            if lo >= hi:
                raise HeadsteerValueError(f"{a}={lo} must be below {b}={hi}")
            if hi - lo > MAX_WINDOW:
                what = "rows" if a == "q0" else "columns"
                raise HeadsteerValueError(
                    f"{b}-{a}={hi - lo} is more than the window limit of {MAX_WINDOW} {what}"
                )

    def patterns_fit(self, enc: "EncodedPrompts") -> bool:
        """Whether the prompt's `[L, H, T, T]` patterns fit the pattern cache."""
        n = int(enc.attention_mask.sum())
        return self.patterns.fits(pattern_bytes(self.model.n_layers, self.model.n_heads, n))

    def record_patterns(self, prompt: str, tab: str, chat: bool, flag: threading.Event) -> Patterns:
        """Every head's pattern on the prompt (one forward, stopped at the next layer once `flag`
        is set), kept for the tab; call under the model lock, inside a job."""
        from viz.explorer import patterns

        got = self.patterns.get(tab, prompt, chat=chat)  # another job may have recorded it meanwhile
        if got is None:
            got = patterns.all_patterns(self.model, prompt, chat=chat, stop=flag)
            self.patterns.put(tab, prompt, got, chat=chat)
        return got

    def head_scores(self, prompt: str, chat: bool, layer: int, head: int) -> dict[str, float | None]:
        """The head's value in every score already computed (for this prompt where it depends on
        the prompt), read from the caches: nothing is computed here."""
        got: dict[str, float | None] = {}
        for kind in ("dla", "ships"):
            res = self.prompt_scores.get((kind, prompt, chat))
            if res is not None:
                got[kind] = res["scores"][layer][head]
        if self.cache["maps"] is not None:
            got["maps"] = grid(self.cache["maps"].best_relation()[0].scores)[layer][head]
        if self.cache["probes"] is not None:
            got["probes"] = grid(self.cache["probes"].accuracy.scores)[layer][head]
        return got

    def sources_of(self, layer: int) -> Any:
        """Ẽ of the whole vocabulary for MAPS' salient operations, kept once for every layer
        above 0 when it fits `MAX_SOURCES_BYTES` (it is most of a card's first cost); call
        under the lock."""
        from heads.scorers.maps.static import vocabulary_sources

        model = self.model
        if layer == 0 or model.d_vocab * model.d_model * 4 > MAX_SOURCES_BYTES:
            return None
        if self.cache.get("sources") is None:
            self.cache["sources"] = vocabulary_sources(model, layer)
        return self.cache["sources"]

    def card_parts(self, text: str, layer: int, head: int, flag: threading.Event) -> tuple[dict, list | None]:
        """The head card's logit-lens part and MAPS part (`None` when MAPS' source representation
        is not defined for this family), each computed once and kept; call under the lock."""
        from heads.scorers.maps.static import salient_operations
        from heads.scorers.roles.lens import AttentionLens

        lens_key, maps_key = ("lens", text, layer, head), ("maps", layer, head)
        lens_part, maps_part = self.cards.get(lens_key), self.cards.get(maps_key)
        if lens_part is None:
            top = AttentionLens.init(self.model, [(layer, head)]).top_tokens(
                self.model, text, layer, head, k=5
            )
            lens_part = {
                "lens_tokens": list(top["untrained_tokens"].iloc[-1]),
                "model_tokens": list(top["model_tokens"].iloc[-1]),
            }
            self.cards.put(lens_key, lens_part)
        if maps_part is None and self.maps_refusal() is None:
            if flag.is_set():
                raise Cancelled
            ops = salient_operations(self.model, layer, head, k_s=5, k_m=3, sources=self.sources_of(layer))
            maps_part = [
                {"source": str(s), "targets": [str(t) for t in ts]}
                for s, ts in zip(ops["source"], ops["targets"], strict=True)
            ]
            self.cards.put(maps_key, maps_part)
        return lens_part, maps_part

    def maps_refusal(self) -> str | None:
        """Why MAPS' first-MLP source representation (the MAPS score, its card part, the atlas'
        copying and successor detectors) is not defined for this model, or None when it is."""
        if "maps_refusal" not in self.cache:
            import torch

            from heads.scorers.maps.static import first_mlp

            try:  # refuses by family before it computes; else one row through layer 0's MLP
                first_mlp(self.model, torch.zeros(1, self.model.d_model, dtype=self.model.dtype))
                self.cache["maps_refusal"] = None
            except ValueError as exc:
                self.cache["maps_refusal"] = " ".join(str(exc).split())
        refusal: str | None = self.cache["maps_refusal"]
        return refusal

    def atlas_row(self, layer: int, head: int) -> dict[str, Any] | None:
        """The head's atlas row (role and scores, 5 decimals, NaN as None) once the atlas is known."""
        if self.cache["atlas"] is None:
            return None
        f = self.cache["atlas"].frame
        row = f[(f["layer"] == layer) & (f["head"] == head)].iloc[0]
        return {
            k: (str(v) if isinstance(v, str) else (round(float(v), 5) if math.isfinite(float(v)) else None))
            for k, v in row.items()
            if k not in ("layer", "head", "kv_head")
        }
