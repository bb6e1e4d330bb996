"""The layer-by-layer backward of AtP keeps one layer's graph alive at a time (issue 41, item 2):
when layer l runs, nothing autograd saved for the layers above it is still alive."""

from __future__ import annotations

import weakref

import torch

from heads.scorers.safety import atp
from heads.scorers.safety.attribution import attribute


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
    real = atp.run_layer

    def run_layer(model, ids, mask, layer, x, edits=()):
        seen.append((layer, _Saved.alive))  # saved tensors alive as this layer starts
        return real(model, ids, mask, layer, x, edits)

    monkeypatch.setattr(atp, "run_layer", run_layer)
    with torch.autograd.graph.saved_tensors_hooks(_Saved, lambda box: box.t):
        got = attribute(tiny_llama, ["The quick brown fox jumps over the lazy dog"], template=None)
    L = tiny_llama.n_layers
    assert [la for la, _ in seen] == list(range(L - 1, -1, -1))  # one walk, top down (KL: 4 flows)
    assert all(n == 0 for _, n in seen), seen  # the top layer's graph (KL's scalars) is not kept
    assert torch.isfinite(got.per_prompt).all()
