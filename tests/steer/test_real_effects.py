"""Each steering method's effect on the embedded SmolLM2-135M-Instruct, by the amount its formula
gives on the recorded attention pattern, head outputs or residual stream (as the PASTA test in
tests/heads/test_real_model.py), and MAPS' relation scores by their formula on the real weights.

One short prompt, one or two forwards per method; an edited layer is the only edited one, so the
unedited forward gives the pattern the edit starts from.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch

from heads import HeadModel, Recorder, editing, encode_prompts, forward
from heads.engine.edits import HeadOutputEdit, LogitBias, ResidualRecorder
from heads.scorers.maps.static import RelationPairs, maps_scores
from steer import Caa, InstaBoost, Knockout, ScalingVis
from steer.iti import Iti
from steer.vhr.method import Vhr

pytestmark = pytest.mark.real

PROMPT = "Reply briefly. **Always answer in French.** What is the capital of Italy? The answer is"
LAYER = 5


@pytest.fixture(scope="module")
def enc(smol):
    return encode_prompts(smol.tokenizer, PROMPT, chat=False)


@dataclass(eq=False, repr=False)
class _ZRecorder(HeadOutputEdit):
    """Test edit: records the head outputs z `[B, T, H, d_head]` it sees (unchanged)."""

    records: list = field(default_factory=list, init=False)

    def apply(self, z, call):
        self.records.append(z.detach().clone())
        return z


@dataclass(eq=False, repr=False)
class _ScoreRecorder(LogitBias):
    """Test edit: records the raw attention logits `[B, H, Q, K]` (scaled, before the mask); adds 0."""

    reads_scores: ClassVar[bool] = True
    records: list = field(default_factory=list, init=False)

    def score_bias(self, scores, call):
        self.records.append(scores.detach().clone())
        return torch.zeros_like(scores)


@torch.no_grad()
def _patterns(hm, enc, edits, layer=LAYER):
    """`[H, T, T]` pattern of `layer` without and with `edits` (two forwards)."""
    base, after = Recorder(layer=layer), Recorder(layer=layer)
    with editing(hm, [base]):
        forward(hm, enc)
    with editing(hm, [*edits, after]):
        forward(hm, enc)
    return base.records[0][0], after.records[0][0]


def test_instaboost_multiplies_the_span_attention(smol, enc):
    """A'_ij = M^[j in G] A_ij / sum_k M^[k in G] A_ik, every head and row of the boosted layer."""
    m = 5.0
    g = enc.span_mask()[0]
    w, w2 = _patterns(smol, enc, InstaBoost(multiplier=m, layers=[LAYER]).edits(smol, enc))
    boosted = w * torch.where(g, m, 1.0)
    want = boosted / boosted.sum(-1, keepdim=True)
    torch.testing.assert_close(w2, want, atol=1e-5, rtol=0)
    assert float((w2[:, -1, g].sum(-1) - w[:, -1, g].sum(-1)).min()) > 0  # every head's share rises


def test_knockout_removes_the_span_and_renormalises(smol, enc):
    """The last row's attention on the span becomes 0, the rest is divided by 1 - s; other rows
    are unchanged (Geva et al. 2023, Sec. 3)."""
    g = enc.span_mask()[0]
    w, w2 = _patterns(smol, enc, Knockout(keys="span", queries=[-1], layers=[LAYER]).edits(smol, enc))
    last = w[:, -1] * ~g
    torch.testing.assert_close(w2[:, -1], last / last.sum(-1, keepdim=True), atol=1e-5, rtol=0)
    assert float(w[:, -1, g].sum(-1).max()) > 1e-2  # there was attention to remove
    torch.testing.assert_close(w2[:, :-1], w[:, :-1], atol=1e-6, rtol=0)


