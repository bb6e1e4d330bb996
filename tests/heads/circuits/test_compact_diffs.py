"""The compact upstream differences of exact edge patching (`run_graph(compact=True)`, taken by
`patched_metrics` when one row's full differences pass `PATCH_MEMORY`): the heads' differences are
kept as `[R, T, h, d]` head outputs and projected by `W_O[h]` when an input reads them. Oracle: the
same circuits evaluated with every head's `[R, T, D]` share kept (the direct path, itself checked
against one-hook loops elsewhere), on pre-norm, grouped-query, post-norm (frozen scale) and GPT-2
families, with left padding, prompts past the sliding window, several rows per forward and
skipped layers."""

from __future__ import annotations

import pytest
import torch

import heads.scorers.circuits.scores as scores_mod
from heads import SweepOptions
from heads.scorers.circuits import evaluate, graph_of
from heads.scorers.circuits.graph import run_graph
from heads.scorers.patching import pairs_from_tokens
from tests.support.families import WINDOW, tiny_family_model

torch.set_num_threads(1)


def _pairs(t: int = WINDOW + 3):
    g = torch.Generator().manual_seed(7)
    clean = torch.randint(3, 300, (2, t), generator=g).tolist()
    corr = [list(r) for r in clean]
    for r in corr:
        r[1] = int(torch.randint(3, 300, (1,), generator=g))
        r[-2] = int(torch.randint(3, 300, (1,), generator=g))
    clean[0], corr[0] = clean[0][1:], corr[0][1:]  # left padding
    return pairs_from_tokens(clean, corr, [5, 6], [40, 41])


def _masks(g, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.stack(
        [torch.rand(g.n_upstream, g.n_downstream, generator=gen) < f for f in (0.02, 0.3, 0.7, 0.98)]
    )
    late = torch.zeros(g.n_upstream, g.n_downstream, dtype=torch.bool)
    late[:, -1] = True  # only the logits' input: the forward skips every layer but the last
    return torch.cat([dense, late[None]]) & g.valid


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "olmo2", "gpt2"])
def test_compact_differences_give_the_full_ones(kind, monkeypatch):
    m = tiny_family_model(kind)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # norms' gains away from 1 (random init leaves them at 1)
        for name, w in m.model.named_parameters():
            if "norm" in name or ".ln_" in name:
                w.add_(0.3 * torch.randn(w.shape, generator=gen))
    p = _pairs()
    g = graph_of(m)
    masks = _masks(g)
    monkeypatch.setattr(scores_mod, "COMPACT", False)
    full = evaluate(m, p, masks, options=SweepOptions(max_rows=8, progress=False))
    monkeypatch.setattr(scores_mod, "COMPACT", True)
    compact = evaluate(m, p, masks, options=SweepOptions(max_rows=8, progress=False))
    one_row = evaluate(m, p, masks, options=SweepOptions(max_rows=1, progress=False))
    assert float((full[:-1] - full[-1]).abs().max()) > 0.05  # the circuits differ in effect
    assert torch.allclose(compact, full, atol=1e-5), (compact - full).abs().max()
    assert torch.allclose(one_row, full, atol=1e-5), (one_row - full).abs().max()


def test_compact_keeps_head_outputs_not_shares():
    """What a compact row keeps: per layer `[R, T, h, d]` for the heads some row needs, and no
    `[R, U, T*D]` column for any head (the input and MLPs' columns only)."""
    m = tiny_family_model("llama", num_hidden_layers=3)
    p = _pairs()
    g = graph_of(m)
    gen = torch.Generator().manual_seed(1)
    patch = g.valid & (torch.rand(g.n_upstream, g.n_downstream, generator=gen) < 0.3)
    with torch.no_grad():
        _, corr = run_graph(m, g, p.corrupted_ids, p.attention_mask, record=True)
        _, runner = run_graph(
            m, g, p.clean_ids, p.attention_mask, patch=patch[None].expand(2, -1, -1),
            corr=corr.acts(), compact=True,
        )  # fmt: skip
    R, T = p.clean_ids.shape
    assert runner.diff is not None and runner.diff.shape[1] <= 1 + g.n_layers  # input + MLPs
    assert sorted(runner.hdiff) == list(range(g.n_layers))
    for heads, dz in runner.hdiff.values():
        assert dz.shape == (R, T, len(heads), m.d_head) and dz.dtype == torch.float32
