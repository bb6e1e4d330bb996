"""The edit engine: applies `heads.edits` to a model inside a context manager.

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
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from . import fused as _fused
from .edits import AttentionCall, Edit, HeadOutputEdit, LogitBias, ProbEdit, QueryEdit, SpanShareEdit
from .families import family_of
from .model import HeadModel

__all__ = [
    "FUSED_MIN_ROWS_CPU",
    "KERNELS",
    "QUERY_BLOCK",
    "SITES",
    "EditNeverFired",
    "Site",
    "active_edit_count",
    "editing",
    "fusable",
    "registered_name",
]

QUERY_BLOCK = 1024
"""Query rows per block in edited layers (memory is O(QUERY_BLOCK x keys) per head)."""

KERNELS = ("auto", "fused", "blocked")
"""Values of `editing(..., kernel=)`."""

FUSED_MIN_ROWS_CPU = 2048
"""`kernel="auto"` on CPU runs the fused kernel for calls with at least this many query rows
(long prefills), and for any call of more than `QUERY_BLOCK` rows in a layer with a span-share
edit (SpotLight at layer / head granularity pools the whole prefill, which the blocked path
would split into query blocks); shorter calls and decoding stay on the blocked path, whose cost
has no compile step (README, "Kernels"). On CUDA, auto runs the fused kernel for every call of
two or more rows."""

_MIN = torch.finfo(torch.float32).min


class EditNeverFired(RuntimeError):
    """An edit was installed but the model never ran it (e.g. wrong layer, no forward)."""


@dataclass
class _LayerEdits:
    layer: int
    n_heads: int
    window: int | None = None  # sliding-window size of the layer, if any
    sites: dict[str, list[Edit]] = field(default_factory=dict)

    def get(self, site: str) -> list[Edit]:
        return self.sites.get(site, [])


# id(attention module) -> its edits; a ContextVar so threads do not see each other's edits.
_ACTIVE: ContextVar[dict[int, _LayerEdits]] = ContextVar("headsteer_active_edits", default={})  # noqa: B039

_BASES = ("sdpa", "eager")
_KERNEL: ContextVar[str] = ContextVar("headsteer_kernel", default="auto")


def fusable(edit: Edit) -> bool:
    """True when `edit` can run with `kernel="fused"`: a query, head-output or residual edit
    (these never need the pattern), a `LogitBias` with `per_column` (e.g. PASTA) or a
    `SpanShareEdit` (e.g. SpotLight). Other pattern edits (recorders, ACT, VAR, attribution's
    linearised scale) read the whole pattern and run on the blocked path."""
    if isinstance(edit, LogitBias):
        return edit.per_column
    if isinstance(edit, ProbEdit):
        return isinstance(edit, SpanShareEdit)
    return True


def _layer_fusable(edits: _LayerEdits) -> bool:
    probs = edits.get("probs")
    return all(fusable(e) for e in (*edits.get("logits"), *probs)) and len(probs) <= 1


def _check_fusable(table: dict[int, _LayerEdits]) -> None:
    """ValueError unless every layer's attention edits (this context's and any outer one's)
    can run on the fused kernel."""
    for slot in table.values():
        pattern = [*slot.get("logits"), *slot.get("probs")]
        bad = [e for e in pattern if not fusable(e)]
        shares = sum(isinstance(e, SpanShareEdit) for e in pattern)
        if bad or shares > 1:
            what: list = bad or [f"{shares} span-share edits in layer {slot.layer}"]
            raise ValueError(
                f"kernel='fused' cannot run {what}: they read the whole attention pattern; "
                "use kernel='auto' or 'blocked'"
            )


def _use_fused(edits: _LayerEdits, want_probs: bool, query: torch.Tensor) -> bool:
    kernel = _KERNEL.get()
    if kernel == "fused" and want_probs:
        raise ValueError(
            f"layer {edits.layer}: kernel='fused' never builds the attention pattern, so it cannot "
            "return it (output_attentions=True); use kernel='auto' or 'blocked'"
        )
    if kernel == "blocked" or want_probs or not _layer_fusable(edits):
        return False
    if query.device.type == "cpu" and torch.is_grad_enabled() and query.requires_grad:
        if kernel == "fused":
            raise ValueError(
                f"layer {edits.layer}: kernel='fused' on CPU has no backward pass (flex_attention); "
                "run under torch.no_grad() / inference_mode() or use kernel='auto' or 'blocked'"
            )
        return False
    if kernel == "fused":
        return True
    q_len = query.shape[2]
    if query.device.type == "cuda":
        return q_len > 1
    if q_len > QUERY_BLOCK and edits.get("probs"):  # blocked would split a pooled span share
        return True
    return q_len >= FUSED_MIN_ROWS_CPU


def registered_name(base: str) -> str:
    """Name of headsteer's attention function for a base backend (`sdpa` or `eager`)."""
    return f"headsteer_{base}"