def test_scalingvis_multiplies_the_last_rows_logits_on_the_span(smol, enc):
    """S'_{P-1, j} = alpha S_{P-1, j} on the span (text target); the pattern is softmax(S')."""
    alpha = 1.6
    g = enc.span_mask()[0]
    scores = _ScoreRecorder(layer=LAYER)
    base, after = Recorder(layer=LAYER), Recorder(layer=LAYER)
    with torch.no_grad():
        with editing(smol, [scores, base]):
            forward(smol, enc)
        with editing(
            smol, [*ScalingVis(weight=alpha, target="text", layers=(LAYER,)).edits(smol, enc), after]
        ):
            forward(smol, enc)
    s = scores.records[0][0, :, -1]  # [H, K]: the last row sees every column
    w, w2 = base.records[0][0], after.records[0][0]
    torch.testing.assert_close(s.softmax(-1), w[:, -1], atol=1e-5, rtol=0)  # the recorded logits
    want = torch.where(g, alpha * s, s).softmax(-1)
    torch.testing.assert_close(w2[:, -1], want, atol=1e-5, rtol=0)
    assert float((w2[:, -1] - w[:, -1]).abs().max()) > 1e-3
    torch.testing.assert_close(w2[:, :-1], w[:, :-1], atol=1e-6, rtol=0)


@torch.no_grad()
def test_caa_adds_coefficient_times_vector_from_the_last_token(smol, enc):
    v = torch.randn(smol.d_model, generator=torch.Generator().manual_seed(0))
    c = 2.5
    before, after = ResidualRecorder(layer=LAYER + 1), ResidualRecorder(layer=LAYER + 1)
    with editing(smol, [before, *Caa(vector=v, layer=LAYER, coefficient=c).edits(smol, enc), after]):
        forward(smol, enc)
    x, x2 = before.records[0][0], after.records[0][0]
    torch.testing.assert_close(x2[-1] - x[-1], c * v, atol=1e-5, rtol=0)
    assert torch.equal(x2[:-1], x[:-1])


@torch.no_grad()
def test_iti_shifts_head_outputs_by_alpha_sigma_theta(smol, enc):
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(2, smol.d_head, generator=g)
    theta = theta / theta.norm(dim=-1, keepdim=True)
    sigmas, alpha = torch.tensor([0.5, 1.5]), 15.0
    before, after = _ZRecorder(layer=LAYER), _ZRecorder(layer=LAYER)
    iti = Iti(heads=[(LAYER, 1), (LAYER, 4)], directions=theta, sigmas=sigmas, alpha=alpha)
    with editing(smol, [before, *iti.edits(smol, enc), after]):
        forward(smol, enc)
    z, z2 = before.records[0][0], after.records[0][0]  # [T, H, d]
    shift = torch.zeros_like(z[-1])
    shift[[1, 4]] = alpha * sigmas[:, None] * theta
    torch.testing.assert_close(z2[-1] - z[-1], shift, atol=1e-5, rtol=0)
    assert torch.equal(z2[:-1], z[:-1])


@torch.no_grad()
def test_vhr_text_measures_vhd_and_scales_the_selected_heads_by_alpha(smol, enc):
    """VHD of layer 1 = ||z(with context) - z(without)|| at the last position (two plain runs);
    the heads above the median are scaled by alpha in the steered forward."""
    alpha = 2.0
    vhr = Vhr(layers=(1,), alpha=alpha)
    edits = vhr.edits(smol, enc)
    sel = vhr.last["selection"]
    ids = enc.input_ids[0]
    t0, t1 = enc.spans[0][0]
    outs = []
    for x in (ids[None], torch.cat([ids[:t0], ids[t1:]])[None]):
        seen: list = []
        hook = smol.out_projs[1].register_forward_pre_hook(lambda m, a, seen=seen: seen.append(a[0][0, -1]))
        try:
            smol.model(input_ids=x)
        finally:
            hook.remove()
        outs.append(seen[0].reshape(smol.n_heads, smol.d_head))
    torch.testing.assert_close(sel.vhd[0, 1], (outs[0] - outs[1]).norm(dim=-1), atol=1e-4, rtol=1e-4)
    chosen = sel.heads[1][0]
    assert int(chosen.sum()) == 4  # 9 heads: strictly above the lower median
    before, after = _ZRecorder(layer=1), _ZRecorder(layer=1)
    with editing(smol, [before, *edits, after]):
        forward(smol, enc)
    z, z2 = before.records[0][0], after.records[0][0]
    torch.testing.assert_close(z2[:, chosen], alpha * z[:, chosen], atol=1e-6, rtol=1e-6)
    assert torch.equal(z2[:, ~chosen], z[:, ~chosen])


