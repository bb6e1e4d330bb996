"""Which EAP path `edge_scores` takes (`eap_path.choose_path`): the lean path from the length at
which the default path's planned activations pass `LEAN_MIN_BYTES` over a plain forward's (and
`LEAN_RATIO` times it), the default one below; `forced` / `PATH` force either; the scores agree. Also the
lean path's gradient expansion with a norm of no closed form (autograd per chunk) against the
oracle."""

from __future__ import annotations

import pytest
import torch

from heads import SweepOptions
from heads.planning import plan_memory
from heads.scorers.circuits import eap_path, edge_scores, graph_of
from heads.scorers.circuits import scores as scores_module
from heads.scorers.circuits.eap import eap_chunk
from heads.scorers.circuits.eap_lean import eap_chunk_lean
from tests.heads.circuits.test_eap_layerwise import _loss, _oracle, _pairs
from tests.support.families import tiny_family_model

torch.set_num_threads(1)


def _extra(m, t: int) -> int:
    """The default path's planned activations for one pair over a plain forward's."""
    return (
        plan_memory(m, "eap", t, 1).devices[0].activations
        - plan_memory(m, "forward", t, 1).devices[0].activations
    )


def test_choice_flips_at_the_stated_length(monkeypatch):
    m = tiny_family_model("llama", num_hidden_layers=3)
    flip = 10  # the stated length: LEAN_MIN_BYTES set to the default path's extra there
    assert _extra(m, flip) > _extra(m, flip - 1)
    monkeypatch.setattr(eap_path, "LEAN_MIN_BYTES", _extra(m, flip))
    fwd = plan_memory(m, "forward", flip, 1).devices[0].activations
    assert plan_memory(m, "eap", flip, 1).devices[0].activations > eap_path.LEAN_RATIO * fwd
    calls: list[tuple[str, int | None]] = []

    def spy(name, fn):
        def run(*args, **kwargs):
            calls.append((name, kwargs.get("block")))
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(scores_module, "eap_chunk_lean", spy("lean", eap_chunk_lean))
    monkeypatch.setattr(scores_module, "eap_chunk", spy("default", eap_chunk))
    opts = SweepOptions(progress=False)
    got = {}
    for t in (flip - 1, flip):  # _pairs(t): rows of t and t - 1 tokens, width t
        calls.clear()
        got[t] = edge_scores(m, _pairs(t), method="eap", options=opts)
        assert [c[0] for c in calls] == (["lean"] if t == flip else ["default"]), t
    block = calls[0][1]
    assert block is not None and 1 <= block <= m.n_layers  # chosen from the plan
    for path, want in (("default", "default"), ("lean", "lean")):  # forced, at the other length
        calls.clear()
        t = flip if path == "default" else flip - 1
        with eap_path.forced(path):
            forced = edge_scores(m, _pairs(t), method="eap", options=opts)
        assert [c[0] for c in calls] == [want]
        ok = ~torch.isnan(got[t].scores)
        scale = float(got[t].scores[ok].abs().max())
        assert scale > 1e-3
        assert float((forced.scores[ok] - got[t].scores[ok]).abs().max()) <= 1e-6 * scale
    calls.clear()  # the module setting, every thread
    monkeypatch.setattr(eap_path, "PATH", "lean")
    edge_scores(m, _pairs(flip - 1), method="eap", options=opts)
    assert [c[0] for c in calls] == ["lean"]
    monkeypatch.setattr(eap_path, "PATH", "sideways")
    with pytest.raises(ValueError, match="PATH"):
        edge_scores(m, _pairs(5), method="eap", options=opts)
    with pytest.raises(ValueError, match="path must be one of"), eap_path.forced("sideways"):
        pass


def test_block_from_the_plan_and_work_ratio(monkeypatch):
    """Without a budget the block is the largest whose lean plan stays within
    `LEAN_BLOCK_RATIO` forwards; more layers per block: fewer sweeps, less estimated work."""
    from heads.planning import MemoryRequest

    m = tiny_family_model("llama", num_hidden_layers=4)
    monkeypatch.setattr(eap_path, "PATH", "lean")
    _, lean, block = eap_path.choose_path(m, SweepOptions(), 64, "eap", None)
    assert lean and block is not None
    fwd = plan_memory(m, "forward", 64, 1).devices[0].activations

    def act(b):
        return plan_memory(m, MemoryRequest("eap_lean", {"block": b}), 64, 1).devices[0].activations

    assert block == 1 or act(block) <= eap_path.LEAN_BLOCK_RATIO * fwd
    assert block == min(eap_path.MAX_BLOCK, m.n_layers) or act(block + 1) > eap_path.LEAN_BLOCK_RATIO * fwd
    ratios = [eap_path.work_ratio(30, b, None) for b in (1, 2, 3, 4)]
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] > 1.0
    # 30 layers, block 2 (SmolLM2): EAP and EAP-IG with up to 8 points lean by default (each point
    # sweeps two or three runs again, the default path records the differences once); 48 layers at
    # block 2 with 5 points (deeper: more sweeps per walk) keep the default path
    ig = [eap_path.work_ratio(30, 2, s) for s in (2, 3, 4, 5, 8)]
    assert ig == sorted(ig) and ratios[1] < ig[0] and ig[-1] <= eap_path.LEAN_TIME
    assert eap_path.work_ratio(30, 2, 20) > eap_path.work_ratio(30, 2, 8)
    assert eap_path.work_ratio(48, 2, 5) > eap_path.LEAN_TIME


@pytest.mark.parametrize("steps", [None, 2])
def test_lean_norm_without_closed_form_uses_autograd(monkeypatch, steps):
    """A norm `eap._norm_form` does not recognise: the expansion runs autograd's product per
    chunk (`eap._residual_grads`); the same scores as the oracle and `eap_chunk`."""
    from heads.scorers.circuits import eap_lean

    monkeypatch.setattr(eap_lean, "_norm_form", lambda *a: None)
    m = tiny_family_model("llama", num_hidden_layers=3)
    p = _pairs(7)
    want = _oracle(m, p, steps)
    scale = float(want.abs().max())
    args = (m, graph_of(m), p.clean_ids, p.corrupted_ids, p.attention_mask, _loss(p))
    got = eap_chunk_lean(*args, steps=steps, block=2)
    assert float((got - want).abs().max()) <= 1e-5 * scale
    assert float((got - eap_chunk(*args, steps=steps)).abs().max()) <= 1e-6 * scale
