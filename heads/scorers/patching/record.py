"""One unedited run with every activation a patch may read (`record_run` -> `RunCache`), and where
each family keeps its per-head query / key / value columns.

Sites, per layer l (all `[N, T, ...]`, left-padded):

* the residual stream entering l (`hidden_states[l]`), the attention block's output, the MLP's
  output (for a family whose MLP is not one module, OPT / BioGPT: the block's output minus its
  input minus the attention output), each head's output z (the `o_proj` input, `[N, T, H, d]`);
* with `query=True` every head's query as the attention function receives it (after any QK-norm
  and RoPE, `[N, T, H, d_q]`), read through the engine's query site;
* with `keys=True` the key and value projection outputs per KV head, head-major
  (`RunCache.qkv`), whatever the fused layout (`qkv_layout`);
* with `pattern=True` the attention patterns (engine `Recorder`s).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from heads._util.validation import short_repr
from heads.engine.edits import AttentionCall, Edit, QueryEdit, Recorder
from heads.engine.variants import run_rows
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel, submodule
from heads.scorers.patching.vision import replaced_embeddings

__all__ = [
    "RunCache",
    "check_kv_kind",
    "first_output",
    "kv_columns",
    "qkv_layout",
    "record_run",
    "split_qkv",
]


@dataclass
class RunCache:
    """Every activation of one unedited run that a patch may read (all `[N, T, ...]`, padded).

    Attributes:
        logits: `[N, V]` fp32 last-position logits.
        residuals: `L + 1` tensors `[N, T, D]`; `residuals[l]` enters layer l (the last is normed).
        z: per layer `[N, T, H, d]` head outputs (`o_proj` input).
        attn_out / mlp_out: per layer `[N, T, D]` block outputs.
        qkv: per layer `(q [N, T, H*d], k [N, T, G*d], v [N, T, G*d])` projection outputs,
            head-major (head h's columns are `h*d .. (h+1)*d` in every layout), before RoPE /
            QK-norm; empty when not recorded (`keys=False`, latent attention).
        kv: per layer `(keys, values)` `[N, G, T, d]` as cached by the model (full length).
        pattern: per layer `[N, H, T, T]` fp32 attention probabilities, or None (not recorded).
        embeds: `[N, T, D]` the language model's input embeddings with image features (vision
            pairs: `vision.language_model_inputs`), or None (text: the ids are embedded).
        query: per layer `[N, T, H, d_q]` the queries as the attention function receives them
            (after QK-norm and RoPE), or None (not recorded).
    """

    logits: torch.Tensor
    residuals: tuple[torch.Tensor, ...]
    z: list[torch.Tensor]
    attn_out: list[torch.Tensor]
    mlp_out: list[torch.Tensor]
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    pattern: list[torch.Tensor] | None = None
    embeds: torch.Tensor | None = None
    query: list[torch.Tensor] | None = field(default=None)


def first_output(out: Any) -> torch.Tensor:
    """A module's (first) output tensor."""
    return cast(torch.Tensor, out[0] if isinstance(out, tuple) else out)


# ------------------------------------------------------------------------------ q / k / v columns
def qkv_layout(model: HeadModel) -> str:
    """How `layer`'s q / k / v projection output is laid out: `"separate"` (three modules),
    `"blocks"` (one module: all Q columns, then K, then V: Phi-3, GPT-2, multi-query
    GPT-BigCode) or `"per_head"` (head by head, each `[q | k | v]` of `d` columns: GPT-NeoX,
    Persimmon, GPT-BigCode without multi-query)."""
    fam = model.family
    if not fam.fused_qkv:
        return "separate"
    layout = fam.qkv_layout
    if layout == "bigcode":
        return "blocks" if getattr(model.model.config, "multi_query", False) else "per_head"
    return layout


def _qkv_modules(model: HeadModel, layer: int) -> tuple[torch.nn.Module, ...]:
    """The modules whose outputs are q, k, v of `layer` (one fused module three times)."""
    fam, attn = model.family, model.attentions[layer]
    if fam.fused_qkv:
        m = submodule(attn, cast(str, fam.qkv_proj))
        return (m, m, m)
    return tuple(submodule(attn, cast(str, p)) for p in (fam.q_proj, fam.k_proj, fam.v_proj))


def _qkv_slices(model: HeadModel) -> tuple[slice, slice, slice]:
    """Column slices of q, k, v in their module's output for the `"blocks"` and `"separate"`
    layouts (fused: Q | K | V)."""
    q_w, kv_w = model.n_heads * model.d_head, model.n_kv_heads * model.d_head
    if model.family.fused_qkv:
        return slice(0, q_w), slice(q_w, q_w + kv_w), slice(q_w + kv_w, q_w + 2 * kv_w)
    return slice(0, q_w), slice(0, kv_w), slice(0, kv_w)


def kv_columns(model: HeadModel, j: int, heads: Sequence[int]) -> torch.Tensor:
    """`[len(heads) * d]` long: the columns of the module output `_qkv_modules(model, l)[j]`
    (j = 0 / 1 / 2: q / k / v) that hold `heads` (query heads for q, KV heads for k / v), in
    head-major order, for every layout (`qkv_layout`)."""
    d = model.d_head
    if qkv_layout(model) == "per_head":  # [H, 3, d]: head h's q | k | v
        return torch.cat([torch.arange(h * 3 * d + j * d, h * 3 * d + (j + 1) * d) for h in heads])
    start = _qkv_slices(model)[j].start
    return torch.cat([torch.arange(start + h * d, start + (h + 1) * d) for h in heads])