def _causal_additive(q_len: int, k_len: int, q_offset: int, device: torch.device) -> torch.Tensor:
    """`[1, 1, q_len, k_len]` fp32 mask: 0 where key j <= query position, else min."""
    qpos = torch.arange(q_offset, q_offset + q_len, device=device)[:, None]
    kpos = torch.arange(k_len, device=device)[None, :]
    return torch.where(kpos <= qpos, 0.0, _MIN)[None, None]


def _additive(
    mask: torch.Tensor | None, q_len: int, k_len: int, device: torch.device, causal: bool = True
) -> torch.Tensor:
    """The model's mask as an fp32 additive mask `[B or 1, 1, q_len, k_len]`.

    `mask=None` means "every key" for a non-causal module and "causal" otherwise (as SDPA's
    `is_causal` does).
    """
    if mask is None:
        if not causal:
            return torch.zeros(1, 1, q_len, k_len, device=device)
        return _causal_additive(q_len, k_len, k_len - q_len, device)
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, _MIN).to(device)
    return mask.float().clamp(min=_MIN)


def _in_dtype(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 additive mask cast to `dtype` without overflowing to -inf (fp16) or NaN."""
    if dtype == torch.float32:
        return mask
    return mask.clamp(min=torch.finfo(dtype).min).to(dtype)


# Keywords transformers 5.23 passes to attention functions that the SDPA / eager paths ignore
# too (positions are already in the rotated q/k, the mask carries windows and padding):
_IGNORED_KW = frozenset(
    {
        "position_ids",
        "use_cache",
        "cache_position",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "token_type_ids",
        "sliding_window",  # the registered mask function already applies it
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
    }
)
# ... and those the edited path reproduces itself.
_REPRODUCED_KW = frozenset({"softcap", "is_causal"})


def _check_kwargs(layer: int, dropout: float, kw: dict) -> None:
    """ValueError for anything the edited path would otherwise silently drop."""
    unknown = sorted(k for k, v in kw.items() if v is not None and k not in _IGNORED_KW | _REPRODUCED_KW)
    if unknown:
        raise ValueError(
            f"layer {layer}: the model passes {unknown} to its attention function; headsteer's edited "
            "attention does not reproduce it, so it refuses rather than compute a different attention"
        )
    if dropout:
        raise ValueError(
            f"layer {layer}: attention dropout {dropout} is active (training mode); call model.eval() "
            "before editing attention"
        )


def _check_window(edits: _LayerEdits, q_len: int, k_len: int) -> None:
    # Keys beyond the queries come from the KV cache; a sliding-window cache keeps only the last
    # window - 1 of them, so key column j is no longer absolute position j.
    if edits.window is not None and q_len < k_len and k_len >= edits.window - 1:
        raise ValueError(
            f"layer {edits.layer} uses sliding-window attention (window {edits.window}) and the sequence "
            f"reached {k_len} keys: the KV cache no longer holds absolute positions, so attention edits "
            "cannot be placed; shorten the prompt or edit only full-attention layers"
        )


def _own_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    causal: bool,
) -> torch.Tensor:
    """`[B, H, Q, d_v]` SDPA as transformers' `sdpa_attention_forward` runs it (the model's own
    attention): `is_causal` only for a prefill with no mask, the mask passed as given. `key` and
    `value` have one head per query head (no GQA)."""
    q_len, k_len = query.shape[2], key.shape[2]
    is_causal = q_len > 1 and mask is None and causal
    if is_causal and k_len > q_len:  # top-left causal alignment: only the first q_len keys
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling
    )


def _fused_edited_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    edits: _LayerEdits,
    softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """`_edited_attention` on the fused kernel (`heads.fused`): `[B, Q, H, d]` output.

    Only the heads some edit touches (in any batch row) run through the fused kernel; the
    others run through the model's own SDPA (`_own_sdpa`; on CPU the fused kernel is about
    twice as slow per head as SDPA's flash kernel, and PASTA edits a few heads per layer).
    With a soft-cap (which SDPA lacks) every head runs fused. Column logit biases are summed
    into one `[B, H_edited, K]` table; a `SpanShareEdit` takes one extra pass for its per-row
    span shares. Rows with no visible key (left-padding query rows) give 0 on the fused heads
    and what SDPA gives on the others; no real token reads them.
    """
    batch, n_heads, q_len, _ = query.shape
    k_len = key.shape[2]
    groups = n_heads // key.shape[1]
    device = query.device
    _check_window(edits, q_len, k_len)
    call = AttentionCall(edits.layer, batch, n_heads, q_len, k_len, k_len - q_len, device)
    biases = cast("list[LogitBias]", edits.get("logits"))
    spans = cast("list[SpanShareEdit]", edits.get("probs"))
    touched = {h for ed in (*biases, *spans) for h in ed.head_list(n_heads)}
    n_fused = _fused.head_bucket(len(touched), n_heads)
    split = softcap is None and 0 < n_fused < n_heads
    # the edited heads, padded with unedited ones up to the compiled head count
    sel = sorted(touched | set(sorted(set(range(n_heads)) - touched)[: n_fused - len(touched)]))
    sel = sel if split else list(range(n_heads))
    index = torch.tensor(sel, device=device)
    if split:  # the edited heads only, each with its own KV head
        q_e, k_e, v_e = query[:, index], key[:, index // groups], value[:, index // groups]
    else:
        q_e, k_e, v_e = query, key, value
    bias = None
    for ed in biases:
        ed.calls += 1
        b = ed.bias(call).float()
        if b.dim() != 4 or b.shape[-2] != 1:
            raise ValueError(
                f"{ed!r} declares per_column but its bias has shape {tuple(b.shape)}, not [B|1, H|1, 1, K]"
            )
        b = torch.where(ed.head_mask(batch, n_heads, device)[:, :, None], b[:, :, 0].to(device), 0.0)
        bias = b if bias is None else bias + b
    if bias is not None:
        bias = bias.clamp(min=_MIN)[:, index] if split else bias.clamp(min=_MIN)
    bool_mask = None if mask is None or mask.dtype == torch.bool else mask > _MIN / 2
    if mask is not None and mask.dtype == torch.bool:
        bool_mask = mask
    kw: dict = dict(scale=scaling, mask=bool_mask, causal=causal, bias=bias, softcap=softcap)
    beta = span = None
    for se in spans:
        se.calls += 1
        cols = se.span_columns(call).to(device)
        span = cols.float()
        indicator = torch.zeros_like(v_e)
        indicator[..., 0] = span[:, None, :].to(v_e.dtype)
        indicator[..., 1] = 1
        mass_e = _fused.fused_attention(q_e, k_e, indicator, **kw).float()
        mass = mass_e.new_zeros(batch, n_heads, q_len, mass_e.shape[-1])
        mass[:, index] = mass_e
        heads = se.head_mask(batch, n_heads, device)[:, :, None]
        num = torch.where(heads, mass[..., 0], 0.0)
        den = torch.where(heads, mass[..., 1], 0.0)
        got = se.span_beta(num, den, call)
        beta = None if got is None else torch.where(heads, got.float().expand_as(num), 0.0)[:, index]
    out_e = _fused.fused_attention(q_e, k_e, v_e, beta=beta, span=span, **kw)
    if not split:
        return out_e.transpose(1, 2).contiguous()
    out = out_e.new_empty(batch, q_len, n_heads, value.shape[-1])
    out[:, :, index] = out_e.transpose(1, 2)
    rest = torch.tensor(sorted(set(range(n_heads)) - set(sel)), device=device)
    kv = rest // groups
    own = _own_sdpa(query[:, rest], key[:, kv], value[:, kv], mask, scaling, causal)
    out[:, :, rest] = own.transpose(1, 2)
    return out


def _edited_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    edits: _LayerEdits,
    softcap: float | None = None,
    causal: bool = True,
    want_probs: bool = False,
    eager: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The family's attention with the layer's logit and pattern edits.

    Returns `([B, Q, H, d]` output, the edited pattern `[B, H, Q, K]` in the value dtype if
    `want_probs` (`output_attentions=True`), else None).

    Args:
        query: `[B, H, Q, d]` (after QK-norm, RoPE and any query edit); key, value
            `[B, G, K, d]`.
        mask: the model's mask (bool or additive, `[B or 1, 1, Q, K]`) or None.
        scaling: the module's logit scale; softcap: `c` of `c * tanh(s / c)` or None.
        causal: what a None mask means (the module's `is_causal`).
        want_probs: also return the pattern (computes it explicitly).
        eager: the model's own attention is `eager`: compute the edited layer the same way
            (matmul, softmax) rather than with SDPA, so only the edit differs from the model's
            own arithmetic (and a TransformerLens bridge, which attends eagerly, agrees bitwise).
    """
    batch, n_heads, q_len, _ = query.shape
    k_len = key.shape[2]
    groups = n_heads // key.shape[1]
    device = query.device
    biases = cast("list[LogitBias]", edits.get("logits"))  # the site's edits are its subclass
    probs_edits = cast("list[ProbEdit]", edits.get("probs"))
    head_masks = {
        id(e): e.head_mask(batch, n_heads, device)[:, :, None, None] for e in (*biases, *probs_edits)
    }
    _check_window(edits, q_len, k_len)
    for e in (*biases, *probs_edits):
        e.calls += 1
    # SDPA cannot soft-cap or expose the pattern
    explicit = bool(probs_edits) or softcap is not None or want_probs or eager
    if explicit and groups > 1:  # GQA: each query head reads its KV head; K/V are never edited
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    # A single decode row with no padding mask sees every key: no base mask needed.
    base = None if (mask is None and (q_len == 1 or not causal)) else _additive(mask, q_len, k_len, device)
    outs, patterns = [], []
    for s in range(0, q_len, QUERY_BLOCK):
        e_ = min(q_len, s + QUERY_BLOCK)
        call = AttentionCall(edits.layer, batch, n_heads, e_ - s, k_len, k_len - q_len + s, device)
        add = base if base is None or base.shape[-2] == 1 else base[..., s:e_, :]
        for ed in biases:
            b = torch.where(head_masks[id(ed)], ed.bias(call).float(), 0.0)
            add = b if add is None else add + b
        # every key visible (one decode row or a non-causal layer, no mask, no bias): the explicit
        # path needs no mask (adding zeros and masking nothing would change no bit)
        open_row = add is None and explicit and (q_len == 1 or not causal)
        if add is None and not open_row:
            if causal:
                add = _causal_additive(e_ - s, k_len, k_len - q_len + s, device)
            else:
                add = torch.zeros(1, 1, e_ - s, k_len, device=device)
        elif add is not None:
            add = add.clamp(min=_MIN)  # stacked biases on a masked key must not overflow to -inf
        q_blk = query[:, :, s:e_]
        if not explicit:
            assert add is not None  # open rows are only skipped on the explicit path
            outs.append(
                F.scaled_dot_product_attention(
                    q_blk,
                    key,
                    value,
                    attn_mask=_in_dtype(add, query.dtype),
                    scale=scaling,
                    enable_gqa=groups > 1,
                )
            )
            continue
        scores = torch.matmul(q_blk.float(), key.float().transpose(-1, -2)) * scaling
        if softcap is not None:  # Gemma 2: c * tanh(s / c) on the scaled logits, before the mask
            scores = torch.tanh(scores / softcap) * softcap
        visible: torch.Tensor | None = None
        if add is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            visible = (add > _MIN / 2).expand_as(scores)
            probs = torch.where(visible, torch.softmax(scores + add, dim=-1), 0.0)  # fully masked rows: 0
        for pe in probs_edits:
            probs = torch.where(head_masks[id(pe)], pe.apply(probs, call), probs)
            if visible is not None:
                probs = torch.where(visible, probs, 0.0)  # masked / future keys stay exactly 0
        outs.append(torch.matmul(probs.to(value.dtype), value))
        if want_probs:
            patterns.append(probs.to(value.dtype))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    pattern = torch.cat(patterns, dim=2) if want_probs else None
    return out.transpose(1, 2).contiguous(), pattern


