"""Direct logit attribution (DLA), the logit lens and comp-mech's logit inspection (no patching).

One unedited forward of the clean prompts, read at the engine's sites and projected on the answer
direction as it runs (`heads.scorers.patching.dla_stream`: no cache of the run is kept). The last
residual stream before the final norm is a sum of parts:

    x_L(t) = e(t) + sum_l [ sum_h z_{l,h}(t) W_O^{l,h} + b_O^l + m_l(t) ]

(`e` the embeddings, `z` the head outputs `[N, T, H, d]`, `b_O` the output-projection bias,
`m_l` the MLP output). With the final norm's scale frozen at its value in the run,
`s(t) = 1 / sqrt(mean(x_L(t)^2) + eps)` (RMSNorm) or `1 / sqrt(var(x_L(t)) + eps)` and the
centring (LayerNorm), the logit difference of answer c against counterfactual w is linear in
the parts:

    LD(t) = sum_parts  s(t) * part(t) . u  +  bias terms,    u = g * (W_U[:, c] - W_U[:, w])

(`g` the final norm's gain; LayerNorm also centres `u`; the bias terms are the norm's bias and
the LM head's bias, projected on the same direction). `direct_logit_attribution` returns
every head's term at every position (`[N, L, H, T]`) or at chosen ones (`positions=`,
`[N, L, H, P]`; at `t = T - 1` these sum with the
embedding, bias, MLP and rest terms to the model's logit difference: the `rest` term is what
the recorded parts do not explain, ~1e-6 on pre-norm families). Sources: Elhage et al. 2021
(residual-stream decomposition), nostalgebraist 2020 (the logit lens), TransformerLens'
`ActivationCache.decompose_resid` / `stack_head_results` / `apply_ln_to_stack` (the frozen-
scale convention), Ortu et al. 2024 (Sec. 4, logit inspection of factual vs counterfactual).

`logit_lens` applies the model's own output function (the real final norm, the unembedding and
any logit scale and output soft-cap after it: `output_logits`) to the residual entering every
layer (and the final one, so its last entry is the model's output): the metric, the logit and
rank of the answer and counterfactual token, and the top tokens per layer. `head_logits` (the
per-head lens) gives each head's direct logit for the answer and for the counterfactual token at
the last position (frozen scale): comp-mech's per-head inspection. `logit_inspection` bundles both.

Families whose attention output passes through a norm before joining the residual (Gemma 2 / 3,
OLMo 2: the family's `attn_out_norm`) are decomposed with that norm's scale frozen at its value
in the run as well (`heads.scorers.patching.norms.head_terms`): head h adds
`g * c(z_h W_O^h) / sigma(y)` (`y` the whole attention output), the norm's bias and `b_O`'s
share go to `attn_bias`, and the terms still add up exactly. DLA is a linear
decomposition of the logit difference before any output soft-cap (Gemma 2 / 3, NanoChat): the
cap is not linear, and the terms sum to the uncapped difference (`DLAResult.logit_diff`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch

from heads.engine.activations import ActivationEdit
from heads.engine.context import editing
from heads.engine.edits import AttentionCall, Edit
from heads.engine.forward import run_last
from heads.engine.unembed import logit_transform, output_logits
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.tokens import readable_token
from heads.model.adapter import HeadModel
from heads.results.dla import DLAResult as DLAResult  # defined there; imported here as before
from heads.results.lens import LensResult as LensResult  # the same
from heads.scorers.patching.dla_stream import _o_matrices, _residual_scale, stream_dla
from heads.scorers.patching.norms import NormParts, frozen_scale, head_terms, norm_parts, post_attention_norm
from heads.scorers.patching.pairs import PairBatch, check_vocab
from heads.scorers.patching.record import RunCache, record_run  # noqa: F401 - importable from here as before
from heads.scorers.patching.request import DLARequest, LensRequest

__all__ = [
    "DLAResult",
    "LensResult",
    "check_dla_model",
    "direct_logit_attribution",
    "head_logits",
    "logit_inspection",
    "logit_lens",
    "norm_parts",
    "run_dla",
    "run_lens",
]


# ------------------------------------------------------------------------------ helpers
def _post_norms(model: HeadModel) -> list[NormParts | None]:
    """Per layer the post-attention norm's `norm_parts` (frozen-scale convention), or None where
    the attention output joins the stream as it is."""
    return [post_attention_norm(model, la) for la in range(model.n_layers)]


def _tol(model: HeadModel) -> float:
    """How closely the frozen-scale sum of a post-norm's input must give its recorded output."""
    return 1e-3 if model.dtype == torch.float32 else 3e-2


