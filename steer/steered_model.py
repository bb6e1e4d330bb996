"""`SteeredModel`: generation with any list of interventions, batched, with KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from heads._util.progress import Progress, ProgressArg, progress_callback
from heads._util.validation import check_int, short_repr
from heads.engine.context import editing
from heads.engine.edits import Edit
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.images import encode_image_prompts
from heads.inputs.prompts import Emphasis, EncodedPrompts, Prompt, encode_prompts
from heads.model.adapter import HeadModel
from steer.sampling import seeded_generate_kwargs

if TYPE_CHECKING:  # pragma: no cover
    from transformers import GenerationConfig, PreTrainedTokenizerBase

__all__ = ["BAR_DELAY_S", "BAR_MIN_PROMPTS", "Generation", "Intervention", "SteeredModel", "check_new_tokens"]

BAR_MIN_PROMPTS = 8
"""`generate(progress=True)` draws its bar at once for more prompts than this; for fewer, only
once the call has run `BAR_DELAY_S` seconds (a short call stays quiet, a long one still shows)."""

BAR_DELAY_S = 5.0


def _step_progress(report: Progress, start: int, total: int):
    """A `transformers` stopping criterion that never stops and reports new tokens per row."""
    from transformers import StoppingCriteria

    class _Steps(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
            report(min(input_ids.shape[1] - start, total), total)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return _Steps()


def check_new_tokens(hm: HeadModel, prompt_tokens: int, new_tokens: int, name: str) -> None:
    """HeadsteerValueError naming `name` (`max_new_tokens`, or the server's `max_tokens`) when
    the prompt's `prompt_tokens` plus `new_tokens` exceed the model's positions."""
    limit = hm.max_positions
    if limit is not None and prompt_tokens + new_tokens > limit:
        raise HeadsteerValueError(
            f"{name}={short_repr(new_tokens)} with the prompt's {prompt_tokens} tokens exceeds the "
            f"model's limit of {limit} positions (at most {max(limit - prompt_tokens, 0)} new tokens here)"
        )


class Intervention(Protocol):
    """Anything that turns an encoded batch into engine edits (e.g. `Pasta`)."""

    def edits(self, model: HeadModel, enc: EncodedPrompts) -> Sequence[Edit]: ...


class _GenerativeLM(Protocol):
    """What `SteeredModel.generate` uses of `HeadModel.model` (a `transformers` causal LM)."""

    generation_config: GenerationConfig

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...


@dataclass
class Generation:
    """Result of `SteeredModel.generate`.

    Attributes:
        texts: the generated continuations, decoded without special tokens.
        token_ids: the generated token ids per prompt (up to and including EOS).
        prompts: the rendered prompts (after chat template, without markup).
        spans: emphasized token ranges per prompt, in padded coordinates.
        steer: the interventions applied.
        outputs: with `return_dict_in_generate=True`, the `transformers` generate output
            (`sequences`, and `scores`, `attentions`, ... as requested; attentions are the
            edited patterns, see `heads.editing`); else None.
        image_spans: image-feature token ranges per prompt, in padded coordinates
            (empty lists for text prompts).
    """

    texts: list[str]
    token_ids: list[list[int]]
    prompts: list[str]
    spans: list[list[tuple[int, int]]]
    steer: list[Intervention] = field(default_factory=list)
    outputs: object | None = None
    image_spans: list[list[tuple[int, int]]] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The first (or only) continuation."""
        return self.texts[0]

    def __len__(self) -> int:
        return len(self.texts)

    def _repr_html_(self) -> str:
        """Jupyter view: each prompt's continuation."""
        import html

        rows = "".join(
            f"<tr><td><pre style='white-space:pre-wrap'>{html.escape(p[-300:])}</pre></td>"
            f"<td><pre style='white-space:pre-wrap'>{html.escape(t)}</pre></td></tr>"
            for p, t in zip(self.prompts, self.texts, strict=True)
        )
        return f"<table><tr><th>prompt (end)</th><th>generated</th></tr>{rows}</table>"


_UNSUPPORTED = ("num_return_sequences", "num_beams", "input_ids", "attention_mask")
_RUNS_CODE = ("custom_generate", "trust_remote_code")
"""`transformers.generate` options that load and run Python from a folder or the Hub: refused."""


class SteeredModel:
    """Inference wrapper: `generate` with steering interventions.

    Args:
        model: a `HeadModel` (from `heads.load_model`) with a tokenizer.

    Decoding rule: every intervention acts at prefill on all prompt rows and at
    every decode step on the new row; key columns and edit positions are absolute
    positions of the left-padded sequence, so prompt columns `< P` keep their edits
    and generated columns follow each method's spec (PASTA never scales them). With
    `use_cache=False` every step re-runs the whole sequence with the same absolute
    positions, so PASTA, ACT and positioned head edits generate the same tokens as
    with the cache (SpotLight at layer/head granularity pools differently by design).
    """

    def __init__(self, model: HeadModel):
        if not isinstance(model, HeadModel):
            raise HeadsteerTypeError(
                f"SteeredModel needs a HeadModel (heads.load_model), got {type(model).__name__}"
            )
        if model.tokenizer is None:
            raise HeadsteerValueError("SteeredModel needs a HeadModel with a tokenizer")
        self.model = model

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        images: object = None,
        emphasize: Emphasis = None,
        chat: bool | None = None,
        markup: bool = True,
    ) -> EncodedPrompts:
        """Render, tokenize and left-pad prompts (see `heads.encode_prompts`).

        On a vision-language model (one with a `processor`) prompts go through its
        processor with `images` (see `heads.inputs.images.encode_image_prompts`).

        Raises:
            ValueError: `images` given to a model without a processor; see the encoders.
        """
        if getattr(self.model, "processor", None) is not None:
            return encode_image_prompts(
                self.model, prompts, images, emphasize=emphasize, chat=chat, markup=markup
            )
        if images is not None:
            raise HeadsteerValueError(
                f"images given, but {short_repr(self.model.name)} is not a vision-language model (no "
                "processor)"
            )
        return encode_prompts(self.model.tokenizer, prompts, emphasize=emphasize, chat=chat, markup=markup)

    @torch.no_grad()
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        steer: Intervention | Sequence[Intervention] | None = (),
        *,
        images: object = None,
        max_new_tokens: int = 64,
        do_sample: bool = False,
        emphasize: Emphasis = None,
        chat: bool | None = None,
        markup: bool = True,
        seed: int | None = None,
        require_fired: bool = True,
        progress: ProgressArg = True,
        **generate_kwargs: Any,
    ) -> Generation:
        """Generate continuations, steered by `steer`.

        Args:
            prompts: a string (with optional `**span**` markup), a chat (list of
                `{"role", "content"}` dicts), or a list of either (batched with left
                padding).
            steer: an intervention or a list, e.g. `[Pasta(heads=profile)]`; empty = unsteered.
                An intervention with `refine_images(model, prompts, images, chat=, emphasize=,
                markup=)` (e.g. `Carve`) first replaces the images; the batch is encoded again.
            images: for a vision-language model: one image (PIL), or one image / list of
                images / None per prompt. A prompt without the image placeholder gets
                one per image before its first user message (`heads.inputs.images`);
                `Pasta(..., spans="image")` emphasizes the image tokens.
            max_new_tokens: tokens to generate per prompt (default 64).
            do_sample: sample instead of greedy decoding (default False).
            emphasize: spans to emphasize besides markup (see `heads.encode_prompts`).
            chat: apply the chat template (default: when the tokenizer has one).
            markup: parse `**…**` markup (default True).
            seed: with `do_sample`, each prompt's tokens are drawn from its own generator
                seeded with `seed` (`steer.sampling`): the same prompt and seed give the same
                tokens alone, at any position of a batch, and from any thread (up to float
                round-off between batch shapes); torch's global generator is neither read nor
                moved. Default None: `transformers`' sampling from the global generator.
            require_fired: raise if an intervention's edit never ran (default True).
            progress: True (default: a tqdm bar, drawn at once for more than `BAR_MIN_PROMPTS`
                prompts, else once the call has run `BAR_DELAY_S` = 5 s), False / None (off)
                or `progress(done, total)` after each decoding step, in new tokens per row:
                `total` is `max_new_tokens` (`heads._util.progress`).
            **generate_kwargs: passed to `transformers`' `generate` (e.g. temperature,
                `use_cache=False`, or `return_dict_in_generate=True` with `output_attentions=True`
                / `output_scores=True`: the result is then in `Generation.outputs`).

        Returns:
            Generation with `texts` and `token_ids`.

        Raises:
            ValueError: bad prompts or spans, `max_new_tokens` < 1, prompt plus new tokens
                beyond the model's position limit, or an unsupported generate option
                (`num_return_sequences`, `num_beams`; with `seed` and `do_sample`, an option
                that is not plain sampling, e.g. `assistant_model`, or `watermarking_config`);
                `images` for a model without a
                processor, or not matching the prompts' image placeholders. During decoding:
                a steered step whose logits are not finite (NaN / inf: the steering overflowed
                the model's dtype), naming the step and the edits.
            TypeError: a steer item without `edits(model, enc)`.
        """
        check_int("max_new_tokens", max_new_tokens, lo=1)
        bad_seed = isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63
        if seed is not None and bad_seed:
            raise HeadsteerValueError(f"seed must be an int in 0..2**63-1 or None, got {short_repr(seed)}")
        for key in _UNSUPPORTED:
            if key in generate_kwargs:
                raise HeadsteerValueError(f"generate option {key}= is not supported by SteeredModel.generate")
        for key in _RUNS_CODE:
            if key in generate_kwargs:
                raise HeadsteerValueError(
                    f"generate option {key}= would load and run Python code from a folder or the Hub: "
                    "headsteer never runs a model's or a folder's own code"
                )
        if steer is None:
            steer = []
        elif callable(getattr(steer, "edits", None)):
            steer = [cast(Intervention, steer)]  # one intervention
        elif isinstance(steer, (str, bytes)) or not isinstance(steer, Sequence):
            raise HeadsteerTypeError(
                f"steer must be an intervention or a list of them, got {short_repr(steer)}"
            )
        steer = list(steer)
        for s in steer:
            if not callable(getattr(s, "edits", None)):
                raise HeadsteerTypeError(f"not an intervention (no .edits(model, enc)): {short_repr(s)}")
        hm = self.model
        tok = cast("PreTrainedTokenizerBase", hm.tokenizer)  # checked in __init__
        lm = cast(_GenerativeLM, hm.model)
        enc = self.encode(prompts, images=images, emphasize=emphasize, chat=chat, markup=markup)
        check_new_tokens(hm, enc.length, max_new_tokens, "max_new_tokens")
        for s in steer:  # input refinement (CARVE): answer on the images the method returns
            refine = getattr(s, "refine_images", None)
            if callable(refine):
                images = refine(hm, prompts, images, chat=chat, emphasize=emphasize, markup=markup)
                enc = self.encode(prompts, images=images, emphasize=emphasize, chat=chat, markup=markup)
                check_new_tokens(hm, enc.length, max_new_tokens, "max_new_tokens")
        edits = [e for s in steer for e in s.edits(hm, enc)]
        take = getattr(steer[0], "take_prefill_cache", None) if len(steer) == 1 else None
        cache = take(enc) if callable(take) and generate_kwargs.get("use_cache", True) else None
        if cache is not None:  # VHR's probe pass already holds the reinforced prompt (docs/methods/vhr.md)
            generate_kwargs["past_key_values"] = cache
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        device = hm.device
        delay = BAR_DELAY_S if enc.batch <= BAR_MIN_PROMPTS else 0.0
        with (
            progress_callback(progress, "generate", "tokens", delay=delay) as report,
            editing(hm, edits, require_fired=require_fired),
        ):
            if edits:  # a steered step whose logits overflow is an error naming the step and the edits
                from transformers import LogitsProcessorList

                procs = list(generate_kwargs.pop("logits_processor", None) or [])
                check = _FiniteLogits(enc.length, edits, str(hm.dtype).replace("torch.", ""))
                generate_kwargs["logits_processor"] = LogitsProcessorList([check, *procs])
            if report is not None:
                from transformers import StoppingCriteriaList

                stops = list(generate_kwargs.pop("stopping_criteria", None) or [])
                step = _step_progress(report, enc.length, max_new_tokens)
                generate_kwargs["stopping_criteria"] = StoppingCriteriaList([*stops, step])
            sampler = None
            if do_sample and seed is not None:  # each row its own generator (steer.sampling)
                generate_kwargs, sampler = seeded_generate_kwargs(
                    lm.generation_config, generate_kwargs, seed, enc.batch
                )
            opts: dict[str, Any] = {"do_sample": do_sample, "pad_token_id": pad_id}
            if not do_sample:
                opts.update(temperature=None, top_p=None, top_k=None)
            opts.update(generate_kwargs)
            out = hm.generate(
                **{k: v.to(device) for k, v in enc.inputs.items()},  # pixel_values, image_grid_thw, ...
                input_ids=enc.input_ids.to(device),
                attention_mask=enc.attention_mask.to(device),
                max_new_tokens=max_new_tokens,
                **opts,
            )
            if report is not None:
                report(max_new_tokens, max_new_tokens)  # also when every row stopped early
        raw = None
        if not isinstance(out, torch.Tensor):  # return_dict_in_generate=True
            raw, out = out, out.sequences
            if sampler is not None and getattr(raw, "scores", None) is not None:
                raw.scores = tuple(sampler.scores)  # the warped scores, not the sampler's pick
        new = out[:, enc.length :].tolist()
        eos = generate_kwargs.get("eos_token_id", lm.generation_config.eos_token_id)
        eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        token_ids = []
        for row in new:
            cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
            token_ids.append(row[:cut])
        texts = [cast(str, tok.decode(ids, skip_special_tokens=True)) for ids in token_ids]
        return Generation(
            texts, token_ids, enc.texts, enc.spans, steer, outputs=raw, image_spans=enc.image_spans
        )


class _FiniteLogits:
    """A `transformers` logits processor that raises when a steered step's logits are not
    finite (NaN, +inf, or a row of -inf): the steering overflowed the model's precision, and
    decoding on would answer from garbage (e.g. an empty string)."""

    def __init__(self, prompt_len: int, edits: list, dtype: str):
        self.prompt_len, self.edits, self.dtype = prompt_len, edits, dtype

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bad = torch.isnan(scores).any(-1) | torch.isposinf(scores).any(-1) | torch.isneginf(scores).all(-1)
        if bool(bad.any()):
            step = input_ids.shape[1] - self.prompt_len
            shown = ", ".join(map(repr, self.edits[:3])) + (" ..." if len(self.edits) > 3 else "")
            raise HeadsteerValueError(
                f"generation step {step}: the logits became non-finite (NaN / inf) in rows "
                f"{torch.nonzero(bad).flatten().tolist()} under the edits {shown}: the steering "
                f"overflows {self.dtype}; use a smaller scale, or load the model in float32"
            )
        return scores