def _apply_head_edits(
    edits: Sequence[QueryEdit | HeadOutputEdit], z: torch.Tensor, call: AttentionCall
) -> torch.Tensor:
    """Apply per-head edits to `z` `[B, T, H, d]` (each only on its (row, head) pairs).

    An edit that does not act on this call (`Edit.acts_on`, e.g. positions outside it) is
    skipped and not counted as fired.
    """
    for e in edits:
        if not e.acts_on(call):
            continue
        e.calls += 1
        mask = e.head_mask(z.shape[0], z.shape[2], z.device)[:, None, :, None]
        z = torch.where(mask, e.apply(z, call), z)
    return z


_EAGER: dict[type, tuple[Callable, tuple[str, str] | None]] = {}
_SDPA: list[Callable] = []  # transformers' SDPA attention function, set by _register()


def _own_attention(module: nn.Module, base: str) -> Callable:
    """The attention function the model itself would run for `module` under `base`."""
    if base == "sdpa":
        return _SDPA[0]
    cached = _EAGER.get(type(module))
    if cached is None:
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"{type(module).__name__} has no eager_attention_forward to fall back to")
        config = getattr(module, "config", None)
        variant = family_of(config).eager_variant if config is not None else None
        cached = _EAGER[type(module)] = (fn, variant)
    fn, variant = cached
    if variant is not None and getattr(module, variant[0], False):  # e.g. GPT-2's upcast path
        method = getattr(module, variant[1])
        return lambda m, q, k, v, mask, **kw: method(q, k, v, mask)
    return fn