def check_dla_model(model: HeadModel) -> None:
    """Refuse, before any forward, a model that `direct_logit_attribution`, `head_logits` and
    `logit_inspection` cannot decompose: a final norm, or a post-attention norm (Gemma 2 / 3,
    OLMo 2: the attention output normed before it joins the residual), that is not an RMSNorm /
    LayerNorm whose scale can be frozen (`norm_parts`).

    Raises:
        ValueError: either case, one line naming it.
    """
    _norm_parts(model)
    _post_norms(model)


def _which(pairs: PairBatch, which: str) -> torch.Tensor:
    return pairs.ids(which)


def _check_input(model: HeadModel, pairs: object) -> PairBatch:
    """Refuse, before any forward, pairs that are not a `PairBatch`, ids outside the model's
    vocabulary, a padded width over the model's context (`which` is the request's)."""
    if not isinstance(pairs, PairBatch):
        raise HeadsteerTypeError(f"pairs must be a PairBatch (encode_pairs), got {type(pairs).__name__}")
    check_vocab(pairs, model.d_vocab)
    model.check_length(pairs.width)
    return pairs


def _norm_parts(model: HeadModel) -> tuple[str, torch.Tensor, torch.Tensor | None, float]:
    """(kind "rms" | "layer", gain [D], bias [D] or None, eps) of the final norm."""
    return norm_parts(model, model.final_norm, model.W_U.shape[0])


