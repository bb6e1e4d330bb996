"""Exact patching in memory linear in the prompt: a patched input whose sources are mostly
corrupted takes the whole stream difference minus the few unpatched sources' (a circuit's
faithfulness keeps only the circuit's sources), and rows are run in forwards whose upstream
differences fit `PATCH_MEMORY`. Both give the numbers of the direct sum, one forward for all."""

from __future__ import annotations

import torch

import heads.scorers.circuits.graph as graph_mod
import heads.scorers.circuits.scores as scores_mod
from heads.scorers.circuits import edge_scores, evaluate, graph_of, prune, select
from heads.scorers.circuits.scores import needed_nodes
from heads.scorers.patching import pairs_from_tokens
from tests.support.families import tiny_family_model

torch.set_num_threads(1)


def _pairs():
    g = torch.Generator().manual_seed(4)
    clean = torch.randint(3, 300, (2, 9), generator=g).tolist()
    corr = [list(r) for r in clean]
    for r in corr:
        r[2] = int(torch.randint(3, 300, (1,), generator=g))
    clean[0], corr[0] = clean[0][1:], corr[0][1:]
    return pairs_from_tokens(clean, corr, [5, 6], [40, 41])


def test_complement_and_row_budget_give_the_direct_sum(monkeypatch):
    m = tiny_family_model("llama", num_hidden_layers=3)
    p = _pairs()
    g = graph_of(m)
    gen = torch.Generator().manual_seed(0)
    masks = torch.stack(
        [torch.rand(g.n_upstream, g.n_downstream, generator=gen) < f for f in (0.05, 0.5, 0.95)]
    )
    sc = edge_scores(m, p, method="eap", progress=False)
    circuit = select(sc, 15)
    masks = torch.cat([masks & g.valid, circuit.mask[None]])
    got = evaluate(m, p, masks, batch_rows=8)
    monkeypatch.setattr(graph_mod, "_COMPLEMENT", False)
    direct = evaluate(m, p, masks, batch_rows=8)
    monkeypatch.setattr(graph_mod, "_COMPLEMENT", True)
    monkeypatch.setattr(scores_mod, "PATCH_MEMORY", 1)  # one row per forward
    budget = evaluate(m, p, masks, batch_rows=8)
    assert float(direct.abs().max()) > 0.1
    assert torch.allclose(got, direct, atol=1e-5), (got - direct).abs().max()
    assert torch.allclose(budget, direct, atol=1e-5), (budget - direct).abs().max()
    # a small circuit's faithfulness keeps the circuit's sources only, not every upstream node
    patch = (g.valid & ~prune(g, circuit.mask))[None]
    sources = int(circuit.mask.any(dim=1).sum())
    assert needed_nodes(g, patch) <= sources < g.n_upstream
