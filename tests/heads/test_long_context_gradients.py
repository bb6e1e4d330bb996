"""Memory of the analyses on long prompts (issue 41, item 2): the layer-by-layer backward of AtP
keeps one layer's graph alive at a time (when layer l runs, nothing autograd saved for the layers
above it is still alive); the logit lens and `head_logits`, which read the last position, keep
that position only, not the run's full cache."""

from __future__ import annotations

import weakref

import pytest
import torch

from heads.engine.activations import ActivationRecorder
from heads.engine.context import editing
from heads.scorers import layerwise
from heads.scorers.patching import logit
from heads.scorers.patching.activation import record_run
from heads.scorers.patching.pairs import PromptPair, encode_pairs
from heads.scorers.safety import atp
from heads.scorers.safety.attribution import attribute, logit_diff


class _Saved:
    """What autograd saves, wrapped so that its release is seen (`alive` counts the live ones)."""

    alive = 0

    def __init__(self, t: torch.Tensor):
        self.t = t.detach()  # no grad_fn: a saved output would otherwise hold its own graph
        _Saved.alive += 1
        weakref.finalize(self, _Saved._gone)

    @staticmethod
    def _gone() -> None:
        _Saved.alive -= 1


def test_atp_walk_frees_each_layers_graph_before_the_next(tiny_llama, monkeypatch):
    seen: list[tuple[int, int]] = []
    real = atp.attention_half  # each layer's graph starts with its attention half

    def attention_half(model, ids, mask, layer, x, edits=()):
        seen.append((layer, _Saved.alive))  # saved tensors alive as this layer starts
        return real(model, ids, mask, layer, x, edits)

    monkeypatch.setattr(atp, "attention_half", attention_half)
    with torch.autograd.graph.saved_tensors_hooks(_Saved, lambda box: box.t):
        got = attribute(tiny_llama, ["The quick brown fox jumps over the lazy dog"], template=None)
    L = tiny_llama.n_layers
    assert [la for la, _ in seen] == list(range(L - 1, -1, -1))  # one walk, top down (KL: 4 flows)
    assert all(n == 0 for _, n in seen), seen  # the top layer's graph (KL's scalars) is not kept
    assert torch.isfinite(got.per_prompt).all()


def test_checkpoint_layers_keep_few_residuals_and_cover_every_layer():
    for L in (1, 2, 3, 7, 18, 30, 80):
        starts = layerwise.checkpoint_layers(L)
        sizes = [b - a for a, b in zip(starts, [*starts[1:], L], strict=True)]
        assert starts[0] == 0 and all(s >= 1 for s in sizes) and sum(sizes) == L
        alive = max(i + s for i, s in enumerate(sizes))  # checkpoints below + the segment's inputs
        assert alive * (alive + 1) // 2 < L + alive  # about sqrt(2 L): m with m (m + 1) / 2 >= L
    assert max(i + s for i, s in enumerate([8, 7, 6, 5, 4])) == 8  # 30 layers: 8 copies, not 11
    assert layerwise.checkpoint_layers(30) == [0, 8, 15, 21, 26]


@pytest.mark.parametrize("kw", [{"ablation": "sc"}, {"ablation": "ua", "graddrop": True}])
def test_atp_mlp_in_chunks_equals_the_whole_layer(tiny_llama, monkeypatch, kw):
    """The MLP half run in position chunks (2 positions each; the top layer at the last position)
    gives the estimate of the layer run whole (the path of blocks without a `resid_mid`)."""
    prompts = ["The quick brown fox jumps over the lazy dog", "A tale of two cities"]
    monkeypatch.setattr(atp, "has_mid", lambda model: False)
    whole = attribute(tiny_llama, prompts, template=None, **kw).per_prompt
    monkeypatch.undo()
    pieces: list[int] = []
    real = atp.mlp_half

    def mlp_half(model, ids, layer, mid, start, edits=()):
        pieces.append(mid.shape[1])
        return real(model, ids, layer, mid, start, edits)

    monkeypatch.setattr(atp, "mlp_half", mlp_half)
    monkeypatch.setattr(atp, "MLP_MIN_ROWS", 2)
    monkeypatch.setattr(atp, "MLP_CHUNKS", 64)
    chunked = attribute(tiny_llama, prompts, template=None, **kw).per_prompt
    assert max(pieces) == 2 and 1 in pieces  # several chunks per layer, the top at one position
    assert float(whole.abs().max()) > 0
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-5)


def test_graddrop_walks_keep_only_the_recorded_residuals_below(tiny_llama, monkeypatch):
    """Each GradDrop walk holds, at layer l, only the recorded residuals of segments at or below l
    (those above were used and dropped), as plain AtP's one walk does: the walks do not keep
    every recorded residual alive for the next walk."""
    alive: dict[int, int] = dict.fromkeys(range(tiny_llama.n_layers), 0)
    real_record, real_half = atp.record_inputs, atp.attention_half

    def gone(layer: int) -> None:
        alive[layer] -= 1

    def record_inputs(model, ids, mask, layers, edits=()):
        logits, sparse = real_record(model, ids, mask, layers, edits)
        for la, t in sparse.items():
            alive[la] += 1
            weakref.finalize(t, gone, la)
        return logits, sparse

    seen: list[tuple[int, list[int]]] = []

    def attention_half(model, ids, mask, layer, x, edits=()):
        seen.append((layer, [la for la, n in alive.items() if n]))
        return real_half(model, ids, mask, layer, x, edits)

    monkeypatch.setattr(atp, "record_inputs", record_inputs)
    monkeypatch.setattr(atp, "attention_half", attention_half)
    attribute(tiny_llama, ["The quick brown fox jumps over the lazy dog"], graddrop=True, template=None)
    assert len(seen) > tiny_llama.n_layers  # several walks
    assert all(max(live, default=0) <= la for la, live in seen), seen


