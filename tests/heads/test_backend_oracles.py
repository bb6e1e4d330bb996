"""The TransformerLens and nnsight backends against each library's own computation.

tests/heads/test_backends.py checks that every backend gives what the plain HF path gives; here
each edit run through headsteer on a backend is checked against the same intervention written
with that library's own tools, without headsteer: TransformerLens `run_with_hooks` on the
bridge's hook points (`hook_z`, `hook_q`, `hook_pattern`, `hook_attn_scores`, `hook_resid_pre`)
and an nnsight `trace()` that sets module inputs and outputs (head outputs at the `o_proj` input,
queries at the `q_proj` output, the residual entering a layer). Each prompt runs alone in the
oracle (no padding); headsteer runs the left-padded batch.
"""

from __future__ import annotations

import math

import pytest
import torch

from heads import HeadScale, QueryScale, editing, encode_prompts, forward
from steer import Pasta
from tests.heads.test_backends import PROMPTS, ZeroRow, _AddResidual, _three

TOL = 2e-5
D_HEAD = 16
PASTA_HEADS, ALPHA = {1: [0, 1], 2: [3]}, 0.01


@pytest.fixture(scope="module")
def models(tokenizer):
    return _three(tokenizer)


@pytest.fixture(scope="module")
def enc(tokenizer):
    return encode_prompts(tokenizer, PROMPTS, chat=False)


def _rows(enc):
    """(token ids `[1, T_b]` without padding, padding width) of each row."""
    out = []
    for b in range(enc.batch):
        real = enc.attention_mask[b].bool()
        out.append((enc.input_ids[b][real][None], int((~real).sum())))
    return out


def _vec(d: int) -> torch.Tensor:
    return 0.5 * torch.arange(d, dtype=torch.float32) / d  # as _AddResidual


def _headsteer(m, enc, edits):
    with editing(m, edits):
        return forward(m, enc)


def _check(got: torch.Tensor, want: list[torch.Tensor], enc, base: torch.Tensor) -> None:
    moved = 0.0
    for b, (_, pad) in enumerate(_rows(enc)):
        assert float((got[b, pad:] - want[b]).abs().max()) <= TOL, b
        moved = max(moved, float((got[b, pad:] - base[b, pad:]).abs().max()))
    assert moved > 1e-3  # the edit changed the logits


def _tl_hooks(site: str, enc, b: int, pad: int):
    """TransformerLens forward hooks doing the edit `site` on row `b` (unpadded)."""

    def z(t, hook):
        t = t.clone()
        t.view(*t.shape[:2], -1, D_HEAD)[:, :, 2] = 0.0
        return t

    def q(t, hook):
        t = t.clone()
        t.view(*t.shape[:2], -1, D_HEAD)[:, :, 1] *= 0.5
        return t

    def pattern(t, hook):
        t = t.clone()
        t[:, 0] = 0.0
        return t

    def resid(t, hook):
        return t + _vec(t.shape[-1])

    def scores(heads):
        def hook_fn(t, hook):  # log(alpha) on the prompt columns outside the emphasised spans
            t = t.clone()
            keep = torch.zeros(t.shape[-1], dtype=torch.bool)
            for t0, t1 in enc.spans[b]:
                keep[t0 - pad : t1 - pad] = True
            t[:, heads] = t[:, heads] + torch.where(keep, 0.0, math.log(ALPHA))
            return t

        return hook_fn

    if site == "head_output":
        return [("blocks.1.attn.hook_z", z)]
    if site == "query":
        return [("blocks.0.attn.hook_q", q)]
    if site == "probs":
        return [("blocks.1.attn.hook_pattern", pattern)]
    if site == "residual":
        return [("blocks.2.hook_resid_pre", resid)]
    return [(f"blocks.{la}.attn.hook_attn_scores", scores(hs)) for la, hs in PASTA_HEADS.items()]


EDITS = {
    "head_output": lambda m, enc: [HeadScale(layer=1, heads=[2], factor=0.0)],
    "query": lambda m, enc: [QueryScale(layer=0, heads=[1], factor=0.5)],
    "probs": lambda m, enc: [ZeroRow(layer=1, heads=[0])],
    "residual": lambda m, enc: [_AddResidual(layer=2)],
    "logits": lambda m, enc: Pasta(heads=PASTA_HEADS, alpha=ALPHA).edits(m, enc),
}


@pytest.mark.parametrize("site", list(EDITS))
def test_transformer_lens_backend_equals_run_with_hooks(models, enc, site):
    m = models["transformer_lens"]
    bridge = m.backend.native
    got = _headsteer(m, enc, EDITS[site](m, enc))
    want = []
    with torch.no_grad():
        for b, (ids, pad) in enumerate(_rows(enc)):
            want.append(bridge.run_with_hooks(ids, fwd_hooks=_tl_hooks(site, enc, b, pad))[0])
    _check(got, want, enc, forward(m, enc))


def _nnsight_edit(ns, site: str) -> None:
    """Inside a trace: the edit `site` set on the modules' inputs and outputs."""
    layers = ns.model.layers
    if site == "head_output":
        layers[1].self_attn.o_proj.input[..., 2 * D_HEAD : 3 * D_HEAD] = 0.0
    elif site == "query":
        out = layers[0].self_attn.q_proj.output
        out[..., D_HEAD : 2 * D_HEAD] = out[..., D_HEAD : 2 * D_HEAD] * 0.5
    else:
        layers[2].input = layers[2].input + _vec(64)


@pytest.mark.parametrize("site", ["head_output", "query", "residual"])
def test_nnsight_backend_equals_a_trace(models, enc, site):
    m = models["nnsight"]
    ns = m.backend.native
    got = _headsteer(m, enc, EDITS[site](m, enc))
    want = []
    with torch.no_grad():
        for ids, _ in _rows(enc):
            with ns.trace(ids):
                _nnsight_edit(ns, site)
                logits = ns.lm_head.output.save()
            want.append(logits[0])
    _check(got, want, enc, forward(m, enc))