def _make_attention(base: str):
    def headsteer_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        edits = _ACTIVE.get().get(id(module))
        queries = edits.get("query") if edits is not None else []
        if queries:
            b, h, q_len, _ = query.shape
            k_len = key.shape[2]
            call = AttentionCall(edits.layer, b, h, q_len, k_len, k_len - q_len, query.device)
            query = _apply_head_edits(queries, query.transpose(1, 2), call).transpose(1, 2)
        want = bool(
            kw.get("output_attentions", getattr(getattr(module, "config", None), "output_attentions", False))
        )
        if edits is None or not any(SITES[s].pattern_site and edits.get(s) for s in edits.sites):
            if not (want and base == "sdpa"):
                own = _own_attention(module, base)
                return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw)
            # SDPA returns no pattern: compute it explicitly (no edit) so output_attentions holds it.
            edits = edits or _LayerEdits(int(getattr(module, "layer_idx", -1)), query.shape[1])
        _check_kwargs(edits.layer, dropout, kw)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        is_causal = kw.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        if _use_fused(edits, want, query):
            out = _fused_edited_attention(
                query, key, value, attention_mask, scaling, edits, kw.get("softcap"), causal
            )
            return out, None
        return _edited_attention(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling,
            edits,
            kw.get("softcap"),
            causal,
            want,
            base == "eager",
        )

    return headsteer_attention


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    _SDPA[:] = [sdpa_attention_forward]
    for base, mask_fn in (("sdpa", sdpa_mask), ("eager", eager_mask)):
        name = registered_name(base)
        AttentionInterface.register(name, _make_attention(base))
        AttentionMaskInterface.register(name, mask_fn)