def test_mlp_half_equals_the_layer_without_computing_its_attention(tiny_llama):
    """`mlp_half` on a chunk gives the whole layer's output there, and on the Hugging Face backend
    the chunk's attention is not computed (its heads' outputs are never seen)."""
    hm, la = tiny_llama, 1
    ids = torch.tensor([[5, 17, 300, 41, 8, 99, 23, 7, 64, 120]])
    mask = torch.ones_like(ids)
    _, sparse = layerwise.record_inputs(hm, ids, mask, [la])
    x = sparse[la].requires_grad_(True)
    whole = layerwise.run_layer(hm, ids, mask, la, x).detach()
    mid = layerwise.attention_half(hm, ids, mask, la, x)
    seen = ActivationRecorder("head_output", la)
    with editing(hm, [seen], require_fired=False):
        out = layerwise.mlp_half(hm, ids, la, mid[:, 3:7].detach().requires_grad_(True), 3)
    assert not seen.records
    assert out.requires_grad
    torch.testing.assert_close(out.detach(), whole[:, 3:7], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kw", [{"kl_tokens": 4}, {"kl_tokens": 2}, {"metric": logit_diff([11], [12])}])
def test_graddrop_walks_carry_at_most_max_flows(tiny_llama, monkeypatch, kw):
    """AtP*'s GradDrop walks keep at most `MAX_FLOWS` gradient flows (one residual-stream copy
    each) alive, or the metric's scalars when there are more; the plain flows end at a walk's
    lowest dropped layer. The estimate is the same with every drop in one walk."""
    prompt = ["The quick brown fox jumps over the lazy dog"]
    monkeypatch.setattr(atp, "MAX_FLOWS", 100)
    one_walk = attribute(tiny_llama, prompt, graddrop=True, template=None, **kw).per_prompt
    monkeypatch.undo()
    carried: list[int] = []
    real = atp._Walk._split_layer

    def split_layer(self, la, x, edited, g_next):
        new = real(self, la, x, edited, g_next)
        carried.append(len(new))
        return new

    monkeypatch.setattr(atp._Walk, "_split_layer", split_layer)
    got = attribute(tiny_llama, prompt, graddrop=True, template=None, **kw).per_prompt
    n = kw.get("kl_tokens", 1)
    assert carried and max(carried) <= max(atp.MAX_FLOWS, n)
    assert float(one_walk.abs().max()) > 0
    torch.testing.assert_close(got, one_walk, atol=1e-7, rtol=1e-6)


PAIRS = [
    PromptPair(
        "When Mary and John went out, John gave a drink to",
        "When Mary and John went out, Anna gave a drink to",
        " Mary",
        " John",
    ),
    PromptPair(
        "The capital of France is the city of", "The capital of Spain is the city of", " Paris", " Madrid"
    ),
]


def test_lens_keeps_the_last_position_only(tiny_any, monkeypatch):
    """`_record_last` equals the last column of the full cache bitwise (every family, padded
    rows); the lens, `head_logits` and DLA (streamed, issue 41 item 2) run without `record_run`
    (its every-position cache)."""
    pairs = encode_pairs(tiny_any, PAIRS)
    mask = pairs.attention_mask
    cache = record_run(tiny_any, pairs.clean_ids, mask, final=True, keys=False)
    resid, zs, final = logit._record_last(tiny_any, pairs.clean_ids, mask, heads=True)
    for la in range(tiny_any.n_layers):
        assert torch.equal(resid[la][:, 0], cache.residuals[la][:, -1])
        assert torch.equal(zs[la], cache.z[la][:, -1:])
    assert cache.final is not None and torch.equal(final[:, 0], cache.final[:, -1].float().cpu())

    def refused(*args: object, **kw: object) -> None:
        raise AssertionError("the lens recorded the full cache")

    from heads.scorers.patching import activation, record

    monkeypatch.setattr(record, "record_run", refused)
    monkeypatch.setattr(activation, "record_run", refused)
    lens = logit.logit_lens(tiny_any, pairs)
    assert lens.logit_diff.shape == (pairs.n, tiny_any.n_layers + 1)
    a, w = logit.head_logits(tiny_any, pairs)
    assert a.shape == w.shape == (pairs.n, tiny_any.n_layers, tiny_any.n_heads)
    dla = logit.direct_logit_attribution(tiny_any, pairs)  # every position, streamed
    assert dla.heads.shape == (pairs.n, tiny_any.n_layers, tiny_any.n_heads, pairs.width)
