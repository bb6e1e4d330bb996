"""`options=SweepOptions(...)` on MAPS, QRHead and CHG gating: the loose `progress=` keyword still
works one release with a DeprecationWarning naming its replacement, an option the analysis does
not use is refused by name, and the options' progress callback is the one called."""

from __future__ import annotations

import pytest

from heads import SweepOptions, gate_heads, maps_scores, qrhead_scores
from heads.errors import HeadsteerValueError
from heads.scorers.gating import gate_task
from heads.scorers.maps.static import RelationPairs


def _rel():
    return [RelationPairs("copying", [(40, 40), (41, 41), (42, 42)], 1)]


def test_maps_scores_takes_options_and_warns_on_the_loose_keyword(tiny_llama):
    seen = []
    new = maps_scores(tiny_llama, _rel(), options=SweepOptions(progress=lambda d, t: seen.append((d, t))))
    assert seen[-1] == (tiny_llama.n_layers, tiny_llama.n_layers)
    with pytest.warns(
        DeprecationWarning, match=r"maps_scores\(progress=\) is deprecated.*SweepOptions\(progress="
    ):
        old = maps_scores(tiny_llama, _rel(), progress=False)
    assert old.relation["copying"].scores.equal(new.relation["copying"].scores)
    with pytest.raises(HeadsteerValueError, match="maps_scores does not take max_rows="):
        maps_scores(tiny_llama, _rel(), options=SweepOptions(max_rows=8))


def test_gate_heads_takes_options(tiny_llama):
    task = gate_task(tiny_llama, ["The cat sat on the"], [" mat"])
    seen = []
    kw = {"steps": 1, "reg_steps": 1, "init": (0.5, 0.5)}
    new = gate_heads(tiny_llama, task, **kw, options=SweepOptions(progress=lambda d, t: seen.append(d)))
    assert seen and seen[-1] == 3  # one update in each of the three fits
    with pytest.warns(DeprecationWarning, match=r"gate_heads\(progress=\)"):
        old = gate_heads(tiny_llama, task, **kw, progress=False)
    assert old.gates.scores.equal(new.gates.scores)
    with pytest.raises(HeadsteerValueError, match="gate_heads does not take seed="):
        gate_heads(tiny_llama, task, **kw, options=SweepOptions(seed=3))


def test_qrhead_scores_takes_options(tiny_llama):
    with pytest.raises(HeadsteerValueError, match="qrhead_scores does not take shard="):
        qrhead_scores(tiny_llama, [], options=SweepOptions(shard=(0, 2)))
    with (
        pytest.warns(DeprecationWarning, match=r"qrhead_scores\(progress=\)"),
        pytest.raises(HeadsteerValueError),
    ):
        qrhead_scores(tiny_llama, [{"question": 1}], progress=False)


def test_caa_vector_takes_options(tiny_llama):
    import torch

    from steer.caa import caa_vector

    pairs = [("I love it", "I hate it"), ("Great day", "Awful day"), ("Yes, sure", "No, never")]
    seen = []
    new = caa_vector(
        tiny_llama, pairs, 1, options=SweepOptions(max_rows=4, progress=lambda d, t: seen.append(d))
    )
    assert seen == [2, 3]  # two pairs (four rows) per forward
    with pytest.warns(
        DeprecationWarning, match=r"caa_vector\(batch_size=\) is deprecated.*max_rows=2 \* batch_size"
    ):
        old = caa_vector(tiny_llama, pairs, 1, batch_size=2)
    torch.testing.assert_close(old, new)
    with pytest.raises(HeadsteerValueError, match="caa_vector does not take seed="):
        caa_vector(tiny_llama, pairs, 1, options=SweepOptions(seed=1))
