"""The edit engine: applies `heads.engine.edits` to a model inside a context manager.

Every edit declares its *site* (`Edit.site`), and the engine dispatches through one table,
`SITES` (site name -> `Site`: whether it runs inside headsteer's attention function, whether
it needs the explicit pattern, or which module it hooks and how):

* `"query"`: the queries as the attention function receives them, after any QK-norm and
  RoPE (so a UA ablation is exact on Qwen 3, Gemma 3 and OLMo 2, and a fused QKV needs no
  hook);
* `"logits"`: additive biases on the (soft-capped) attention logits;
* `"probs"`: functions of the post-softmax pattern (recorders included);
* `"head_output"`: the heads' outputs, in a forward pre-hook on `o_proj`;
* `"residual"`: the residual stream entering a decoder layer, in a forward pre-hook on the
  layer (read, or replaced).

Adding a hook site is one `Site` entry (the module to hook, the hook, how to register it).

Attention-site edits run in headsteer's attention function, registered in `transformers`'
`AttentionInterface` *and* `AttentionMaskInterface` (without the mask registration the model
would silently run with no causal mask). While any such edit is active the function stands in
for the model's attention on every layer: a layer without attention edits calls the model's own
function (SDPA, or the family's own eager function) unchanged, a layer with only query edits
calls it with the edited queries, and a layer with logit or pattern edits computes the family's
attention itself (scale, soft-capping, the model's mask incl. sliding windows and bidirectional
spans, GQA) in query blocks, so memory grows linearly with context. A keyword the model passes
that this path does not reproduce (e.g. learned sinks `s_aux`) or dropout in training mode is a
`ValueError`, never dropped.

Usage::

    with editing(model, [PastaBias(...), HeadScale(layer=3, heads=[1], factor=0)]):
        logits = model.model(input_ids).logits
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from heads._util.validation import short_repr
from heads.engine.activations import ActivationEdit, ActivationRecorder
from heads.engine.attention import check_fusable, fusable, registered_name
from heads.engine.edits import Edit, check_combined_factors
from heads.engine.kernels import fused as _fused
from heads.engine.sites import SITES, Site, site_of
from heads.engine.state import (
    ACTIVE,
    FUSED_MIN_ROWS_CPU,
    KERNEL,
    KERNELS,
    QUERY_BLOCK,
    LayerEdits,
    acquire,
    active_edit_count,
    release,
)
from heads.errors import EditNeverFired, HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel

__all__ = [
    "FUSED_MIN_ROWS_CPU",
    "ActivationEdit",
    "ActivationRecorder",
    "KERNELS",
    "QUERY_BLOCK",
    "SITES",
    "EditNeverFired",
    "Site",
    "active_edit_count",
    "editing",
    "fusable",
    "registered_name",
    "validate_edits",
]


def validate_edits(hm: HeadModel, edits: Sequence[Edit]) -> None:
    """Check `edits` against `hm` as `editing` does before it activates them: each is a headsteer
    edit with valid fields, on a layer and heads of the model, and the scaling factors that reach
    one head do not multiply past the dtype's bound (`check_combined_factors`).

    Raises:
        HeadsteerTypeError: not a headsteer edit.
        HeadsteerValueError: a bad field, an unknown layer or head, `row_heads` not
            `[batch, n_heads]`, or stacked factors beyond the dtype.
    """
    for e in edits:
        if not isinstance(e, Edit) or getattr(e, "site", None) not in SITES:
            raise HeadsteerTypeError(f"not a headsteer edit: {short_repr(e)}")
        e.validate()
        hm.check_head(e.layer)
        site = site_of(e)
        n = hm.n_kv_heads if site.heads == "kv" else hm.n_heads
        if e.heads is not None:
            for h in e.heads:
                if site.heads == "kv" and not 0 <= h < n:
                    raise HeadsteerValueError(
                        f"unknown KV head {short_repr(h)} at site {site.name!r}: this model has {n} "
                        f"(0..{n - 1})"
                    )
                hm.check_head(e.layer, h)
        if e.row_heads is not None and (e.row_heads.ndim != 2 or e.row_heads.shape[1] != n):
            raise HeadsteerValueError(
                f"row_heads must be [batch, {n}] bool, got shape {tuple(e.row_heads.shape)}"
            )
    check_combined_factors(edits, hm.n_heads, hm.dtype)


def _refuse_repeats(edits: Sequence[Edit]) -> None:
    """HeadsteerValueError for an edit object listed twice or already active in an outer
    `editing` context: applying it twice would compose it with itself silently (a
    `HeadScale(0.5)` would scale by 0.25). Equal but distinct objects are separate edits."""
    seen: set[int] = set()
    outer = {id(e) for slot in ACTIVE.get().values() for xs in slot.sites.values() for e in xs}
    for e in edits:
        if id(e) in seen:
            raise HeadsteerValueError(
                f"{short_repr(e)} is listed twice: each edit object applies once (build a second one to "
                "apply it twice)"
            )
        if id(e) in outer:
            raise HeadsteerValueError(
                f"{short_repr(e)} is already active in an outer editing() context: each edit object "
                "applies once"
            )
        seen.add(id(e))


@contextlib.contextmanager
def editing(
    model: HeadModel, edits: Edit | Sequence[Edit], *, require_fired: bool = True, kernel: str = "auto"
) -> Iterator[list[Edit]]:
    """Apply `edits` to `model` for the duration of the `with` block.

    Args:
        model: the `HeadModel` to edit.
        edits: one edit or a list: any mix of edits of the sites in `SITES`
            (`QueryEdit`, `LogitBias`, `ProbEdit` incl. `Recorder`, `HeadOutputEdit`,
            `ResidualEdit`). Identity edits (`is_identity()`) are
            skipped, so alpha = 1 / factor = 1 is a bitwise no-op. Contexts nest.
        require_fired: on normal exit, raise `EditNeverFired` if an active edit was
            never run by the model (default True).
        kernel: how edited layers compute their attention: `"blocked"` (headsteer's torch
            attention in `QUERY_BLOCK`-row query blocks; every edit), `"fused"` (one compiled
            `flex_attention` kernel, `heads.engine.kernels.fused`, memory linear in the sequence; only edits
            for which `fusable` holds) or `"auto"` (default: fused where every edit of the
            layer is fusable and the call is long enough to repay the compile: on CPU calls
            of at least `FUSED_MIN_ROWS_CPU` query rows or of more than `QUERY_BLOCK` rows
            with a span-share edit, on CUDA every call of two or more rows; otherwise
            blocked). Requests for the pattern (`output_attentions`) always
            run blocked. Both paths compute the same attention (tests/test_fused.py: within
            1e-5 in fp32). With nested contexts the innermost `kernel` applies to every edited
            layer; an inner `"fused"` is checked against the outer contexts' edits too.

    Yields:
        the list of active (non-identity) edits; their `calls` count runs.

    Edits are seen only by the thread (and `contextvars` context) that entered the
    block: another thread running the same model meanwhile gets the unedited model.
    On exit — normal or by exception — the attention backend and every hook are
    restored (when the last context using them exits), so the model's logits are
    bitwise what they were before.

    Raises:
        ValueError: unknown layer/head, a row mask of the wrong shape, a bad edit
            parameter, an unknown `kernel`, `kernel="fused"` with an edit that is not
            `fusable` (or a torch without flex_attention), or a model whose attention
            backend is neither `sdpa` nor `eager` (e.g. FlashAttention-2).
            Nothing is changed on the model then.
            Also, from the forward pass, an attention edit on a sliding-window
            layer once a KV cache reaches the window, or a keyword the model passes to
            its attention function that the edited path does not reproduce.
            The same edit object twice (listed twice, or already active in an outer
            context).
        TypeError: an object that is not an edit; a `kernel` that is not a string.
        EditNeverFired: see `require_fired`.
    """
    if not isinstance(model, HeadModel):
        raise HeadsteerTypeError(f"editing() needs a HeadModel, got {type(model).__name__}")
    edits = [edits] if isinstance(edits, Edit) else list(edits)
    if not isinstance(kernel, str):
        raise HeadsteerTypeError(f"kernel must be one of {KERNELS}, got {short_repr(kernel)}")
    if kernel not in KERNELS:
        raise HeadsteerValueError(f"kernel must be one of {KERNELS}, got {short_repr(kernel)}")
    model.backend.check()  # e.g. a TransformerLens bridge whose weights were processed after wrapping
    validate_edits(model, edits)
    _refuse_repeats(edits)
    active = [e for e in edits if not e.is_identity()]
    if kernel == "fused":
        if model.backend.attention_via_hooks:
            raise HeadsteerValueError(
                f"kernel='fused' is not available on the {model.backend.kind} backend: its attention "
                "runs inside the backend with edits on hook points; use kernel='auto' or 'blocked'"
            )
        if not _fused.available():
            raise HeadsteerValueError("kernel='fused' needs torch.nn.attention.flex_attention (torch >= 2.5)")
    fired_before = [e.calls for e in active]  # an edit reused from an earlier context must fire again
    # where the backend puts each site: hooks, the attention switch (ValueError for a site the model lacks)
    placements = model.backend.placements(active)

    table: dict[int, LayerEdits] = {}
    for key, v in ACTIVE.get().items():  # nested contexts: keep the outer edits
        table[key] = LayerEdits(v.layer, v.n_heads, v.window, {k: list(x) for k, x in v.sites.items()})
    for e in active:
        key = id(model.attentions[e.layer])
        slot = table.setdefault(key, LayerEdits(e.layer, model.n_heads, model.sliding_window(e.layer)))
        slot.sites.setdefault(site_of(e).name, []).append(e)

    if kernel == "fused":  # every edit the layers will see, outer contexts' included
        check_fusable(table)

    keys = acquire(placements)
    token = ACTIVE.set(table)
    kernel_token = KERNEL.set(kernel)
    try:
        yield active
    finally:
        KERNEL.reset(kernel_token)
        ACTIVE.reset(token)
        release(keys)
    if require_fired:
        idle = [e for e, n in zip(active, fired_before, strict=True) if e.calls == n]
        if idle:
            hint = model.backend.never_fired_hint  # the likely cause first, then the (long) list
            shown = ", ".join(map(repr, idle[:5])) + (
                f", ... ({len(idle) - 5} more)" if len(idle) > 5 else ""
            )
            raise EditNeverFired(f"{hint}{len(idle)} edit(s) never ran: {shown}")
