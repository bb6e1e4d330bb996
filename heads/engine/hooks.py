"""TransformerLens-style access to any activation: `record` (a cache) and `run_with_hooks`.

Both run ONE forward through the engine's sites (`heads.engine.sites`), on every backend, and
name the activations as TransformerLens does (`hook_embed`, `blocks.3.hook_resid_mid`,
`blocks.3.attn.hook_k`, `ln_final.hook_scale`, ...; `hook_names(model)` lists a model's):

    cache = heads.record(model, ["The cat sat"], names=lambda n: n.endswith("hook_z"))
    cache["blocks.2.attn.hook_z"]                        # [B, T, H, d]

    def knock(z, hook):                                   # TransformerLens' fn(tensor, hook)
        z[:, :, 3] = 0
        return z
    logits = heads.run_with_hooks(model, ["The cat sat"], fwd_hooks=[("blocks.2.attn.hook_z", knock)])

Hooks and records compose with steering edits (call them inside `heads.editing(...)`), are seen
only by the calling thread, and are removed when the call returns (also on an exception).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from heads._util.validation import short_repr
from heads.engine.activations import ActivationEdit, ActivationRecorder
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Edit, ProbEdit, Recorder
from heads.engine.sites import SITES
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, encode_prompts
from heads.model.adapter import HeadModel
from heads.results.activations import ActivationCache

__all__ = ["HookInfo", "hook_names", "record", "run_with_hooks"]

_BY_HOOK = {s.hook: n for n, s in SITES.items() if n != "logits"}
"""TransformerLens hook name template -> engine site (the logit-bias site shares its name)."""

Names = str | Sequence[str] | Callable[[str], bool] | None


@dataclass(frozen=True)
class HookInfo:
    """What a `run_with_hooks` function gets as `hook`: `name` (the TransformerLens name), `call`
    (the engine's `AttentionCall`: batch, absolute position of the first row, ...); `layer()` as
    TransformerLens' `HookPoint.layer()`."""

    name: str
    call: AttentionCall

    def layer(self) -> int:
        return self.call.layer


_LAYER_NAME = re.compile(r"blocks\.([0-9]{1,6})\.(.+)", re.ASCII | re.DOTALL)
"""`blocks.<layer>.<rest>`: an ASCII layer number of at most 6 digits (no `¹`, no 5000 digits)."""


def _split(name: str) -> tuple[str, int]:
    """`(engine site, layer)` of a TransformerLens hook name (ValueError for an unknown one)."""
    layer = 0
    template = name
    m = _LAYER_NAME.fullmatch(name) if isinstance(name, str) else None
    if m is not None:
        layer, template = int(m.group(1)), "blocks.{l}." + m.group(2)
    site = _BY_HOOK.get(template)
    if site is None:
        raise HeadsteerValueError(
            f"unknown hook name {short_repr(name)}: names as TransformerLens', one of "
            f"{', '.join(sorted(_BY_HOOK))} ({{l}} a layer number, e.g. 'blocks.0.hook_resid_pre'; "
            "hook_names(model) lists a model's)"
        )
    return site, layer


def _has(model: HeadModel, site: str) -> bool:
    try:
        model.backend.placements([ActivationRecorder(site, 0) if site != "probs" else Recorder(layer=0)])
    except HeadsteerValueError:
        return False
    return True


def hook_names(model: HeadModel) -> list[str]:
    """Every TransformerLens hook name `record` / `run_with_hooks` know on `model` (a site the
    model lacks, e.g. `hook_pos_embed` with rotary positions, is left out)."""
    names = []
    rotary = not _has(model, "pos_embed")  # learned absolute positions: no rotary queries
    for template, site in _BY_HOOK.items():
        if (site in ("query", "rot_k") and not rotary) or not _has(model, site):
            continue
        if SITES[site].scope == "model":
            names.append(template)
        else:
            names += [template.replace("{l}", str(la)) for la in range(model.n_layers)]
    return names


def _select(model: HeadModel, names: Names) -> list[str]:
    every = hook_names(model)
    if names is None:
        return every
    if callable(names) and not isinstance(names, str):
        return [n for n in every if names(n)]
    wanted = [names] if isinstance(names, str) else list(names)
    for n in wanted:
        if not isinstance(n, str):
            raise HeadsteerTypeError(
                f"names must be hook names, a list of them or a predicate; got {short_repr(n)}"
            )
        site, layer = _split(n)
        model.check_head(layer)
        if n not in every:
            raise HeadsteerValueError(f"{model.family.model_type!r} has no {n} (see hook_names(model))")
    return list(dict.fromkeys(wanted))


def _encode(model: HeadModel, inputs: str | Sequence[str] | EncodedPrompts) -> EncodedPrompts:
    if isinstance(inputs, EncodedPrompts):
        return inputs
    clean = getattr(inputs, "clean", None)  # a PairBatch (heads.scorers.patching): its clean side
    if isinstance(clean, EncodedPrompts):
        return clean
    if isinstance(inputs, str) or (isinstance(inputs, Sequence) and all(isinstance(p, str) for p in inputs)):
        return encode_prompts(model.tokenizer, inputs, chat=False, markup=False)
    raise HeadsteerTypeError(
        "prompts must be a string, a list of strings, EncodedPrompts or a PairBatch, got "
        f"{type(inputs).__name__}"
    )


def _run(model: HeadModel, enc: EncodedPrompts) -> torch.Tensor:
    model.check_length(enc.length)
    logits: torch.Tensor = model.run(**enc.model_inputs(model.device), use_cache=False).logits
    return logits


def record(
    model: HeadModel, prompts: str | Sequence[str] | EncodedPrompts, names: Names = None
) -> ActivationCache:
    """The activations of one forward of `prompts`, keyed by TransformerLens hook names.

    Args:
        model: the `HeadModel` (any backend).
        prompts: a string or a list (encoded as raw text: no chat template, no `**markup**`,
            left-padded), `EncodedPrompts`, or a `PairBatch` (`heads.scorers.patching`): its clean
            prompts, as they are padded there (`pairs.corrupted` for the corrupted side).
        names: which activations to keep: None (default) every one `hook_names(model)` lists, a
            name, a list of names, or a predicate `name -> bool` (TransformerLens' `names_filter`).
            Only what is kept is computed: a pattern or score matrix `[B, H, T, T]` is built
            only when a `hook_pattern` / `hook_attn_scores` name is kept.

    Returns:
        an `ActivationCache` (batch first; `hook_k` / `hook_v` with KV heads under GQA; patterns
        and scores in fp32); `cache.logits` holds the logits `[B, T, V]`. No gradient is kept
        (for autograd through activations use `ActivationRecorder(..., detach=False)` in
        `editing()`).

    Raises:
        ValueError: an unknown name, or one the model does not have; a layer beyond the model.
        TypeError: names or prompts of another type.
    """
    keep = _select(model, names)
    enc = _encode(model, prompts)
    recs: dict[str, Edit] = {}
    for n in keep:
        site, layer = _split(n)
        recs[n] = Recorder(layer=layer) if site == "probs" else ActivationRecorder(site, layer)
    with torch.no_grad(), editing(model, list(recs.values())):
        logits = _run(model, enc)
    cache = {}
    for n, r in recs.items():
        records = getattr(r, "records")  # noqa: B009 - both recorder kinds keep `records`
        cache[n] = records[0] if len(records) == 1 else torch.cat(records, dim=2)  # query blocks
    out = ActivationCache(cache, model)
    out.logits = logits
    return out


_ACTIVE = threading.local()
"""Per thread: the hook name whose function is running (a model call inside it is re-entrant)."""


def _version(x: torch.Tensor) -> int | None:
    try:
        return int(x._version)
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        return None


def _call_hook(fn: Callable, x: torch.Tensor, name: str, call: AttentionCall) -> torch.Tensor | None:
    """`fn(x, hook)` with TransformerLens' rules: an in-place edit of `x` (fn returning None)
    applies, as a replacement does; a replacement must be a tensor of `x`'s shape and dtype; a
    model call inside `fn` (re-entrant) is refused."""
    running = getattr(_ACTIVE, "name", None)
    if running is not None:
        raise HeadsteerValueError(
            f"a hook called the model again ({running}): re-entrant calls are not supported "
            "(record what the hook needs in a separate call first)"
        )
    before = _version(x)
    _ACTIVE.name = name
    try:
        out = fn(x, HookInfo(name, call))
    finally:
        _ACTIVE.name = None
    if out is None or out is x:  # `x.mul_(0)` returns `x` itself: an in-place edit too
        after = _version(x)
        # edited in place: the edited tensor replaces the activation at every site alike
        return x.clone() if before is not None and after != before else None
    if not isinstance(out, torch.Tensor):
        raise HeadsteerTypeError(
            f"the hook at {name} returned {short_repr(out)}: return None or a tensor of its shape"
        )
    if out.shape != x.shape or out.dtype != x.dtype:
        raise HeadsteerValueError(
            f"the hook at {name} returned a {out.dtype} tensor of shape {tuple(out.shape)}; the "
            f"activation is {x.dtype} of shape {tuple(x.shape)} (a replacement keeps both; cast it)"
        )
    return out


class _PatternHook(ProbEdit):
    """A user's function at `hook_pattern` (fp32 `[B, H, Q, K]`; None leaves it)."""

    def __init__(self, layer: int, name: str, fn: Callable):
        super().__init__(layer=layer)
        self.name, self.fn = name, fn

    def apply(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        new = _call_hook(self.fn, probs, self.name, call)
        return probs if new is None else new


def _bound(fn: Callable, name: str) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor | None]:
    # a norm's scale is used again after its edits (the output is rescaled by old / new): the
    # function edits a copy, so an in-place edit reaches the output once, as a replacement does
    copy = name.endswith("hook_scale")

    def call_fn(x: torch.Tensor, call: AttentionCall) -> torch.Tensor | None:
        return _call_hook(fn, x.clone() if copy else x, name, call)

    return call_fn


def run_with_hooks(
    model: HeadModel,
    prompts: str | Sequence[str] | EncodedPrompts,
    fwd_hooks: Sequence[tuple[str | Callable[[str], bool], Callable]] = (),
) -> torch.Tensor:
    """Logits `[B, T, V]` of one forward of `prompts` with the user's hook functions.

    Args:
        model: the `HeadModel` (any backend).
        prompts: as `record`.
        fwd_hooks: `(name or predicate, fn)` pairs as TransformerLens': `fn(tensor, hook)` gets the
            activation (batch first) and a `HookInfo` (`hook.name`, `hook.layer()`, `hook.call`)
            and returns None or a tensor of the same shape and dtype that replaces it. As in
            TransformerLens, an in-place edit of the tensor (`x.mul_(0)`, `x[:, :, 3] = 0`) by a
            function returning None applies, exactly as returning the edited tensor, at every
            site alike; a function that only reads leaves the forward unchanged. A predicate
            selects every name of `hook_names(model)` it accepts.

    Gradients flow (no `no_grad`): a loss from the logits backpropagates through the hooks'
    replacements. `hook_attn_scores` is read only (a replacement is a ValueError; bias the
    logits with a `LogitBias` edit instead); `hook_pattern` functions see one query block of
    rows at a time on long sequences (`call.q_offset`).

    Raises:
        ValueError / TypeError: as `record` for the names; a replacement of another shape or
            dtype, or not a tensor (naming the hook); an edit at a read-only site; a hook that
            runs the model again ("a hook called the model again (<name>): re-entrant calls are
            not supported", per thread).
    """
    edits: list[Edit] = []
    for entry in fwd_hooks:
        if not (isinstance(entry, tuple) and len(entry) == 2 and callable(entry[1])):
            raise HeadsteerTypeError(
                f"fwd_hooks entries are (name or predicate, fn) pairs, got {short_repr(entry)}"
            )
        which, fn = entry
        for n in _select(model, which):
            site, layer = _split(n)
            if site == "probs":
                edits.append(_PatternHook(layer, n, fn))
            else:
                edits.append(ActivationEdit(site, layer, _bound(fn, n)))
    enc = _encode(model, prompts)
    with editing(model, edits):
        return _run(model, enc)
