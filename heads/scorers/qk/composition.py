"""Head composition: how much each head's output feeds each later head's query, key or value.

From the weights (Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits"),
with row vectors as TransformerLens writes them (`x W_Q`): writer i's OV circuit
`W_OV^i = W_V^i W_O^i` and reader j's `W_QK^j = W_Q^j W_K^jT` (`d_model x d_model`, rank d),

    Q-composition(i -> j) = ||W_OV^i W_QK^j||_F   / (||W_OV^i||_F ||W_QK^j||_F)
    K-composition(i -> j) = ||W_OV^i W_QK^jT||_F  / (||W_OV^i||_F ||W_QK^j||_F)
    V-composition(i -> j) = ||W_OV^i W_OV^j||_F   / (||W_OV^i||_F ||W_OV^j||_F)

(TransformerLens' `all_composition_scores("Q" | "K" | "V")`). Folded in, as TransformerLens'
`fold_ln` / `center_writing_weights` do: each reading matrix is read through its layer's input
norm's gain (and LayerNorm's centring); QK-norm gains multiply the query / key features;
post-norm families' output-norm gain multiplies `W_O`. The norms' frozen scales are per position
scalars and cancel in the ratio. Under GQA the key and value matrices are the reader's (or
writer's) KV head's. RoPE rotates queries and keys by position: the weight-based score ignores
it (computed without the rotation); `data_composition_scores` reads the rotated terms from the
decomposition and is exact. The baseline is the mean score of random Gaussian factors of the
same shapes (`baseline`, Elhage et al.); `CompositionScores.q / .k / .v` subtract it.

Norms are computed without forming any `d_model x d_model` matrix: with `R_V` a square root of
`W_V^T W_V`, `||W_V W_O M||_F = ||R_V W_O M||_F`, so every pair costs a `[d, D] x [D, d]` product
(one GEMM per reader layer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch

from heads._util.validation import check_int, check_seed
from heads.engine.options import SweepOptions, sweep_options
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, Prompt, position_ids
from heads.model.adapter import HeadModel
from heads.results.composition import CompositionScores
from heads.results.scores import HeadSet
from heads.scorers.qk.attribution import encode_input
from heads.scorers.qk.family import LayerParts, check_qk_model, layer_parts
from heads.scorers.qk.record import Recording, record
from heads.scorers.qk.request import MAX_SAMPLES, CompositionRequest
from heads.scorers.qk.sides import components, side

__all__ = ["baseline", "composition_scores", "data_composition_scores", "run_composition"]


def _r(w: torch.Tensor) -> torch.Tensor:
    """`[..., d, d]` a square root R of `w^T w` for `w [..., D, d]` (`R^T R = w^T w`), so that
    `||w M||_F = ||R M||_F` for any M: the QR's R up to a rotation, from the Cholesky factor of
    the fp64 Gram matrix (far cheaper than a batched QR on CPU); a rank-deficient `w` takes the
    symmetric root from an eigendecomposition instead."""
    g = w.double().transpose(-1, -2) @ w.double()
    low, info = torch.linalg.cholesky_ex(g)
    if bool((info == 0).all()):
        return cast(torch.Tensor, low.transpose(-1, -2).to(w.dtype))
    vals, vecs = torch.linalg.eigh(g)
    root = (vecs * vals.clamp(min=0).sqrt()[..., None, :]) @ vecs.transpose(-1, -2)
    return cast(torch.Tensor, root.to(w.dtype))


_CHUNK = 128
"""Factor pairs drawn and scored at once: memory stays that of 128 pairs at any `n_samples`."""


def baseline(d_model: int, d_head: int, *, n_samples: int = 100, seed: int = 0) -> float:
    """Mean composition score of random Gaussian factors: writer `X1 Y1`, reader `X2 Y2` with
    `X [d_model, d_head]`, `Y [d_head, d_model]` (Elhage et al.'s baseline; the same shapes serve
    Q-, K- and V-composition).

    Drawn in chunks of 128 pairs (fp64; memory of 128 pairs at any `n_samples`, time linear in
    it); up to 128 pairs are one draw of the seeded generator.

    Raises:
        ValueError: sizes not positive, `n_samples` outside 1..100000 (`MAX_SAMPLES`), a bad seed.
    """
    check_int("d_model", d_model, lo=1)
    check_int("d_head", d_head, lo=1)
    check_int("n_samples", n_samples, lo=1, hi=MAX_SAMPLES)
    g = torch.Generator().manual_seed(check_seed("seed", seed))
    total = 0.0
    for start in range(0, n_samples, _CHUNK):
        n = min(_CHUNK, n_samples - start)
        x1, x2 = (torch.randn(n, d_model, d_head, generator=g, dtype=torch.float64) for _ in range(2))
        y1, y2 = (torch.randn(n, d_head, d_model, generator=g, dtype=torch.float64) for _ in range(2))
        p = _r(x1) @ y1  # [n, d, D]: ||X1 Y1 M|| = ||P M||
        s = x2 @ _r(y2.transpose(1, 2)).transpose(1, 2)  # [n, D, d]: ||M X2 Y2|| = ||M S||
        num = torch.linalg.matrix_norm(p @ s)
        den = torch.linalg.matrix_norm(p) * torch.linalg.matrix_norm(s)
        total += float((num / den).sum())
    return total / n_samples


def _folded(model: HeadModel, parts: LayerParts) -> dict[str, torch.Tensor]:
    """The layer's matrices with the norms' gains folded in (fp32): `Q [H, D, d]`, `K [G, D, d]`,
    `V [G, D, d]` (read through the input norm; QK-norm gains on the features), `O [H, d, D]`
    (times a post-norm's gain)."""
    H, G, d = model.n_heads, model.n_kv_heads, model.d_head
    q, k, v = parts.read(parts.W_Q), parts.read(parts.W_K), parts.read(parts.W_V)
    if parts.q_norm is not None and parts.k_norm is not None:
        q = q * parts.q_norm.gain.reshape(-1, d).expand(H, d)[:, None, :]
        k = k * parts.k_norm.gain.reshape(-1, d).expand(G, d)[:, None, :]
    return {"Q": q.float(), "K": k.float(), "V": v.float(), "O": parts.write().float()}


@torch.no_grad()
def composition_scores(
    model: HeadModel,
    *,
    readers: Sequence[tuple[int, int]] | Mapping[int, Sequence[int]] | HeadSet | None = None,
    subtract_baseline: bool = True,
    n_samples: int = 100,
    seed: int = 0,
) -> CompositionScores:
    """Q-, K- and V-composition between every pair of heads in different layers, from the
    weights (module docstring: the formulas, the folded norms, GQA, the RoPE caveat). Builds the
    `CompositionRequest` (its checks) and runs it (`run_composition`, as `heads.run` does).

    Args:
        model: a `HeadModel` of a family QK attribution accepts (`heads.scorers.qk.ACCEPTED`).
        readers: score only these reader heads `[(layer, head), ...]`, a `{layer: [heads]}`
            mapping or a `HeadSet` (the other readers' entries
            stay NaN; a few readers cost a few seconds instead of a minute on SmolLM2); default
            None: every head.
        subtract_baseline: compute the random baseline (default True); False leaves it 0.
        n_samples: random factor pairs averaged for the baseline (default 100; at most 100000,
            `MAX_SAMPLES`, drawn 128 at a time).
        seed: the baseline's seed (default 0).

    Returns:
        `CompositionScores` (`method="weights"`): `raw[kind]` `[L, H, L, H]` fp32 in [0, 1]
        (writer layer, writer head, reader layer, reader head; NaN unless the writer's layer is
        earlier), `baseline`, and `.q / .k / .v` (minus the baseline). This API is stable:
        training-dynamics studies read `.k[l1, h1, l2, h2]` (previous-token -> induction) across
        checkpoints.

    Raises:
        ValueError: a family it does not accept (multi-head latent attention named), an unknown
            reader head, bad `n_samples` / `seed`.
        TypeError: `subtract_baseline` not a bool.
    """
    request = CompositionRequest(
        method="weights",
        readers=cast("Sequence[tuple[int, int]] | None", readers),  # any head selection: normalised there
        subtract_baseline=subtract_baseline,
        n_samples=n_samples,
        seed=seed,
    )
    return run_composition(model, None, request)


def run_composition(
    model: HeadModel,
    prompts: Prompt | Sequence[Prompt] | EncodedPrompts | torch.Tensor | None,
    request: CompositionRequest,
    options: SweepOptions | None = None,
) -> CompositionScores:
    """Run a `CompositionRequest`: from the weights (`method="weights"`, no prompts:
    `composition_scores`) or on `prompts` (`method="data"`: `data_composition_scores`). What both
    functions do once they have built the request, whose values are checked there; its readers
    and the family are checked here against `model`; `options` takes no sweep option.

    Raises:
        HeadsteerValueError: prompts with `method="weights"`, none with `"data"`, and as the two
            functions.
        HeadsteerTypeError: `request` not a `CompositionRequest`, `model` not a `HeadModel`.
    """
    if not isinstance(request, CompositionRequest):
        raise HeadsteerTypeError(f"request must be a CompositionRequest, got {type(request).__name__}")
    sweep_options(options, {}, "composition_scores", takes=())
    if request.method == "data":
        if prompts is None:
            raise HeadsteerValueError("composition_scores(method='data') needs prompts as its input")
        return _data_scores(model, prompts, request)
    if prompts is not None:
        raise HeadsteerValueError(
            "composition_scores(method='weights') reads the weights only; pass no input"
        )
    check_qk_model(model)
    request.check_config(model)  # readers in range
    subtract_baseline, n_samples, seed = request.subtract_baseline, request.n_samples, request.seed
    L, H, d = model.n_layers, model.n_heads, model.d_head
    wanted: dict[int, list[int]] = {la: list(range(H)) for la in range(L)}
    if request.readers is not None:
        wanted = {}
        for la, h in request.readers:
            wanted.setdefault(la, []).append(h)
    grp = H // model.n_kv_heads
    kv = torch.arange(H) // grp
    mats = [_folded(model, layer_parts(model, la)) for la in range(L)]
    # writer side: P_i = R(W_V^{g(i)}) W_O^i  [d, D], ||W_OV^i|| = ||P_i||
    writers = torch.stack([_r(m["V"])[kv] @ m["O"] for m in mats])  # [L, H, d, D]
    w_norm = torch.linalg.matrix_norm(writers)  # [L, H]
    raw = {kind: torch.full((L, H, L, H), torch.nan) for kind in ("q", "k", "v")}
    for la in range(1, L):
        if la not in wanted:
            continue
        sel = torch.tensor(sorted(set(wanted[la])))
        m = mats[la]
        q, k, v, o = m["Q"][sel], m["K"][kv[sel]], m["V"][kv[sel]], m["O"][sel]
        n_r = len(sel)
        mats_r = {
            "q": q @ _r(k).transpose(1, 2),  # W_Q R(W_K)^T: ||W_QK|| = ||S||
            "k": k @ _r(q).transpose(1, 2),  # W_K R(W_Q)^T: W_QK^T
            "v": v @ _r(o.transpose(1, 2)).transpose(1, 2),  # W_V R(W_O^T)^T: W_OV
        }
        p = writers[:la].reshape(la * H * d, -1)  # [n_w d, D]
        s_all = torch.cat([s.permute(1, 0, 2).reshape(s.shape[1], -1) for s in mats_r.values()], 1)
        prod = (p @ s_all).reshape(la * H, d, 3, n_r, d)  # one GEMM: every writer x reader x kind
        num = prod.pow(2).sum((1, 4)).sqrt()  # [n_w, 3, n_r]
        for i, (kind, s) in enumerate(mats_r.items()):  # s [n_r, D, d]
            den = w_norm[:la].reshape(-1, 1) * torch.linalg.matrix_norm(s)[None]
            raw[kind][:la, :, la, sel] = (num[:, i] / den).reshape(la, H, n_r)
    base = baseline(model.d_model, d, n_samples=n_samples, seed=seed) if subtract_baseline else 0.0
    return CompositionScores(
        raw,
        base,
        "weights",
        getattr(model, "name", ""),
        model.n_kv_heads,
        {
            "folded": "input norm gain and centring, QK-norm gains, post-norm gain",
            "rope": "ignored",
            "n_samples": n_samples,
            "seed": seed,
            "readers": None if request.readers is None else [[a, b] for a, b in request.readers],
        },
    )


def _row(rec: Recording, n: int) -> Recording:
    return Recording(
        [r[n : n + 1] for r in rec.resid],
        [z[n : n + 1] for z in rec.z],
        {la: p[n : n + 1] for la, p in rec.pattern.items()},
        {},
    )


@torch.no_grad()
def data_composition_scores(
    model: HeadModel,
    prompts: Prompt | Sequence[Prompt] | EncodedPrompts | torch.Tensor,
    *,
    chat: bool = False,
) -> CompositionScores:
    """Composition measured on prompts, from the exact QK decomposition (RoPE included).

    For reader head j of layer l and writer head i of an earlier layer, over every prompt,
    query position t and visible key k <= t (causal, in the window):

    * Q: mean |scale * a_i(t) . k_j(k)| — writer i's share of j's query against j's whole key;
    * K: mean |scale * q_j(t) . b_i(k)| — j's whole query against i's share of its key;
    * V: mean over t of ||sum_u A_j[t, u] v_i(u) W_O^j|| — the norm of the part of j's output
      (as written to the residual) that comes from i through j's values (j's pattern frozen).

    Q and K are in logit units, V in residual-stream units (not comparable with the weight-based
    scores in [0, 1]); `baseline` is 0.

    Args:
        model: as `composition_scores`.
        prompts: as `qk_attribution` (text, `EncodedPrompts` or token ids).
        chat: apply the chat template to text prompts (default False).

    Returns:
        `CompositionScores` (`method="data"`), `raw[kind]` `[L, H, L, H]` fp32.

    Raises:
        ValueError: a refused family, empty prompts, ids outside the vocabulary, prompts longer
            than the model's context (before the forward).
    """
    return run_composition(model, prompts, CompositionRequest(method="data", chat=chat))


def _data_scores(
    model: HeadModel,
    prompts: Prompt | Sequence[Prompt] | EncodedPrompts | torch.Tensor,
    request: CompositionRequest,
) -> CompositionScores:
    """`data_composition_scores` of a checked `method="data"` request."""
    check_qk_model(model)
    request.check_config(model)
    chat = request.chat
    ids, mask, _ = encode_input(model, prompts, chat)
    L, H, G = model.n_layers, model.n_heads, model.n_kv_heads
    kv = torch.arange(H) // (H // G)
    parts = [layer_parts(model, la) for la in range(L)]
    rec = record(model, ids, mask, upto=L - 1, patterns=range(L))
    pos = position_ids(mask)
    sums = {kind: torch.zeros(L, H, L, H, dtype=torch.float64) for kind in ("q", "k", "v")}
    counts = torch.zeros(L, dtype=torch.float64)  # cells (Q, K) per layer
    n_pos = 0
    T = ids.shape[1]
    for n in range(ids.shape[0]):
        length = int(mask[n].sum())
        cols = torch.arange(T - length, T)[None]  # the prompt's real columns
        r = _row(rec, n)
        n_pos += length
        p = pos[n : n + 1][:, T - length :]
        every = components(model, r, parts[: L - 1], L - 1, cols, pos[n : n + 1])
        for la in range(1, L):
            comps = every.entering(la, r, cols)
            heads = [comps.names.index(f"L{a}H{b}") for a in range(la) for b in range(H)]
            sq = side(comps, parts[la], "q", list(range(H)), p)
            sk = side(comps, parts[la], "k", list(range(G)), p)
            sv = side(comps, parts[la], "v", list(range(G)), p)
            t = torch.arange(length)
            vis = t[None, :] <= t[:, None]
            w = model.sliding_window(la)
            if w is not None:
                vis = vis & (t[:, None] - t[None, :] < w)
            scale = parts[la].scaling
            a = sq.vectors[0, heads]  # [U, H, T, d]
            b = sk.vectors[0, heads][:, kv]  # [U, H, T, d] (each query head's KV head)
            qt, kt = sq.total[0], sk.total[0][kv]  # [H, T, d]
            qm = torch.einsum("uhtd,hkd->uhtk", a, kt).abs() * scale
            km = torch.einsum("htd,uhkd->uhtk", qt, b).abs() * scale
            sums["q"][:la, :, la] += (qm * vis).sum((-1, -2)).reshape(la, H, H)
            sums["k"][:la, :, la] += (km * vis).sum((-1, -2)).reshape(la, H, H)
            counts[la] += float(vis.sum())
            # V: j's output share from i = sum_u A_j[t, u] v_i(u), through W_O^j (post-norm gain)
            vv = sv.vectors[0, heads][:, kv]  # [U, H, T, d]
            pat = r.pattern[la][0]  # [H, T_pad, T_pad] -> the prompt's columns
            pat = pat[:, T - length :, T - length :]
            share = torch.einsum("htu,xhud->xhtd", pat, vv)
            out = torch.einsum("xhtd,hdD->xhtD", share, parts[la].write())
            sums["v"][:la, :, la] += out.norm(dim=-1).sum(-1).reshape(la, H, H)
    raw = {}
    for kind, s in sums.items():
        denom = counts if kind != "v" else torch.full((L,), float(n_pos), dtype=torch.float64)
        val = s / denom.clamp(min=1)[None, None, :, None]
        mask_l = torch.arange(L)[:, None] < torch.arange(L)[None, :]  # writer layer < reader layer
        raw[kind] = torch.where(mask_l[:, None, :, None], val, torch.nan).float()
    return CompositionScores(
        raw,
        0.0,
        "data",
        getattr(model, "name", ""),
        model.n_kv_heads,
        {
            "prompts": int(ids.shape[0]),
            "tokens": n_pos,
            "units": {"q": "logit", "k": "logit", "v": "residual"},
        },
    )
