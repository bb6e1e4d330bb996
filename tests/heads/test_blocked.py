"""The blocked kernel's SDPA path for logit biases (PASTA-like): exact against a dense oracle,
and the mask it hands SDPA is never as wide as the heads (issue 29, item 7)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F  # noqa: N812

from heads.engine import state
from heads.engine.edits import AttentionCall, LogitBias, ProbEdit, Recorder
from heads.engine.kernels.blocked import blocked_attention
from heads.engine.kernels.common import AttentionInputs, own_sdpa
from heads.engine.state import MIN_LOGIT, LayerEdits

B, H, G, Q, PAST, D = 3, 6, 2, 10, 4, 8
K = PAST + Q


@dataclass(eq=False, repr=False)
class TableBias(LogitBias):
    """A fixed bias `table` (broadcastable to `[B, H, Q, K]`; rows `q_offset..` taken when it has Q rows)."""

    per_column: ClassVar[bool] = False
    table: torch.Tensor | None = None

    def bias(self, call: AttentionCall) -> torch.Tensor:
        assert self.table is not None
        if self.table.shape[-2] == 1:
            return self.table
        return self.table[..., call.q_offset - PAST : call.q_offset - PAST + call.q_len, :]


def _inputs(seed: int = 0) -> AttentionInputs:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Q, D, generator=g)
    k, v = torch.randn(B, G, K, D, generator=g), torch.randn(B, G, K, D, generator=g)
    pos = torch.arange(PAST, K)[:, None]
    causal = torch.arange(K)[None, :] <= pos  # [Q, K]
    pad = torch.ones(B, K, dtype=torch.bool)
    pad[1, :3] = False  # row 1 left-padded by 3, row 2 by 1
    pad[2, :1] = False
    mask = causal[None, None] & pad[:, None, None, :]
    return AttentionInputs(q, k, v, mask, D**-0.5, q_offset=PAST)


def _biases() -> list[TableBias]:
    g = torch.Generator().manual_seed(1)
    rows = torch.zeros(B, H, dtype=torch.bool)  # each row its own heads (a server batch)
    rows[0, [0, 2]] = True
    rows[2, [2, 3]] = True
    column = TableBias(layer=0, row_heads=rows, table=torch.randn(B, 1, 1, K, generator=g))
    shared = TableBias(layer=0, heads=[2, 5], table=torch.randn(1, 1, 1, K, generator=g))
    return [column, shared]


def _oracle(inputs: AttentionInputs, biases: list[TableBias]) -> torch.Tensor:
    """Dense float64 attention: logits + the model's mask + every bias on its (row, head) pairs."""
    q = inputs.query.double()
    k = inputs.key.double().repeat_interleave(H // G, 1)
    v = inputs.value.double().repeat_interleave(H // G, 1)
    assert inputs.mask is not None
    scores = q @ k.transpose(-1, -2) * inputs.scaling
    add = torch.where(inputs.mask, 0.0, MIN_LOGIT).double().expand(B, H, Q, K)
    for e in biases:
        assert e.table is not None
        on = e.head_mask(B, H, torch.device("cpu"))[:, :, None, None]
        add = add + torch.where(on, e.table.double(), 0.0)
    return (torch.softmax(scores + add, -1) @ v).transpose(1, 2)  # [B, Q, H, d]


def _layer(biases: list[TableBias]) -> LayerEdits:
    return LayerEdits(0, H, sites={"logits": list(biases)})


def test_biased_sdpa_matches_dense_oracle_and_leaves_other_heads_the_models(monkeypatch):
    monkeypatch.setattr(state, "QUERY_BLOCK", 4)  # three query blocks of 4, 4, 2 rows
    inputs = _inputs()
    biases = _biases()
    out, pattern = blocked_attention(None, inputs, _layer(biases))  # type: ignore[arg-type]
    assert pattern is None and out is not None and out.shape == (B, Q, H, D)
    want = _oracle(inputs, biases)
    assert torch.allclose(out.double(), want, atol=1e-5), float((out.double() - want).abs().max())
    # heads 1 and 4 carry no bias in any row: bitwise the model's own SDPA
    rest = torch.tensor([1, 4])
    own = own_sdpa(
        inputs.query[:, rest],
        inputs.key[:, rest // (H // G)],
        inputs.value[:, rest // (H // G)],
        inputs.mask,
        inputs.scaling,
        True,
    )
    assert torch.equal(out[:, :, rest], own.transpose(1, 2))
    assert all(e.calls == 1 for e in biases)


def test_biased_sdpa_mask_is_never_per_head_for_shared_biases(monkeypatch):
    """PASTA-like biases (`[B|1, 1, 1, K]`) reach SDPA as masks `[B, 1, Q_blk, K]` at most:
    no `[B, H, Q, K]` tensor, whatever rows and heads they edit."""
    monkeypatch.setattr(state, "QUERY_BLOCK", 4)
    seen: list[tuple[int, ...]] = []
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, **kw):
        seen.append(tuple(attn_mask.shape) if attn_mask is not None else ())
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    blocked_attention(None, _inputs(), _layer(_biases()))  # type: ignore[arg-type]
    masks = [s for s in seen if s]
    # the untouched heads' call (the model's mask, all Q rows) and one call per head group and block
    assert masks and all(s[1] == 1 for s in masks), masks
    assert sum(s[-2] == Q for s in masks) == 1 and max(s[-2] for s in masks if s[-2] != Q) == 4
    # a per-head bias [1, H, Q, K] gives masks only as wide as the heads of its group
    dense = TableBias(layer=0, heads=[0, 3], table=torch.randn(1, H, Q, K))
    seen.clear()
    out, _ = blocked_attention(None, _inputs(), _layer([dense]))  # type: ignore[arg-type]
    assert out is not None
    assert {s[1] for s in seen if s} == {1, 2}  # rest heads: the model's mask; heads 0, 3: 2 wide
    assert torch.allclose(out.double(), _oracle(_inputs(), [dense]), atol=1e-5)


def test_biased_sdpa_bounds_the_mask_block_and_never_copies_every_heads_qkv(monkeypatch):
    """Knockout on every head below `FUSED_MIN_ROWS_CPU` rows: SDPA gets masks of at most
    `BIAS_BLOCK_ELEMENTS` entries (not `[1, 1, QUERY_BLOCK, K]`: 1.47x a plain forward's peak at
    1k tokens on SmolLM2) and the layer's own key and value (SDPA's GQA, no indexed copy), and
    the output equals a dense float64 oracle. The block bounds are shrunk here as QUERY_BLOCK is in
    the tests above."""
    from heads.engine.knockout import KnockoutBias

    monkeypatch.setattr(state, "BIAS_BLOCK_ELEMENTS", 2**16)  # blocks of 109 rows (read at call time)
    monkeypatch.setattr(state, "BIAS_BLOCK_MIN_ROWS", 64)
    b, h, g, t, d = 1, 6, 2, 600, 8
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(b, h, t, d, generator=gen)
    k, v = torch.randn(b, g, t, d, generator=gen), torch.randn(b, g, t, d, generator=gen)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    inputs = AttentionInputs(q, k, v, mask, d**-0.5, q_offset=0)
    keys = torch.zeros(b, t, dtype=torch.bool)
    keys[0, 100:140] = True
    knockout = KnockoutBias(layer=0, keys=keys)
    seen: list[tuple[tuple[int, ...], bool]] = []
    real = F.scaled_dot_product_attention

    def sdpa(q_, k_, v_, attn_mask=None, **kw):
        seen.append((tuple(attn_mask.shape), k_.data_ptr() == k.data_ptr() and v_.data_ptr() == v.data_ptr()))
        return real(q_, k_, v_, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    out, _ = blocked_attention(None, inputs, LayerEdits(0, h, sites={"logits": [knockout]}))  # type: ignore[arg-type]
    assert out is not None and len(seen) > 1
    assert all(shape[0] * shape[1] * shape[2] * shape[3] <= state.BIAS_BLOCK_ELEMENTS for shape, _ in seen)
    assert all(own for _, own in seen), seen  # the layer's key and value themselves
    assert sum(shape[2] for shape, _ in seen) == t  # every query row once
    kk, vv = k.double().repeat_interleave(h // g, 1), v.double().repeat_interleave(h // g, 1)
    scores = q.double() @ kk.transpose(-1, -2) * d**-0.5
    blocked = mask & ~keys[:, None, None, :]
    want = (torch.softmax(scores.masked_fill(~blocked, float("-inf")), -1) @ vv).transpose(1, 2)
    assert torch.allclose(out.double(), want, atol=1e-5), float((out.double() - want).abs().max())


@dataclass(eq=False, repr=False)
class _Halve(ProbEdit):
    """A pattern edit that changes the pattern: head 1's probabilities halved."""

    def apply(self, probs: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        out = probs.clone()
        out[:, 1] *= 0.5
        return out


def test_in_place_blocks_without_autograd_equal_the_autograd_path(monkeypatch):
    """Without autograd the explicit path scales, soft-caps, masks and zeroes each block's logits and
    pattern in place: bitwise the out-of-place operations it runs with autograd on (soft-cap,
    learned sinks, padding, a logit bias, a reader and a pattern edit; several query blocks)."""
    monkeypatch.setattr(state, "QUERY_BLOCK", 4)
    base = _inputs(seed=3)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(4))
    for softcap, sink in ((None, None), (5.0, None), (None, sinks), (5.0, sinks)):
        inputs = AttentionInputs(
            base.query, base.key, base.value, base.mask, base.scaling, softcap, sinks=sink, q_offset=PAST
        )
        runs = []
        for grad in (False, True):
            seen: list[torch.Tensor] = []
            rec = Recorder(layer=0, fn=lambda p, call, seen=seen: seen.append(p.clone()))
            edits = LayerEdits(0, H, sites={"logits": _biases(), "probs": [rec, _Halve(layer=0)]})
            with torch.set_grad_enabled(grad):
                out, pattern = blocked_attention(None, inputs, edits, want_probs=True)  # type: ignore[arg-type]
            runs.append((out, pattern, seen))
        (out0, pat0, seen0), (out1, pat1, seen1) = runs
        assert out0 is not None and out1 is not None and pat0 is not None and pat1 is not None
        assert torch.equal(out0, out1) and torch.equal(pat0, pat1), softcap
        assert len(seen0) == 3 and all(torch.equal(a, b) for a, b in zip(seen0, seen1, strict=True))
        assert (pat0[1, :, :, :3] == 0).all()  # row 1's padded keys: exactly 0