def _record_last(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    heads: bool = False,
    cols: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """One forward keeping the last position only (or the padded columns `cols [P]`), all the
    lens and `head_logits` read: `(the residual entering every layer [N, P, D] each (the model's
    dtype), the heads' outputs [N, P, H, d] each with `heads` (else []), the stream leaving the
    last block [N, P, D] fp32 CPU)`, `P = 1` by default.

    `(L + 1) P` vectors per row (plus `L H d P` values with `heads`), where the run's full cache
    (`record_run`: every layer's activations at every position and the KV cache) held about 13x
    a plain forward's peak at 1k-2k tokens on SmolLM2 (benchmarks/long_context_analyses.py)."""
    L = model.n_layers
    kept: dict[tuple[str, int], torch.Tensor] = {}

    def keep(key: tuple[str, int]) -> Callable[[torch.Tensor, AttentionCall], None]:
        def fn(x: torch.Tensor, call: AttentionCall) -> None:
            x = x.detach()
            kept[key] = x[:, -1:].clone() if cols is None else x[:, cols.to(x.device)]

        return fn

    edits: list[Edit] = [ActivationEdit("residual", la, keep(("residual", la))) for la in range(L)]
    edits.append(ActivationEdit("resid_post", L - 1, keep(("final", L - 1))))
    if heads:
        edits += [ActivationEdit("head_output", la, keep(("z", la))) for la in range(L)]
    with editing(model, edits):  # no hidden states kept (`run_rows` keeps every layer's): the reads above
        run_last(model, ids, mask)
    resid = [kept[("residual", la)] for la in range(L)]
    zs = [kept[("z", la)] for la in range(L)] if heads else []
    return resid, zs, kept[("final", L - 1)].float().cpu()


def _directions(model: HeadModel, pairs: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """`(u_answer [N, D], u_counterfactual [N, D])`: mean unembedding columns of each pair's
    answer / counterfactual tokens (fp32)."""
    wu = model.W_U  # [D, V], the model's dtype and device: only the columns read are copied

    def mean_cols(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        picked = wu[:, ids.reshape(-1).to(wu.device)].float().cpu()
        cols = picked.T.reshape(*ids.shape, -1)  # [N, A, D]
        m = mask.float()[..., None]
        return (cols * m).sum(1) / m.sum(1).clamp(min=1)

    return mean_cols(pairs.answers, pairs.answer_mask), mean_cols(
        pairs.counterfactuals, pairs.counterfactual_mask
    )


def _logit_scale(model: HeadModel) -> tuple[float, bool]:
    """`(c, before_unembed)`: the constant the model multiplies its output logits by (1 if none)
    and whether it scales the normed state before the unembedding (`engine.unembed`)."""
    scale, before, _ = logit_transform(model)
    return scale, before


def _lm_bias(model: HeadModel) -> torch.Tensor | None:
    b = getattr(model.unembed, "bias", None)
    return None if b is None else b.detach().float().cpu()


def _labels(model: HeadModel, pairs: PairBatch, row: int = 0) -> list[str]:
    """Pair `row`'s position labels; pairs of token ids without text are decoded with the
    model's tokenizer (this decoded only pairs that had text already)."""
    return pairs.position_labels(row, getattr(model, "tokenizer", None))


# ------------------------------------------------------------------------------ DLA
@torch.no_grad()
def direct_logit_attribution(
    model: HeadModel,
    pairs: PairBatch,
    *,
    which: str = "clean",
    stability: int = 0,
    positions: Sequence[int] | None = None,
) -> DLAResult:
    """DLA of every head, MLP and the embeddings on the logit difference, at every position or
    at chosen ones.

    One forward, streamed: each layer's parts are projected on the answer direction as the
    forward reaches them (`heads.scorers.patching.dla_stream`); kept are the `[N, L, H, P]`
    terms, one running sum of the parts and the last residual at the `P` positions read (about
    1.1x a plain forward's peak memory at every position on SmolLM2, ~1x at a few positions).

    Args:
        model: the model (any backend; post-norm families under the frozen-scale convention,
            see the module docstring).
        pairs: encoded pairs (answer and counterfactual tokens are required).
        which: `"clean"` (default) or `"corrupted"`: the rows to run.
        stability: bootstrap resamples of the pairs (default 0: none; e.g. 100) for the
            stability of the head ranking at the last position read (`result.stability`, no
            extra forward).
        positions: padded columns to attribute at (ints, negative from the end; default None:
            every position). The result's last axis is then these columns in the given order
            (`P` of them; `result.labels` their tokens), each equal to the every-position
            result's column.

    Returns:
        a `DLAResult` (fp32, CPU, logit units): `heads [N, L, H, P]`, `mlp` / `attn_bias`
        `[N, L, P]`, `embed` / `bias` / `rest` / `logit_diff` `[N, P]` (`P = T` by default).
        Exactness: at the last position `total()` equals the model's logit difference before any
        output soft-cap within float error (tested: 1e-5 on a tiny fp32 model of every family
        DLA accepts, with logit scales and residual multipliers switched on; 1e-4 on the
        embedded model).

    Raises:
        ValueError: pairs without counterfactual tokens, a final or post-attention norm whose
            scale cannot be frozen (`norm_parts`), `which` not clean/corrupted, positions not a
            non-empty list or outside the pairs' width (named), two positions naming one column
            (e.g. 3 and -8 of 11), ids outside the vocabulary,
            prompts longer than the model's context (all before the forward); a recorded
            post-norm output that is not the norm of the heads' projection.
        TypeError: pairs not a `PairBatch`; a position not an int.
    """
    return run_dla(model, pairs, DLARequest(which=which, stability=stability, positions=positions))


@torch.no_grad()
def run_dla(model: HeadModel, pairs: PairBatch, request: DLARequest) -> DLAResult:
    """`direct_logit_attribution` of a `DLARequest` (what `heads.run` calls); see there."""
    which, stability = request.which, request.stability
    _check_input(model, pairs)
    ids = _which(pairs, which)
    if not pairs.has_counterfactual:
        raise HeadsteerValueError("direct logit attribution needs a counterfactual token for every pair")
    cols = request.check_pairs(pairs)  # in the width, one column each
    post, tol = _post_norms(model), _tol(model)
    if stability:
        from heads.scorers.stability import check_samples

        check_samples(pairs.n, stability)
    kind, gain, nbias, eps = _norm_parts(model)
    ua, uw = _directions(model, pairs)
    scale, _ = _logit_scale(model)
    du = (ua - uw) * scale  # [N, D]: the logit scale is linear, it folds into the direction
    u = gain * du
    if kind == "layer":
        u = u - u.mean(-1, keepdim=True)
    mask = pairs.attention_mask
    got = stream_dla(model, ids, mask, u, post, tol, cols)
    x_final = cast(torch.Tensor, got.final)  # [N, P, D]
    s = frozen_scale(kind, x_final, eps)  # [N, P]
    real = mask.float() if cols is None else mask.float()[:, cols]
    L, H, P = model.n_layers, model.n_heads, x_final.shape[1]
    heads = torch.zeros(pairs.n, L, H, P)
    mlp = torch.zeros(pairs.n, L, P)
    attn_bias = torch.zeros(pairs.n, L, P)
    for la in range(L):
        r = _residual_scale(model, la)  # what the block's outputs are scaled by on joining the stream
        heads[:, la] = got.heads[la] * (s * real)[:, None, :] * r
        attn_bias[:, la] = got.attn_u[la] * s * real
        mlp[:, la] = got.mlp_u[la] * s * real
    embed = cast(torch.Tensor, got.embed_u) * s * real
    rest = cast(torch.Tensor, got.rest_u) * s * real
    bias = torch.zeros(pairs.n, P)
    if nbias is not None:
        bias = bias + (du @ nbias)[:, None]
    lb = _lm_bias(model)
    if lb is not None:
        ba = lb[pairs.answers] * pairs.answer_mask
        bw = lb[pairs.counterfactuals] * pairs.counterfactual_mask
        diff = ba.sum(-1) / pairs.answer_mask.sum(-1) - bw.sum(-1) / pairs.counterfactual_mask.sum(-1).clamp(
            min=1
        )
        bias += diff[:, None] * (1.0 if _logit_scale(model)[1] else scale)
    bias = bias * real
    # the model's own logit difference at every position read (from the normed final residual),
    # before any output soft-cap
    normed = model.final_norm(x_final.to(model.device, model.dtype)).float().cpu()
    ld = torch.einsum("ntd,nd->nt", normed, du)
    if lb is not None:
        ld = ld + bias
    ld = ld * real
    labels = _labels(model, pairs)
    params: dict[str, object] = {"which": which, "norm": kind, "frozen_scale": True}
    if cols is not None:
        labels = [labels[int(c)] for c in cols]
        params["positions"] = list(cast("tuple[int, ...]", request.positions))
    result = DLAResult(
        heads,
        mlp,
        attn_bias,
        embed,
        bias,
        rest,
        ld,
        labels,
        getattr(model, "name", ""),
        model.n_kv_heads,
        params,
    )
    if stability:
        from heads.scorers.stability import pair_templates

        result.stability = result.bootstrap(stability, templates=pair_templates(pairs))
    return result


# ------------------------------------------------------------------------------ lenses
@torch.no_grad()
def logit_lens(
    model: HeadModel,
    pairs: PairBatch,
    *,
    which: str = "clean",
    k: int = 5,
    positions: Sequence[int] | None = None,
) -> LensResult:
    """The logit lens (nostalgebraist 2020): the model's output function (final norm,
    unembedding and every step after it: a logit scale, the output soft-cap; `output_logits`) of
    the residual entering every layer, at the last position or at chosen ones. The last entry is
    the model's output (tested on every family).

    One forward keeping the residual entering each layer at the positions read only (`(L + 1) P`
    vectors per row), then `(L + 1) P` rows of logits (`V` floats each).

    Args:
        which: `"clean"` (default) or `"corrupted"`.
        k: top tokens kept per layer for pair 0 (default 5; at the last position read).
        positions: padded columns to read (ints, negative from the end; default None: the last
            position only).

    Returns:
        a `LensResult` (logits in the model's logit units): `[N, L + 1]` fields by default,
        `[N, L + 1, P]` with `positions` (in the given order); its per-head `head_answer` /
        `head_counterfactual` are None: use `logit_inspection` (the lens and `head_logits`
        together) for them.

    Raises:
        ValueError: pairs without counterfactual tokens, `which` not clean/corrupted, `k` not in
            1..d_vocab, positions not a non-empty list or outside the pairs' width (named), two
            positions naming one column, a position that is padding in some pair (the lens reads a
            token's residual; DLA gives such a column zeros), ids outside the vocabulary, prompts
            longer than the model's context.
        TypeError: pairs not a `PairBatch`; a position not an int.
    """
    return run_lens(model, pairs, LensRequest(which=which, k=k, positions=positions))


@torch.no_grad()
def run_lens(model: HeadModel, pairs: PairBatch, request: LensRequest) -> LensResult:
    """`logit_lens` of a `LensRequest` (what `heads.run` calls); see there."""
    _check_input(model, pairs)
    request.check_config(model)
    which, k = request.which, request.k
    ids = _which(pairs, which)
    if not pairs.has_counterfactual:
        raise HeadsteerValueError("the logit lens metric needs a counterfactual token for every pair")
    cols = request.check_pairs(pairs)  # in the width, one column each, none padding in a pair
    resid, _, x_final = _record_last(model, ids, pairs.attention_mask, cols=cols)
    resid = [*resid, x_final]
    stack = torch.stack([r.to(model.device, model.dtype) for r in resid], 1)  # [N, L+1, P, D]
    logits = output_logits(model, model.final_norm(stack)).float().cpu()  # [N, L+1, P, V]

    def gather(ids_: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        n, points, p = logits.shape[:3]
        vals = logits.gather(-1, ids_[:, None, None, :].expand(n, points, p, -1))
        mm = m.float()[:, None, None, :]
        return (vals * mm).sum(-1) / mm.sum(-1).clamp(min=1)

    a = gather(pairs.answers, pairs.answer_mask)
    w = gather(pairs.counterfactuals, pairs.counterfactual_mask)

    def rank(first: torch.Tensor) -> torch.Tensor:
        v = logits.gather(-1, first[:, None, None, None].expand(*logits.shape[:3], 1))
        return (logits > v).sum(-1)

    tok = getattr(model, "tokenizer", None)
    top = []
    for la in range(logits.shape[1]):
        idx = logits[0, la, -1].topk(k).indices.tolist()
        top.append([readable_token(tok, i) if tok is not None else str(i) for i in idx])
    ra, rw = rank(pairs.answers[:, 0]), rank(pairs.counterfactuals[:, 0])
    params: dict[str, object] = {"which": which, "k": k}
    if cols is None:  # the last position: [N, L + 1] as before
        a, w, ra, rw = a[..., 0], w[..., 0], ra[..., 0], rw[..., 0]
    else:
        params["positions"] = list(cast("tuple[int, ...]", request.positions))
    return LensResult(
        a,
        w,
        ra,
        rw,
        a - w,
        top,
        model=getattr(model, "name", ""),
        params=params,
        n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads,
    )


@torch.no_grad()
def head_logits(
    model: HeadModel, pairs: PairBatch, *, which: str = "clean"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's direct logit of the answer and of the counterfactual token at the last
    position, with the final norm's scale frozen from the run (the per-head lens; Ortu et al.
    2024's per-head inspection).

    Returns:
        `(answer [N, L, H], counterfactual [N, L, H])` fp32; their difference is the DLA head
        term at the last position.

    Raises:
        ValueError: as `direct_logit_attribution`.
    """
    which = DLARequest(which=which).which  # the request's check of which
    _check_input(model, pairs)
    if not pairs.has_counterfactual:
        raise HeadsteerValueError("head_logits needs a counterfactual token for every pair")
    post = _post_norms(model)
    kind, gain, _, eps = _norm_parts(model)
    ua, uw = _directions(model, pairs)
    _, zs, x_final = _record_last(model, _which(pairs, which), pairs.attention_mask, heads=True)
    s = frozen_scale(kind, x_final[:, 0], eps)  # [N]
    scale, _ = _logit_scale(model)
    out = []
    for u in (ua, uw):
        v = gain * u * scale
        if kind == "layer":
            v = v - v.mean(-1, keepdim=True)
        per = torch.zeros(pairs.n, model.n_layers, model.n_heads)
        for la in range(model.n_layers):
            wo, bo = _o_matrices(model, la)
            z = zs[la].float().cpu()  # [N, 1, H, d]
            terms, _ = head_terms(z, wo, bo, v, post[la])  # [N, H, 1]
            per[:, la] = terms[..., 0] * s[:, None] * _residual_scale(model, la)
        out.append(per)
    return out[0], out[1]


def logit_inspection(model: HeadModel, pairs: PairBatch, *, which: str = "clean", k: int = 5) -> LensResult:
    """Comp-mech's logit inspection (Ortu et al. 2024, Sec. 4): per layer (logit lens) and per
    head (frozen-scale direct logits) the logit of the answer ("factual" in the paper's words)
    and of the counterfactual token. Two forwards; see `logit_lens` and `head_logits`."""
    LensRequest(which=which, k=k).check_config(model)  # the lens' checks, once, before any forward
    _check_input(model, pairs)
    check_dla_model(model)  # before logit_lens' forward: what head_logits refuses
    lens = logit_lens(model, pairs, which=which, k=k)
    lens.head_answer, lens.head_counterfactual = head_logits(model, pairs, which=which)
    return lens
