"""QK attribution: why a head attends where it does, as an exact sum of component pairs.

For head h of layer l, a query position q and key positions k, the pre-softmax logit is
bilinear in the residual stream entering the layer. With every norm's scale frozen at its value
in the run (input norm per position, post-norm per position, QK-norm per head and position —
the frozen-scale convention of direct logit attribution), each side is affine in the residual's
components, so

    s(q, k) = scale * sum_{i, j} a_i(q) . b_j(k)        (before any soft-cap)

with `a_i(q)` component i's share of the query (rotated by q's RoPE) and `b_j(k)` component j's
share of the key (rotated by k's, shared by the query heads of one KV head under GQA); the
constant of each side (norm and projection biases) is the component `"bias"`. Gemma 2's
soft-cap `c tanh(s / c)` acts after the sum: the decomposition is of `s` before the cap.
Learned sinks (gpt-oss) are a separate softmax logit (`QKAttribution.sink`), not a cell.
ALiBi families are refused at load by the engine; multi-head latent attention is refused here.

`by="source_token"` splits each upstream head's marginal over the source positions that head
read: a head's output is `sum_u A[t, u] v(u) W_O`, so with its pattern frozen its share of the
query / key is a sum over u, exactly.

Sources: Elhage et al. 2021 (QK circuit, the residual stream as a sum of components); Kamath,
Ameisen et al. 2025, "Tracing Attention Computation Through Feature Interactions" (QK
attribution); TransformerLens' `decompose_resid` / `apply_ln_to_stack` (the frozen scale).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

import torch

from heads._util.validation import check_bool, is_int, short_repr
from heads.engine.options import SweepOptions, sweep_options
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, Prompt, encode_prompts, position_ids
from heads.inputs.tokens import readable_token
from heads.model.adapter import HeadModel
from heads.results.qk import QKAttribution
from heads.scorers.patching.pairs import PairBatch
from heads.scorers.qk.family import LayerParts, check_qk_model, layer_parts
from heads.scorers.qk.record import Recording, record
from heads.scorers.qk.request import BY, QKRequest, parse_head_text, qk_positions
from heads.scorers.qk.sides import Side, components, side
from heads.scorers.request_base import check_choice

__all__ = [
    "BY",
    "encode_input",
    "parse_head",
    "parse_head_text",
    "qk_attribution",
    "qk_attributions",
    "resolve_positions",
    "run_qk_attribution",
]


def parse_head(model: HeadModel, head: object) -> tuple[int, int]:
    """`(layer, head)` from a pair or a `"L.H"` / `"LL.HH"`-style string (`"5.1"` or
    `"L5.H1"`, `parse_head_text`), checked against `model`.

    Raises:
        ValueError: a malformed string or an unknown layer / head.
        TypeError: anything else.
    """
    if isinstance(head, str):
        pair = parse_head_text(head)
    elif isinstance(head, (tuple, list)) and len(head) == 2 and all(is_int(x) for x in head):
        pair = (int(head[0]), int(head[1]))
    else:
        raise HeadsteerTypeError(f"head must be (layer, head) or 'L.H', got {short_repr(head)}")
    model.check_head(*pair)
    return pair


def encode_input(
    model: HeadModel, prompts: object, chat: bool = False
) -> tuple[torch.Tensor, torch.Tensor, list[list[str]]]:
    """`(ids [N, T], mask [N, T], tokens)` from text prompts (with the model's tokenizer), an
    `EncodedPrompts`, a `PairBatch` (its clean prompts; pass `pairs.corrupted` for the other
    side), or token ids (`[T]` or `[N, T]` long, no padding).

    Raises:
        ValueError: empty prompts, ids outside the vocabulary, a prompt longer than the model's
            context, no tokenizer for text.
        TypeError: another kind of input.
    """
    tok = model.tokenizer
    if isinstance(prompts, PairBatch):  # its clean prompts (`pairs.corrupted` for the other side)
        prompts = prompts.clean
    if isinstance(prompts, EncodedPrompts):
        ids, mask = prompts.input_ids, prompts.attention_mask
    elif isinstance(prompts, torch.Tensor):
        if prompts.dtype not in (torch.int64, torch.int32) or prompts.dim() not in (1, 2):
            raise HeadsteerTypeError(
                "token ids must be an integer tensor [T] or [N, T], got "
                f"{prompts.dtype} of shape {tuple(prompts.shape)}"
            )
        ids = (prompts[None] if prompts.dim() == 1 else prompts).long()
        if ids.numel() == 0:
            raise HeadsteerValueError("empty prompt: no token ids")
        mask = torch.ones_like(ids)
    else:
        if tok is None:
            raise HeadsteerValueError("text prompts need a HeadModel with a tokenizer (or pass token ids)")
        check_bool("chat", chat)
        enc = encode_prompts(tok, prompts, chat=chat, markup=False)  # type: ignore[arg-type]
        ids, mask = enc.input_ids, enc.attention_mask
    if bool((mask.sum(1) == 0).any()):
        raise HeadsteerValueError("empty prompt: a row has no token")
    real = ids[mask.bool()]
    if int(real.min()) < 0 or int(real.max()) >= model.d_vocab:
        raise HeadsteerValueError(f"token ids must be in 0..{model.d_vocab - 1}")
    model.check_length(ids.shape[1])
    tokens = []
    for n in range(ids.shape[0]):
        row = ids[n][mask[n].bool()].tolist()
        tokens.append([readable_token(tok, i) for i in row] if tok is not None else [str(i) for i in row])
    return ids, mask, tokens


def resolve_positions(lengths: list[int], query: object, keys: object) -> tuple[torch.Tensor, torch.Tensor]:
    """`(queries [N, Q], keys [N, K])` token positions per prompt (negatives count from each
    prompt's end; `keys=None`: every position up to the last query, -1 past a prompt's end).

    Raises:
        ValueError: a position outside a prompt, a key after a query, a repeated position.
    """
    qs = qk_positions("query", query)  # the request's check
    ks = None if keys is None else qk_positions("keys", keys)
    out_q, out_k = [], []
    for n, length in enumerate(lengths):
        row = []
        for q in qs:
            p = q if q >= 0 else length + q
            if not 0 <= p < length:
                raise HeadsteerValueError(
                    f"query position {short_repr(q)} is outside prompt {n} (positions 0..{length - 1})"
                )
            row.append(p)
        if len(set(row)) != len(row):
            raise HeadsteerValueError(f"query positions repeat in prompt {n}: {row}")
        out_q.append(row)
        if ks is not None:
            krow = []
            for k in ks:
                p = k if k >= 0 else length + k
                if not 0 <= p < length:
                    raise HeadsteerValueError(
                        f"key position {short_repr(k)} is outside prompt {n} (positions 0..{length - 1})"
                    )
                if p > min(row):
                    raise HeadsteerValueError(
                        f"key {short_repr(k)} (position {p}) is after query {min(row)} in prompt {n}: a head "
                        "attends only to earlier positions"
                    )
                krow.append(p)
            if len(set(krow)) != len(krow):
                raise HeadsteerValueError(f"key positions repeat in prompt {n}: {krow}")
            out_k.append(krow)
    if ks is None:
        width = max(max(r) for r in out_q) + 1
        out_k = [[p if p <= max(r) else -1 for p in range(width)] for r in out_q]
    return torch.tensor(out_q), torch.tensor(out_k)


def _rows(x: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    return x[torch.arange(x.shape[0])[:, None], cols]


def _cells(t: torch.Tensor, qcols: torch.Tensor, kcols: torch.Tensor) -> torch.Tensor:
    """`t [N, T, T]` at rows `qcols [N, Q]` and columns `kcols [N, K]` -> `[N, Q, K]`."""
    n = torch.arange(t.shape[0])[:, None, None]
    return t[n, qcols[:, :, None], kcols[:, None, :]]


def _visible(model: HeadModel, layer: int, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    q, k = queries[:, :, None], keys[:, None, :]
    vis = (k >= 0) & (k <= q)
    w = model.sliding_window(layer)
    return vis & (q - k < w) if w is not None else vis


def _values(parts: LayerParts, x: torch.Tensor) -> torch.Tensor:
    """`[N, T, G, d]` the layer's values recomputed from its input residual `x [N, T, D]`."""
    y = x.double() if parts.in_norm is None else parts.in_norm.apply(x)
    v = torch.einsum("ntD,gDd->ntgd", y, parts.W_V)
    return v if parts.b_V is None else v + parts.b_V


def _source_side(
    model: HeadModel,
    rec: Recording,
    parts: list[LayerParts],
    sd: Side,
    kind: str,
    cols: torch.Tensor,
    against: torch.Tensor,
    scale: float,
    lengths: list[int],
) -> torch.Tensor:
    """`[N, P, R, U, T]`: each upstream head's marginal on one side of the head, split over the
    source positions it read (U = layer x H upstream heads, T = the longest prompt; source index
    = token position within the prompt).

    `sd` is the side of the one head (X = 1) at padded columns `cols [N, P]`; `against [N, R, d]`
    the other side's whole vectors (the marginal is `scale * share . against`). With head
    (l', h')'s pattern A frozen its share at position t is `sum_u A[t, u] v(u) W_O' ...`: the maps
    of `side` applied to each source's value vector.
    """
    N, P = cols.shape
    T = rec.resid[0].shape[1]
    H = model.n_heads
    ys, pats, invs = [], [], []
    for la in range(len(parts) - 1):
        pl = parts[la]
        v = _values(pl, rec.resid[la])[:, :, torch.arange(H) // (H // model.n_kv_heads)]  # [N, T, H, d]
        m = torch.einsum("hdD,De->hde", pl.write(), sd.w_read[0])  # [H, d, d]
        ys.append(torch.einsum("nuhd,hde->nhue", v, m))  # [N, H, T, d]
        pats.append(
            rec.pattern[la][torch.arange(N)[:, None, None], torch.arange(H)[None, :, None], cols[:, None, :]]
        )
        inv_o = torch.ones(N, P, dtype=torch.float64)
        if pl.out_norm is not None:
            pre = torch.einsum("nphd,hdD->npD", _rows(rec.z[la], cols), pl.W_O)
            inv_o = 1.0 / pl.out_norm.scale(pre if pl.b_O is None else pre + pl.b_O)
        invs.append(inv_o)
    U = len(ys) * H
    if not U:
        return torch.zeros(N, P, against.shape[1], 0, max(lengths), dtype=torch.float64)
    y = torch.cat(ys, 1)  # [N, U, T, d] each source's projected value
    pat = torch.cat(pats, 1)  # [N, U, P, T]
    coef = torch.stack(invs, 1).repeat_interleave(H, 1) * sd.inv[:, None, :]  # [N, U, P]
    # R_p(f * v) . w = v . (f * (B_p w)): rotate the other side instead of every source
    w = against[:, None].expand(N, P, -1, -1)  # [N, P, R, d]
    if sd.rot is not None:
        w = torch.einsum("npij,nprj->npri", sd.rot, w)
    if sd.qk_factor is not None:
        w = w * sd.qk_factor[:, 0, :, None, :]
    res = torch.einsum("nutd,nprd->nprut", y, w) * scale
    res = res * (coef[..., None] * pat).permute(0, 2, 1, 3)[:, :, None]  # [N, P, 1, U, T]
    out = torch.zeros(N, P, against.shape[1], U, max(lengths), dtype=torch.float64)
    for n, length in enumerate(lengths):
        out[n, ..., :length] = res[n, ..., T - length :]
    return out


@torch.no_grad()
def qk_attribution(
    model: HeadModel,
    prompts: Prompt | Sequence[Prompt] | EncodedPrompts | PairBatch | torch.Tensor,
    head: tuple[int, int] | str,
    *,
    query: int | Sequence[int] = -1,
    keys: int | Sequence[int] | None = None,
    by: str = "component",
    chat: bool = False,
) -> QKAttribution:
    """Decompose head `head`'s attention logits at (query, key) cells into query-side x key-side
    component terms (module docstring: the math and the frozen-scale convention). Builds the
    `QKRequest` (its checks) and runs it (`run_qk_attribution`, as `heads.run` does).

    Args:
        model: a `HeadModel` of an accepted family (`heads.scorers.qk.family.ACCEPTED`: Llama,
            Mistral, Qwen 2 / 3, Gemma 1 / 2 / 3, OLMo 2, GPT-2, Phi-3, gpt-oss), transformers or
            nnsight backend.
        prompts: a string, a chat, a list of them (encoded with the model's tokenizer, `chat`
            template only if asked), an `EncodedPrompts`, a `PairBatch` (its clean prompts;
            `pairs.corrupted` for the corrupted side), or token ids `[T]` / `[N, T]`.
        head: `(layer, head)` or `"L.H"`.
        query: query position(s), token indices within each prompt (negative: from its end;
            default -1, the last token).
        keys: key position(s) (each at or before every query), or None (default): every position
            up to the query.
        by: `"component"` (default) or `"source_token"`: also split each upstream head's
            marginal over the source positions it read (`QKAttribution.sources`; one more
            pattern per layer is recorded: for short prompts).
        chat: apply the tokenizer's chat template to text prompts (default False: positions are
            those of the text itself).

    Returns:
        a `QKAttribution`: per prompt, the `[C + 1]` component vectors of each side
        (`q_side [N, C + 1, Q, d]`, `k_side [N, C + 1, K, d]`, fp64), the model's own logits and
        pattern at the cells; `terms()`, marginals, `score()`, `max_error()` (the sum of terms
        against the model's logits: ~1e-6 in fp32), `top_pairs()`, `head_scores()`.

    Raises:
        ValueError: an unknown head, a position outside a prompt, a key after a query, empty
            prompts, an unknown `by`, a refused family (multi-head latent attention named) —
            all before the forward.
        TypeError: a head or prompts of the wrong type.
    """
    request = QKRequest(head=head, query=query, keys=keys, by=by, chat=chat)
    return run_qk_attribution(model, prompts, request)


def run_qk_attribution(
    model: HeadModel,
    prompts: Prompt | Sequence[Prompt] | EncodedPrompts | PairBatch | torch.Tensor,
    request: QKRequest,
    options: SweepOptions | None = None,
) -> QKAttribution:
    """Run a `QKRequest` on `prompts` (what `qk_attribution` does once it has built the request:
    its values are checked there, its head and the family here against `model`; `options` takes
    no sweep option: one recording forward; see `qk_attribution` for the rest)."""
    if not isinstance(request, QKRequest):
        raise HeadsteerTypeError(f"request must be a QKRequest, got {type(request).__name__}")
    sweep_options(options, {}, "qk_attribution", takes=())
    check_qk_model(model)
    request.check_config(model)  # the head in range
    pair = cast("tuple[int, int]", request.head)
    ids, mask, tokens = encode_input(model, prompts, request.chat)
    queries, keyp = resolve_positions(mask.sum(1).tolist(), request.query, request.keys)
    return next(_attribute(model, ids, mask, tokens, [pair], queries, keyp, request.by, request.chat))


def _check_by(by: object) -> None:
    check_choice("by", by, BY)


def qk_attributions(
    model: HeadModel,
    prompts: Prompt | Sequence[Prompt] | EncodedPrompts | torch.Tensor,
    heads: Sequence[tuple[int, int]] | None = None,
    *,
    query: int | Sequence[int] = -1,
    keys: int | Sequence[int] | None = None,
    by: str = "component",
    chat: bool = False,
) -> Iterator[QKAttribution]:
    """`qk_attribution` of many heads from one forward: yields one `QKAttribution` per head, in
    layer order (heads of one layer share their components; a KV group its key side).

    Args:
        heads: `[(layer, head), ...]` (default None: every head of the model).
        query, keys, by, chat: as `qk_attribution`.

    Returns:
        an iterator (consume it head by head to keep memory at one layer's results: each holds
        its `k_side [N, C + 1, K, d]`).

    Raises:
        HeadsteerValueError: as `qk_attribution`, at the call (before the forward, which runs
            at the first item).
    """
    check_qk_model(model)
    if heads is None:
        pairs = [(la, h) for la in range(model.n_layers) for h in range(model.n_heads)]
    else:
        if isinstance(heads, (str, bytes)) or not isinstance(heads, Sequence) or not heads:
            raise HeadsteerValueError(
                f"heads must be a non-empty list of (layer, head), got {short_repr(heads)}"
            )
        pairs = sorted({parse_head(model, x) for x in heads})
    _check_by(by)
    ids, mask, tokens = encode_input(model, prompts, chat)
    queries, keyp = resolve_positions(mask.sum(1).tolist(), query, keys)
    return _attribute(model, ids, mask, tokens, pairs, queries, keyp, by, chat)


@torch.no_grad()
def _attribute(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    tokens: list[list[str]],
    heads: list[tuple[int, int]],
    queries: torch.Tensor,
    keyp: torch.Tensor,
    by: str,
    chat: bool,
) -> Iterator[QKAttribution]:
    """One recording forward for every head in `heads` (sorted by layer), then each layer's
    sides for its heads at once."""
    lengths = mask.sum(1).tolist()
    top = max(la for la, _ in heads)
    by_layer: dict[int, list[int]] = {}
    for la, h in heads:
        by_layer.setdefault(la, []).append(h)
    sources = by == "source_token"
    T = ids.shape[1]
    pad = torch.tensor([T - n for n in lengths])[:, None]
    qcols = pad + queries
    kcols = pad + keyp.clamp(min=0)
    parts = [layer_parts(model, la) for la in range(top + 1)]
    rec = record(
        model,
        ids,
        mask,
        upto=top,
        patterns=range(top + 1) if sources else sorted(by_layer),
        logits=by_layer,
        rows=qcols,
        full_patterns=sources,
    )
    pos = position_ids(mask)
    valid = (keyp[:, None, :] >= 0) & (keyp[:, None, :] <= queries[:, :, None])
    kidx = kcols[:, None, :].expand(-1, queries.shape[1], -1)
    params = {"by": by, "chat": chat, "frozen_scale": True, "cap": "after the sum"}
    # each layer's components once, for the deepest layer asked; shallower layers read a prefix
    all_q = components(model, rec, parts[:top], top, qcols, pos)
    same = qcols.shape == kcols.shape and bool(torch.equal(qcols, kcols))  # e.g. every cell of a head
    all_k = all_q if same else components(model, rec, parts[:top], top, kcols, pos)
    for layer in sorted(by_layer):
        hs = by_layer[layer]
        kvs = sorted({model.kv_head(h) for h in hs})
        pl = parts[layer]
        sq = side(all_q.entering(layer, rec, qcols), pl, "q", hs, _rows(pos, qcols))
        sk = side(all_k.entering(layer, rec, kcols), pl, "k", kvs, _rows(pos, kcols))
        names = [n for n in sq.names if n.startswith("L") and "H" in n]
        for i, h in enumerate(hs):
            g = model.kv_head(h)
            j = kvs.index(g)
            lg = rec.logits[layer][:, i].gather(2, kidx)  # [N, Q, K]
            pat = rec.pattern[layer][:, h]  # [N, T, T] (source split) or [N, Q, T]
            pat = _cells(pat, qcols, kcols) if sources else pat.gather(2, kidx)
            src = None
            if sources:
                one_q = _one(sq, i)
                one_k = _one(sk, j)
                src = {
                    "query": _source_side(
                        model,
                        rec,
                        parts[: layer + 1],
                        one_q,
                        "q",
                        qcols,
                        one_k.total[:, 0],
                        pl.scaling,
                        lengths,
                    ),
                    "key": _source_side(
                        model,
                        rec,
                        parts[: layer + 1],
                        one_k,
                        "k",
                        kcols,
                        one_q.total[:, 0],
                        pl.scaling,
                        lengths,
                    ).transpose(1, 2),
                }
            yield QKAttribution(
                model=getattr(model, "name", ""),
                layer=layer,
                head=h,
                kv_head=g,
                n_layers=model.n_layers,
                n_heads=model.n_heads,
                n_kv_heads=model.n_kv_heads,
                names=sq.names,
                queries=queries,
                keys=keyp,
                q_side=sq.vectors[:, :, i],
                k_side=sk.vectors[:, :, j],
                scale=pl.scaling,
                logits=torch.where(valid, lg, torch.nan),
                pattern=torch.where(valid, pat, torch.nan),
                visible=_visible(model, layer, queries, keyp),
                softcap=pl.softcap,
                sink=None if pl.sinks is None else float(pl.sinks[h]),
                sources=src,
                source_heads=names if sources else [],
                tokens=tokens,
                params=dict(params),
            )
        del sq, sk


def _one(sd: Side, i: int) -> Side:
    """The side of head i alone (X = 1)."""
    return Side(
        sd.vectors[:, :, i : i + 1],
        sd.names,
        sd.total[:, i : i + 1],
        sd.inv,
        None if sd.qk_factor is None else sd.qk_factor[:, i : i + 1],
        sd.w_read[i : i + 1],
        sd.rot,
    )