_register()


# ------------------------------------------------------------------------------ hook sites
def _output_hook(key: int, model: HeadModel, layer: int):
    """o_proj pre-hook applying the calling context's head-output edits (none: untouched)."""
    n_heads, d_head = model.n_heads, model.d_head

    def hook(module, args):
        slot = _ACTIVE.get().get(key)
        edits = slot.get("head_output") if slot is not None else []
        if not edits:
            return None
        x = args[0]
        offset = _OFFSETS.get().get(key, 0)  # absolute position of the call's first row
        b, t = x.shape[0], x.shape[1]
        call = AttentionCall(slot.layer, b, n_heads, t, offset + t, offset, x.device)
        z = _apply_head_edits(edits, x.reshape(*x.shape[:-1], n_heads, d_head), call)
        return (z.reshape(x.shape), *args[1:])

    return hook


# id(attention module) -> cached keys before the current call (its first absolute position).
_OFFSETS: ContextVar[dict[int, int]] = ContextVar("headsteer_call_offsets", default={})  # noqa: B039


def _offset_hook(key: int, model: HeadModel, layer: int):
    """Attention-module pre-hook recording the call's first absolute query position (the
    KV-cache length), for hook sites that run after attention (`head_output`)."""

    def hook(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        offsets = _OFFSETS.get()
        if not offsets:  # a fresh dict per context, never the shared default
            offsets = {}
            _OFFSETS.set(offsets)
        offsets[key] = int(cache.get_seq_length(layer)) if cache is not None else 0
        return None

    return hook


def _residual_hook(key: int, model: HeadModel, layer: int):
    """Decoder-layer pre-hook giving residual edits the hidden state `[B, T, D]` entering it."""
    n_heads = model.n_heads

    def hook(module, args, kwargs):
        slot = _ACTIVE.get().get(key)
        edits = slot.get("residual") if slot is not None else []
        if not edits:
            return None
        positional = bool(args)
        x = args[0] if positional else kwargs["hidden_states"]
        cache = kwargs.get("past_key_values")
        offset = int(cache.get_seq_length(layer)) if cache is not None else 0
        call = AttentionCall(layer, x.shape[0], n_heads, x.shape[1], offset + x.shape[1], offset, x.device)
        for e in edits:
            e.calls += 1
            new = e.apply(x, call)
            if new is not None:
                ok = isinstance(new, torch.Tensor) and new.shape == x.shape
                if not ok or new.dtype != x.dtype or new.device != x.device:
                    is_t = isinstance(new, torch.Tensor)
                    got = (tuple(new.shape), new.dtype) if is_t else type(new).__name__
                    want = (tuple(x.shape), x.dtype, str(x.device))
                    raise ValueError(f"{e!r} returned {got}; a residual edit returns None or a {want} tensor")
                x = new
        if positional:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    return hook


@dataclass(frozen=True)
class Site:
    """How the engine installs the edits of one site (see the module docstring).

    Attributes:
        name: the value of `Edit.site` this entry serves.
        attention: applied inside headsteer's attention function (the model's attention
            implementation is switched while such an edit is active).
        pattern_site: the layer must compute its attention itself (logits / probs), not
            call the model's own function.
        module: for a hook site, `(model, layer) -> module` to hook.
        hook: `(key, model, layer) -> hook function`; `key` is the layer's slot in the
            active-edit table (the id of its attention module).
        with_kwargs: register the forward pre-hook with `with_kwargs=True`.
        positions: the hook runs after attention and needs the call's absolute positions:
            the engine also hooks the layer's attention module to record them.
    """

    name: str
    attention: bool = False
    pattern_site: bool = False
    module: Callable[[HeadModel, int], nn.Module] | None = None
    hook: Callable[[int, HeadModel, int], Callable] | None = None
    with_kwargs: bool = False
    positions: bool = False

    def target(self, model: HeadModel, layer: int) -> nn.Module:
        """The module this hook site hooks in `layer` (TypeError for a site without one)."""
        if self.module is None:
            raise TypeError(f"site {self.name!r} hooks no module")
        return self.module(model, layer)


_POSITIONS = Site("positions", module=lambda m, la: m.attentions[la], hook=_offset_hook, with_kwargs=True)
"""Internal companion of the sites with `positions=True` (no edit targets it)."""

SITES: dict[str, Site] = {
    s.name: s
    for s in (
        Site("query", attention=True),
        Site("logits", attention=True, pattern_site=True),
        Site("probs", attention=True, pattern_site=True),
        Site("head_output", module=lambda m, la: m.out_projs[la], hook=_output_hook, positions=True),
        Site("residual", module=lambda m, la: m.layers[la], hook=_residual_hook, with_kwargs=True),
    )
}
"""Every edit site, keyed by `Edit.site`."""


def _site(e: Edit) -> Site:
    """The `SITES` entry of a validated edit (`_validate` checked its `site` is a key)."""
    return SITES[cast(str, e.site)]


def _validate(hm: HeadModel, edits: Sequence[Edit]) -> None:
    for e in edits:
        if not isinstance(e, Edit) or getattr(e, "site", None) not in SITES:
            raise TypeError(f"not a headsteer edit: {e!r}")
        e.validate()
        hm.check_head(e.layer)
        if e.heads is not None:
            for h in e.heads:
                hm.check_head(e.layer, h)
        if e.row_heads is not None and (e.row_heads.ndim != 2 or e.row_heads.shape[1] != hm.n_heads):
            raise ValueError(
                f"row_heads must be [batch, {hm.n_heads}] bool, got shape {tuple(e.row_heads.shape)}"
            )


# Shared model state, reference-counted across contexts and threads:
# id(config) -> [count, original attn implementation]; (id(module), site) -> [count, hook handle].
_LOCK = threading.Lock()
_SWITCHED: dict[int, list] = {}
_HOOKED: dict[tuple[int, str], list] = {}


def _pre_hook(module: nn.Module, fn: Callable, with_kwargs: bool) -> Callable[[], None]:
    return module.register_forward_pre_hook(fn, with_kwargs=with_kwargs).remove


def _tl_hook(module: nn.Module, fn: Callable) -> Callable[[], None]:
    """Add `fn` to a TransformerLens hook point; the remover takes out only this hook."""
    handle = cast(Callable, module.add_hook)(fn)

    def remove() -> None:
        handle.hook.remove()
        hooks = cast(list, getattr(module, "fwd_hooks", []))
        if handle in hooks:
            hooks.remove(handle)

    return remove


# (module, site name, layer, hook factory (key, model, layer) -> fn, register (module, fn) -> remover)
_HookSpec = tuple[nn.Module, str, int, Callable[[int, HeadModel, int], Callable], Callable]


def _hook_sites(model: HeadModel, active: Sequence[Edit]) -> list[_HookSpec]:
    """Every hook the active edits need (on a TransformerLens bridge: its hook points)."""
    sites: dict[tuple[str, int], _HookSpec] = {}
    if model.backend.hook_sites:
        from functools import partial

        from .tl_sites import hook_point_for, tl_hook

        for e in active:
            name = _site(e).name
            need = [name]
            if name in ("query", "head_output", "residual"):
                need.append("positions")
            if name == "probs":
                need.append("logits")  # records which keys are visible
            for n in need:
                module = hook_point_for(model, n, e.layer)
                register: Callable = _pre_register(True) if n == "positions" else _tl_hook
                sites[(n, e.layer)] = (module, n, e.layer, partial(tl_hook, n), register)
        return list(sites.values())
    for e in active:
        site = _site(e)
        if site.hook is not None:
            reg = _pre_register(site.with_kwargs)
            sites[(site.name, e.layer)] = (site.target(model, e.layer), site.name, e.layer, site.hook, reg)
        if site.positions:
            p = _POSITIONS
            reg = _pre_register(True)
            sites[(p.name, e.layer)] = (
                p.target(model, e.layer),
                p.name,
                e.layer,
                cast(Callable, p.hook),
                reg,
            )
    return list(sites.values())


def _pre_register(with_kwargs: bool) -> Callable[[nn.Module, Callable], Callable[[], None]]:
    """A register function adding a forward pre-hook."""
    return lambda module, fn: _pre_hook(module, fn, with_kwargs)


def active_edit_count() -> int:
    """How many edits the calling context has active (on any model)."""
    return sum(len(x) for v in _ACTIVE.get().values() for x in v.sites.values())


def _acquire(model: HeadModel, switch: bool, sites: Sequence[_HookSpec]) -> None:
    with _LOCK:
        if switch:
            for c in model.attention_configs:  # check all before changing any
                if id(c) not in _SWITCHED and c._attn_implementation not in _BASES:
                    raise ValueError(
                        f"attention backend {c._attn_implementation!r} is not supported for attention "
                        "edits; load the model with attn_implementation='sdpa' or 'eager'"
                    )
            for c in model.attention_configs:
                slot = _SWITCHED.get(id(c))
                if slot is None:
                    base = c._attn_implementation
                    slot = _SWITCHED[id(c)] = [0, base]
                    c._attn_implementation_internal = registered_name(base)
                slot[0] += 1
        for module, name, layer, make, register in sites:
            slot = _HOOKED.get((id(module), name))
            if slot is None:
                remove = register(module, make(id(model.attentions[layer]), model, layer))
                slot = _HOOKED[(id(module), name)] = [0, remove]
            slot[0] += 1


def _release(model: HeadModel, switch: bool, sites: Sequence[_HookSpec]) -> None:
    with _LOCK:
        if switch:
            for c in model.attention_configs:
                slot = _SWITCHED.get(id(c))
                if slot is not None:
                    slot[0] -= 1
                    if slot[0] == 0:
                        c._attn_implementation_internal = slot[1]
                        del _SWITCHED[id(c)]
        for module, name, _, _, _ in sites:
            slot = _HOOKED.get((id(module), name))
            if slot is not None:
                slot[0] -= 1
                if slot[0] == 0:
                    slot[1]()
                    del _HOOKED[(id(module), name)]


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
            `flex_attention` kernel, `heads.fused`, memory linear in the sequence; only edits
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
        TypeError: an object that is not an edit; a `kernel` that is not a string.
        EditNeverFired: see `require_fired`.
    """
    if not isinstance(model, HeadModel):
        raise TypeError(f"editing() needs a HeadModel, got {type(model).__name__}")
    edits = [edits] if isinstance(edits, Edit) else list(edits)
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    model.backend.check()  # e.g. a TransformerLens bridge whose weights were processed after wrapping
    _validate(model, edits)
    active = [e for e in edits if not e.is_identity()]
    if kernel == "fused":
        if model.backend.hook_sites:
            raise ValueError(
                f"kernel='fused' is not available on the {model.backend.kind} backend: its attention "
                "runs inside the backend with edits on hook points; use kernel='auto' or 'blocked'"
            )
        if not _fused.available():
            raise ValueError("kernel='fused' needs torch.nn.attention.flex_attention (torch >= 2.5)")
    fired_before = [e.calls for e in active]  # an edit reused from an earlier context must fire again
    # a TransformerLens bridge computes attention itself: its edits are hook-point hooks
    switch = not model.backend.hook_sites and any(_site(e).attention for e in active)
    sites = _hook_sites(model, active)  # ValueError for a hook point the backend lacks

    table: dict[int, _LayerEdits] = {}
    for key, v in _ACTIVE.get().items():  # nested contexts: keep the outer edits
        table[key] = _LayerEdits(v.layer, v.n_heads, v.window, {k: list(x) for k, x in v.sites.items()})
    for e in active:
        key = id(model.attentions[e.layer])
        slot = table.setdefault(key, _LayerEdits(e.layer, model.n_heads, model.sliding_window(e.layer)))
        slot.sites.setdefault(_site(e).name, []).append(e)

    if kernel == "fused":  # every edit the layers will see, outer contexts' included
        _check_fusable(table)

    _acquire(model, switch, sites)
    token = _ACTIVE.set(table)
    kernel_token = _KERNEL.set(kernel)
    try:
        yield active
    finally:
        _KERNEL.reset(kernel_token)
        _ACTIVE.reset(token)
        _release(model, switch, sites)
    if require_fired:
        idle = [e for e, n in zip(active, fired_before, strict=True) if e.calls == n]
        if idle:
            hint = (
                " (on the nnsight backend, enter editing() outside trace(): the trace body runs apart)"
                if model.backend.kind == "nnsight"
                else ""
            )
            raise EditNeverFired(f"these edits never ran: {idle}{hint}")
