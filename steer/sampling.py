"""Seeded sampling per batch row: each row draws from its own `torch.Generator`.

A request (the server's `BatchGenerator`) or a prompt (`SteeredModel.generate(seed=...)`) that
carries a seed gets a CPU generator seeded with it, and every token of that row is drawn from
that generator alone. So the same prompt and seed give the same tokens alone, at any position
of any batch, and from any thread (up to float round-off between batch shapes), and seeded
sampling never reads nor moves torch's global generator (`torch.manual_seed` would make a
row's sample depend on what else runs in the process).

`SeededSampler` puts this inside `transformers`' `generate`: it applies the sampling warpers
(temperature, top-k, top-p, ...) in the order `transformers` applies them, draws each row's
token with the row's generator, and hands `generate` a distribution with all its mass on that
token, which `generate` then takes greedily (so its own draw from torch's global generator
never happens).
"""

from __future__ import annotations

import copy
import secrets
from typing import TYPE_CHECKING, Any

import torch

from heads.errors import HeadsteerValueError

if TYPE_CHECKING:  # pragma: no cover
    from transformers import GenerationConfig, LogitsProcessor

__all__ = ["SeededSampler", "draw", "fresh_seed", "row_generator", "seeded_generate_kwargs"]

_WARPER_KEYS = (
    "temperature",
    "top_h",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
)
"""The `generate` options `transformers` turns into sampling warpers, in the order it applies
them (`GenerationMixin._get_logits_processor`, transformers 5.x)."""


def fresh_seed() -> int:
    """A new random seed in 0..2**62-1 for a request that gave none, from the operating system
    (`secrets`), so drawing it neither reads nor moves torch's global generator."""
    return secrets.randbits(62)


def row_generator(seed: int) -> torch.Generator:
    """A CPU `torch.Generator` seeded with `seed` (an int in 0..2**63-1, checked by the caller):
    one per batch row. CPU, so a seed draws the same tokens on every device."""
    return torch.Generator().manual_seed(seed)


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token id drawn from `probs` `[V]` (non-negative, any device and float dtype, need not
    sum to 1) with `gen` (from `row_generator`): `torch.multinomial` on the CPU copy."""
    return int(torch.multinomial(probs.detach().cpu(), 1, generator=gen))


def _warpers(cfg: GenerationConfig) -> list[LogitsProcessor]:
    """The sampling warpers `transformers`' `generate` would build from `cfg` (one row per beam:
    `min_tokens_to_keep=1`), in its order."""
    from transformers.generation import logits_process as lp

    out: list[LogitsProcessor] = []
    if cfg.temperature is not None and cfg.temperature != 1.0:
        out.append(lp.TemperatureLogitsWarper(cfg.temperature))
    if cfg.top_h is not None:
        out.append(lp.TopHLogitsWarper(top_h=cfg.top_h))
    if cfg.top_k is not None and cfg.top_k != 0:
        out.append(lp.TopKLogitsWarper(top_k=cfg.top_k, min_tokens_to_keep=1))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        out.append(lp.TopPLogitsWarper(top_p=cfg.top_p, min_tokens_to_keep=1))
    if cfg.min_p is not None:
        out.append(lp.MinPLogitsWarper(min_p=cfg.min_p, min_tokens_to_keep=1))
    if cfg.typical_p is not None and cfg.typical_p < 1.0:
        out.append(lp.TypicalLogitsWarper(mass=cfg.typical_p, min_tokens_to_keep=1))
    if cfg.epsilon_cutoff is not None and 0.0 < cfg.epsilon_cutoff < 1.0:
        out.append(lp.EpsilonLogitsWarper(epsilon=cfg.epsilon_cutoff, min_tokens_to_keep=1))
    if cfg.eta_cutoff is not None and 0.0 < cfg.eta_cutoff < 1.0:
        out.append(lp.EtaLogitsWarper(epsilon=cfg.eta_cutoff, min_tokens_to_keep=1))
    return out


class SeededSampler:
    """A `transformers` logits processor, last in the list: warps each row's scores as
    `generate` would, draws the row's next token with the row's own generator, and returns
    scores that are `-inf` everywhere but that token (0 there).

    Attributes:
        scores: the warped scores `[B, V]` of each step (what `generate(output_scores=True)`
            reports without this sampler), in step order.
    """

    def __init__(self, seeds: list[int], warpers: list[LogitsProcessor]) -> None:
        self.gens = [row_generator(s) for s in seeds]
        self.warpers = warpers
        self.scores: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for w in self.warpers:
            scores = w(input_ids, scores)
        self.scores.append(scores)
        probs = torch.softmax(scores.float(), dim=-1)
        picked = torch.full_like(scores, -torch.inf)
        for b, gen in enumerate(self.gens):
            picked[b, draw(probs[b], gen)] = 0.0
        return picked


def seeded_generate_kwargs(
    generation_config: GenerationConfig, generate_kwargs: dict[str, Any], seed: int, batch: int
) -> tuple[dict[str, Any], SeededSampler]:
    """`generate_kwargs` for sampling with one generator per row, each seeded with `seed`.

    Args:
        generation_config: the model's default generation config (`model.generation_config`);
            a `generation_config=` in `generate_kwargs` replaces it, as in `generate`.
        generate_kwargs: the caller's `generate` options (not modified).
        seed: each row's seed (checked by the caller).
        batch: the number of rows.

    Returns:
        the options to pass to `generate` (the warpers moved into a `SeededSampler` placed last
        in `logits_processor`, their options set to None, `do_sample=False`: `generate` takes
        the sampler's pick greedily), and that sampler.

    Raises:
        HeadsteerValueError: options under which `generate` would not sample one token per row
            from the processed scores (assisted or speculative decoding, beam sampling), or a
            watermark (it must see the scores after the warpers, before the draw).
    """
    from transformers import LogitsProcessorList
    from transformers.generation import GenerationMode

    kwargs = dict(generate_kwargs)
    given = kwargs.pop("generation_config", None)
    cfg = copy.deepcopy(given or generation_config)
    if given is not None:  # as `generate`: the model's defaults fill what the given config leaves unset
        cfg.update(**generation_config.to_dict(), defaults_only=True)
    cfg.update(**{k: v for k, v in kwargs.items() if hasattr(cfg, k)}, do_sample=True)
    mode = cfg.get_generation_mode(kwargs.get("assistant_model"))
    if mode != GenerationMode.SAMPLE:
        raise HeadsteerValueError(
            f"seed= draws each row's tokens with its own generator in plain sampling only; "
            f"these options select {mode.value!r} decoding"
        )
    if cfg.watermarking_config is not None:
        raise HeadsteerValueError("seed= cannot be combined with watermarking_config=")
    sampler = SeededSampler([seed] * batch, _warpers(cfg))
    procs = list(kwargs.pop("logits_processor", None) or [])
    kwargs["logits_processor"] = LogitsProcessorList([*procs, sampler])
    kwargs.update(dict.fromkeys(_WARPER_KEYS))
    kwargs["do_sample"] = False  # `generate` takes the sampler's pick as its argmax: no global draw
    if "generation_config" in generate_kwargs:
        kwargs["generation_config"] = generate_kwargs["generation_config"]
    return kwargs, sampler