def _first_layers(hm, n: int) -> HeadModel:
    """A view of `hm` with only its first `n` decoder layers (the same weight tensors, the
    original model untouched): MAPS' static scores of those layers depend on nothing else."""
    lm, inner = copy.copy(hm.model), copy.copy(hm.model.model)
    lm._modules, inner._modules = dict(lm._modules), dict(inner._modules)
    inner.layers = torch.nn.ModuleList(list(hm.model.model.layers[:n]))
    lm.model = inner
    lm.config = inner.config = copy.copy(hm.model.config)
    lm.config.num_hidden_layers = n
    return HeadModel(lm, hm.tokenizer, name=hm.name)


@torch.no_grad()
def test_maps_scores_equal_the_ov_formula(smol):
    """Relation score of head (l, h) = share of pairs (s, t) with t in the top k of
    (Ẽ[s] W_V W_O^h) U (Elhelo & Geva 2025, Sec. 2); Ẽ = E in layer 0, MLP_0(norm(E)) above;
    suppression the same on -M. Computed here from the HF weights of layers 0 and 1 (MAPS on the
    model's first two layers: the scores of a layer depend only on its own weights, E and U)."""
    tok, d = smol.tokenizer, smol.d_head
    inner = smol.model.model
    words = [" cat", " dog", " house", " tree", " water", " city", " king", " red", " blue", " music"]
    src = [tok.encode(w, add_special_tokens=False)[0] for w in words]
    e = inner.embed_tokens.weight[src].float()
    layer0 = inner.layers[0]
    reps = {0: e, 1: layer0.mlp(layer0.post_attention_layernorm(e)).float()}
    u = smol.model.lm_head.weight.float()  # [V, D]
    group = smol.n_heads // smol.n_kv_heads

    def ov(la: int, h: int) -> torch.Tensor:  # M^h rows of the sources: [n, V]
        att = inner.layers[la].self_attn
        w_v = att.v_proj.weight[(h // group) * d : (h // group + 1) * d].float()  # [d, D]
        w_o = att.o_proj.weight[:, h * d : (h + 1) * d].float()  # [D, d]
        return (reps[la] @ w_v.T @ w_o.T) @ u.T

    # targets: head (1, 0)'s top token for half the sources (so scores are not all 0), others fixed
    top = ov(1, 0).argmax(-1)
    pairs = [(s, int(top[i]) if i % 2 == 0 else s) for i, s in enumerate(src)]
    rel = RelationPairs("mixed", pairs, k=10)
    got = maps_scores(_first_layers(smol, 2), [rel], progress=False)
    relation, suppression = got.relation["mixed"].scores, got.suppression["mixed"].scores
    targets = torch.tensor([t for _, t in pairs])
    rows = torch.arange(len(pairs))
    for la in (0, 1):
        for h in range(smol.n_heads):
            m = ov(la, h)
            v = m[rows, targets]
            hits = ((m > v[:, None]).sum(-1) < rel.k).float().mean()
            sup = ((m < v[:, None]).sum(-1) < rel.k).float().mean()
            assert math.isclose(float(relation[la, h]), float(hits), abs_tol=1e-6), (la, h)
            assert math.isclose(float(suppression[la, h]), float(sup), abs_tol=1e-6), (la, h)
    assert float(relation[1, 0]) >= 0.5
    assert smol.n_layers == 30 and len(smol.model.model.layers) == 30  # the real model untouched
