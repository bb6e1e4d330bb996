"""One unedited run with every activation a patch may read (`record_run` -> `RunCache`), and where
each family keeps its per-head query / key / value columns.

Sites, per layer l (all `[N, T, ...]`, left-padded):

* the residual stream entering l (`hidden_states[l]`), the attention block's output, the MLP's
  output (for a family whose MLP is not one module, OPT / BioGPT: the block's output minus its
  input minus the attention output), each head's output z (the `o_proj` input, `[N, T, H, d]`);
* with `query=True` every head's query as the attention function receives it (after any QK-norm
  and RoPE, `[N, T, H, d_q]`), read through the engine's query site;
* with `keys=True` the q / k / v projection outputs per head, head-major (`RunCache.qkv`),
  whatever the fused layout (the engine's `q` / `k` / `v` sites);
* with `pattern=True` the attention patterns (engine `Recorder`s).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch

from heads._util.validation import short_repr
from heads.engine.activations import ActivationRecorder
from heads.engine.edits import Edit, Recorder
from heads.engine.variants import run_rows
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel, submodule
from heads.scorers.patching.vision import replaced_embeddings

# Internal to the patching analyses (importable by this module path, not public API, so not in
# the reference): `RunCache`, `check_kv_kind`, `first_output`, `record_run`, `stream_sites`. The
# public activation cache is `heads.record`.
__all__: list[str] = []


@dataclass
class RunCache:
    """Every activation of one unedited run that a patch may read (all `[N, T, ...]`, padded).

    Attributes:
        logits: `[N, V]` fp32 last-position logits.
        residuals: `L + 1` tensors `[N, T, D]`; `residuals[l]` enters layer l (the last is normed).
        z: per layer `[N, T, H, d]` head outputs (`o_proj` input).
        attn_out: per layer `[N, T, D]` attention block outputs.
        mlp_out: per layer `[N, T, D]` MLP block outputs.
        qkv: per layer `(q [N, T, H*d], k [N, T, G*d], v [N, T, G*d])` projection outputs,
            head-major (head h's columns are `h*d .. (h+1)*d` in every layout), before RoPE /
            QK-norm; empty when not recorded (`keys=False`, latent attention).
        kv: per layer `(keys, values)` `[N, G, T, d]` as cached by the model (full length).
        pattern: per layer `[N, H, T, T]` fp32 attention probabilities, or None (not recorded).
        embeds: `[N, T, D]` the language model's input embeddings with image features (vision
            pairs: `vision.language_model_inputs`), or None (text: the ids are embedded).
        query: per layer `[N, T, H, d_q]` the queries as the attention function receives them
            (after QK-norm and RoPE), or None (not recorded).
        final: `[N, T, D]` the stream leaving the last block (the final norm's input), or None
            (not recorded).
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
    final: torch.Tensor | None = None


def first_output(out: Any) -> torch.Tensor:
    """A module's (first) output tensor."""
    return cast(torch.Tensor, out[0] if isinstance(out, tuple) else out)


# ------------------------------------------------------------------------------ q / k / v columns
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
def stream_sites(model: HeadModel) -> bool:
    """True when the engine's `attn_out` / `mlp_out` sites give the sub-layer outputs: not on a
    family that scales them by a factor other than 1 before they join the residual stream
    (Granite / HyperCLOVA X `residual_multiplier`, MiniCPM3 `scale_depth / sqrt(n_layers)`),
    where the engine refuses those sites."""
    return all(_residual_scale(model, la) == 1.0 for la in range(model.n_layers))


def _residual_scale(model: HeadModel, layer: int) -> float:
    name = model.family.residual_scale
    return 1.0 if name is None else float(getattr(model.layers[layer], name))


def _attention_output(model: HeadModel, layer: int, z: torch.Tensor) -> torch.Tensor:
    """`[N, T, D]` block `layer`'s attention output as it joins the stream (before any residual
    multiplier) from its head outputs `z [N, T, H, d]`: `o_proj(z)`, through the post-attention
    norm on post-norm families (HyperCLOVA X with a residual multiplier)."""
    out = model.out_projs[layer](z.flatten(-2))
    name = model.family.attn_out_norm
    if name is not None:
        out = submodule(model.layers[layer], name)(out)
    return cast(torch.Tensor, out).detach()


@torch.no_grad()
def cache_bytes(
    model: HeadModel, n: int, width: int, *, pattern: bool = False, query: bool = False, keys: bool = True
) -> int:
    """Bytes the `RunCache` of one `record_run` of `n` rows of `width` tokens keeps (what a
    patching sweep holds beside its forwards, twice: the clean and the corrupted run): per token
    and layer the residual, the head outputs, the attention and MLP outputs, the KV cache, and
    with `keys` the q / k / v projections, with `query` the queries, with `pattern` the fp32
    pattern rows `[H, width]`."""
    H, KV, d, D, L = model.n_heads, model.n_kv_heads, model.d_head, model.d_model, model.n_layers
    item = torch.empty(0, dtype=model.dtype).element_size()
    per = 3 * D + H * d + 2 * KV * d + ((H + 2 * KV) * d if keys else 0) + (H * d if query else 0)
    total = n * width * (L * per + D) * item
    if pattern:
        total += n * width * L * H * width * 4
    return int(total)


def record_run(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    pattern: bool = False,
    embeds: torch.Tensor | None = None,
    query: bool = False,
    keys: bool | None = None,
    final: bool = False,
) -> RunCache:
    """One unedited forward of `ids [N, T]` (left-padded, `mask [N, T]`) keeping every site's
    activation (`RunCache`), read by engine recorders (`ActivationRecorder` at the `head_output`,
    `attn_out`, `mlp_out`, `q` / `k` / `v`, `query` sites; `Recorder` for the patterns), so it runs
    on every backend and sees only this thread's forward. `pattern=True` also records the
    attention patterns (eager path), `query=True` the queries, `keys` the q / k / v projection
    outputs (default: unless the family uses latent attention, which has no per-KV-head
    projection), `final=True` the stream leaving the last block; `embeds [N, T, D]` replaces the
    token embeddings (vision pairs: image features included). The model is unchanged afterwards.

    The attention / MLP outputs are the sub-layer outputs before any residual multiplier (for
    post-norm families the post-norm's output, what joins the stream). Where the engine has no
    such site they are computed: the attention output as `o_proj(z)` (then the post-attention
    norm, if the family has one) and the MLP output as the
    block's output minus its input minus the attention output (OPT / BioGPT, whose MLP is not one
    module; families with a residual multiplier other than 1, divided by it).
    """
    L = model.n_layers
    if keys is None:
        keys = not model.family.latent
    streams = stream_sites(model)
    own_mlp = model.family.mlp is not None and streams
    z = [ActivationRecorder("head_output", la) for la in range(L)]
    attn = [ActivationRecorder("attn_out", la) for la in range(L)] if streams else []
    mlp = [ActivationRecorder("mlp_out", la) for la in range(L)] if own_mlp else []
    post = [] if own_mlp else [ActivationRecorder("resid_post", la) for la in range(L)]
    if final and own_mlp:
        post = [ActivationRecorder("resid_post", L - 1)]
    qkv = [[ActivationRecorder(w, la) for w in "qkv"] for la in range(L)] if keys else []
    recs = [Recorder(layer=la) for la in range(L)] if pattern else []
    queries = [ActivationRecorder("query", la) for la in range(L)] if query else []
    edits: list[Edit] = [*z, *attn, *mlp, *post, *[e for row in qkv for e in row], *recs, *queries]
    if embeds is not None:
        edits.append(replaced_embeddings(model, embeds))
    out = run_rows(model, ids, mask, edits, keep_cache=True)
    residuals = tuple(out.hidden_states)
    zs = [r.records[0] for r in z]
    if streams:
        attn_out = [r.records[0] for r in attn]
    else:  # the attention module's output is o_proj(z), then the post-attention norm if any
        attn_out = [_attention_output(model, la, zs[la]) for la in range(L)]
    if own_mlp:  # a MoE block may return its rows flattened (Llama 4: [N * T, D])
        mlp_out = [r.records[0].reshape(attn_out[la].shape) for la, r in enumerate(mlp)]
    else:  # the block's output = input + r * (attention output + MLP output)
        mlp_out = [
            (post[la].records[0] - residuals[la]) / _residual_scale(model, la) - attn_out[la]
            for la in range(L)
        ]
    kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    pat = [torch.cat(r.records, dim=2) for r in recs] if pattern else None
    qs = [r.records[0] for r in queries] if query else None
    last = post[-1].records[0] if final else None
    return RunCache(
        out.logits[:, -1].float(),
        residuals,
        zs,
        attn_out,
        mlp_out,
        [cast(tuple, tuple(r.records[0].flatten(-2) for r in row)) for row in qkv],
        kv,
        pat,
        embeds,
        qs,
        last,
    )


def prefix_cache(
    base: RunCache, ps: torch.Tensor, trim: int, split: int, start: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer `(keys, values)` of the base run at columns `trim:split` for the rows of pairs
    `ps` (`[R, G, split - trim, d]`), for a forward that starts at layer `start`. The layers
    below `start` are never computed, so they get pair `ps[0]`'s slice alone (`[1, G, ...]`):
    the cache reads only their length, and the rows are not copied for nothing."""
    rows = ps[:1]
    return [
        (k[ps if la >= start else rows, :, trim:split], v[ps if la >= start else rows, :, trim:split])
        for la, (k, v) in enumerate(base.kv)
    ]
