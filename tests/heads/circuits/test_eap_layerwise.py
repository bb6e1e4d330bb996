"""EAP / EAP-IG computed one layer at a time (memory linear in the prompt) equal one backward
through the whole model: the oracle is the decomposed forward with a zero delta at every
downstream input (`run_graph(grad=True)`), one `torch.autograd.grad` of the metric and the dense
product of every upstream difference with every input gradient, as written in the test. Checked
with segments of 1, 2 and 4 layers on a 4-layer model, and on sliding-window families with
prompts longer than the window (tiny Mistral, Gemma-2, Gemma-3)."""

from __future__ import annotations

import pytest
import torch

from heads.scorers.circuits import graph_of
from heads.scorers.circuits.eap import eap_chunk
from heads.scorers.circuits.graph import embed_output, run_graph
from heads.scorers.patching import pairs_from_tokens
from tests.support.families import WINDOW, tiny_family_model

torch.set_num_threads(1)


def _pairs(t: int, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(3, 300, (2, t), generator=g).tolist()
    corr = [list(r) for r in clean]
    for r in corr:
        r[1] = int(torch.randint(3, 300, (1,), generator=g))
        r[-2] = int(torch.randint(3, 300, (1,), generator=g))
    clean[0], corr[0] = clean[0][1:], corr[0][1:]
    return pairs_from_tokens(clean, corr, [5, 6], [40, 41])


def _loss(p):
    idx = torch.arange(p.n)

    def loss(logits):
        return (logits[idx, p.answers[:, 0]] - logits[idx, p.counterfactuals[:, 0]]).sum()

    return loss


def _oracle(m, p, steps: int | None) -> torch.Tensor:
    """`[R, U, Dn]` per-pair scores from whole-model backwards (one per interpolation point)."""
    g = graph_of(m)
    ids, mask = p.clean_ids, p.attention_mask
    w_o = [m.layer_weights(la)["W_O"] for la in range(g.n_layers)]
    with torch.no_grad():
        _, rc = run_graph(m, g, ids, mask, record=True)
        _, rx = run_graph(m, g, p.corrupted_ids, mask, record=True)
    diff = (rx.acts().upstream(w_o) - rc.acts().upstream(w_o)).float() * mask[None, :, :, None]
    e_corr = embed_output(m, p.corrupted_ids)
    n = 1 if steps is None else steps
    total = 0.0
    for k in range(1, n + 1):
        embed = None if k == n else (e_corr, k / n)
        with torch.enable_grad():
            logits, runner = run_graph(m, g, ids, mask, grad=True, embed=embed)
            deltas = list(runner.deltas.values())
            grads = torch.autograd.grad(_loss(p)(logits), deltas)
        grad = torch.cat(grads).float()  # [Dn, R, T, D]
        U, Dn, R = g.n_upstream, g.n_downstream, p.n
        total = total + torch.bmm(
            diff.reshape(U, R, -1).transpose(0, 1), grad.reshape(Dn, R, -1).permute(1, 2, 0)
        )
    out = total / n
    out[:, ~g.valid] = 0.0
    return out


@pytest.mark.parametrize("steps", [None, 2])
def test_layer_by_layer_equals_one_backward(steps):
    m = tiny_family_model("llama", num_hidden_layers=4)
    p = _pairs(7)
    want = _oracle(m, p, steps)
    scale = float(want.abs().max())
    assert scale > 1e-3
    for every in (1, 2, 4):
        got = eap_chunk(
            m, graph_of(m), p.clean_ids, p.corrupted_ids, p.attention_mask, _loss(p), steps=steps, every=every
        )
        assert float((got - want).abs().max()) <= 1e-5 * scale, every


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gemma3_text"])
def test_sliding_window_longer_prompt(kind):
    """Prompts of 3 x the window: the layer-by-layer gradients keep each layer's own mask."""
    m = tiny_family_model(kind)
    p = _pairs(3 * WINDOW)
    want = _oracle(m, p, None)
    got = eap_chunk(m, graph_of(m), p.clean_ids, p.corrupted_ids, p.attention_mask, _loss(p), every=1)
    scale = float(want.abs().max())
    assert scale > 1e-3
    assert float((got - want).abs().max()) <= 1e-5 * scale