def split_qkv(model: HeadModel, j: int, out: torch.Tensor) -> torch.Tensor:
    """The q / k / v part (j = 0 / 1 / 2) of a projection output `out [..., width]`, head-major
    `[..., n * d]` (n = H for q, G for k / v)."""
    n = model.n_heads if j == 0 else model.n_kv_heads
    return out[..., kv_columns(model, j, range(n)).to(out.device)]


def check_kv_kind(model: HeadModel, kind: str) -> None:
    """Refuse, before any forward, a key / value site the family does not have per KV head.

    Raises:
        ValueError: k / v on a latent-attention family (keys and values are decompressed from a
            shared latent with a shared rotary key: no per-KV-head projection), or k on a family
            whose QK-norm spans every head (OLMo 2 style: one head's projection columns change
            every head's normed key, so it is not that head's key).
    """
    fam = model.family
    if kind in ("k", "v") and fam.latent:
        raise HeadsteerValueError(
            f"kind={short_repr(kind)} is not available on {short_repr(fam.model_type)} (multi-head latent "
            "attention: keys and values come from a shared latent, there is no per-KV-head projection); "
            "patch 'q', 'head_out' or 'pattern' instead"
        )
    if kind == "k" and fam.qk_norm == "all_heads":
        raise HeadsteerValueError(
            f"kind='k' is not available on {short_repr(fam.model_type)}: its key norm spans all KV heads, "
            "so a head's key projection columns are not that head's key; patch 'q', 'v', 'head_out' or "
            "'pattern' instead"
        )


# ------------------------------------------------------------------------------ recording
@dataclass(eq=False, repr=False)
class _QueryRecorder(QueryEdit):
    """Reads every head's query (after QK-norm and RoPE) without changing it."""

    records: list = field(default_factory=list, init=False)

    def apply(self, q: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        self.records.append(q.detach().clone())
        return q


@torch.no_grad()
def record_run(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    pattern: bool = False,
    embeds: torch.Tensor | None = None,
    query: bool = False,
    keys: bool | None = None,
) -> RunCache:
    """One unedited forward of `ids [N, T]` (left-padded, `mask [N, T]`) keeping every site's
    activation (`RunCache`). `pattern=True` also records the attention patterns (eager path),
    `query=True` the queries, `keys` the q / k / v projection outputs (default: unless the
    family uses latent attention, which has no per-KV-head projection); `embeds [N, T, D]`
    replaces the token embeddings (vision pairs: image features included). The model is
    unchanged afterwards."""
    L = model.n_layers
    z: list[Any] = [None] * L
    attn: list[Any] = [None] * L
    mlp: list[Any] = [None] * L
    block_out: list[Any] = [None] * L
    qkv: list[list[Any]] = [[None, None, None] for _ in range(L)]
    own_mlp = model.family.mlp is not None
    if keys is None:
        keys = not model.family.latent
    with ExitStack() as stack:
        for la in range(L):

            def zh(mod, args, la=la):
                x = args[0]
                z[la] = x.reshape(*x.shape[:-1], model.n_heads, model.d_head).detach().clone()

            def ah(mod, args, out, la=la):
                attn[la] = first_output(out).detach().clone()

            def mh(mod, args, out, la=la):
                x = args[0] if args else None
                o = first_output(out).detach()
                # a MoE block may return its rows flattened (Llama 4: [N * T, D])
                mlp[la] = (o.reshape(*x.shape[:-1], o.shape[-1]) if x is not None else o).clone()

            def bh(mod, args, out, la=la):
                block_out[la] = first_output(out).detach().clone()

            handles = [
                model.out_projs[la].register_forward_pre_hook(zh),
                model.attentions[la].register_forward_hook(ah),
                model.mlp(la).register_forward_hook(mh)
                if own_mlp
                else model.layers[la].register_forward_hook(bh),
            ]
            if keys:
                mods = _qkv_modules(model, la)
                for j, m in enumerate(mods):
                    if j and m is mods[0]:
                        continue

                    def qh(mod, args, out, la=la, j=j):
                        o = first_output(out).detach()
                        if model.family.fused_qkv:  # one module: q, k and v from its output
                            qkv[la] = [split_qkv(model, i, o).clone() for i in range(3)]
                        else:
                            qkv[la][j] = o.clone()

                    handles.append(m.register_forward_hook(qh))
            for h in handles:
                stack.callback(h.remove)
        recs = [Recorder(layer=la) for la in range(L)] if pattern else []
        queries = [_QueryRecorder(layer=la) for la in range(L)] if query else []
        edits: list[Edit] = [*recs, *queries]
        if embeds is not None:
            stack.enter_context(replaced_embeddings(model, embeds))
        out = run_rows(model, ids, mask, edits, keep_cache=True)
    residuals = tuple(out.hidden_states)
    if not own_mlp:  # the block's output = input + attention output + MLP output
        mlp = [block_out[la] - residuals[la] - attn[la] for la in range(L)]
    kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    pat = [torch.cat(r.records, dim=2) for r in recs] if pattern else None
    qs = [q.records[0] for q in queries] if query else None
    return RunCache(
        out.logits[:, -1].float(),
        residuals,
        z,
        attn,
        mlp,
        [cast(tuple, tuple(x)) for x in qkv] if keys else [],
        kv,
        pat,
        embeds,
        qs,
    )
