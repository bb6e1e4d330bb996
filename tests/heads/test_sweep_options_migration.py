"""`options=SweepOptions(...)` on MAPS, QRHead and CHG gating: the loose `progress=` keyword still
works one release with a DeprecationWarning naming its replacement, an option the analysis does
not use is refused by name, and the options' progress callback is the one called."""

from __future__ import annotations

import pytest
import torch

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


def _circuit_pairs():
    from heads.scorers.patching import pairs_from_tokens

    return pairs_from_tokens([[5, 6, 7], [8, 9, 10]], [[11, 12, 13], [14, 15, 16]], [5, 6], [40, 41])


def test_edge_scores_takes_options(tiny_llama):
    from heads.scorers.circuits import edge_scores

    pairs = _circuit_pairs()
    seen = []
    opts = SweepOptions(max_rows=8, progress=lambda d, t: seen.append((d, t)))
    new = edge_scores(tiny_llama, pairs, method="eap", options=opts)
    assert seen == [(1, 2), (2, 2)]  # max_rows // 8 = 1 pair per gradient chunk
    with pytest.warns(DeprecationWarning, match=r"edge_scores\(batch_size=\) is deprecated.*=8 \* batch"):
        old = edge_scores(tiny_llama, pairs, method="eap", batch_size=1, progress=False)
    torch.testing.assert_close(old.scores, new.scores, equal_nan=True)
    with pytest.warns(DeprecationWarning, match=r"edge_scores\(batch_rows=, progress=\).*\(max_rows="):
        edge_scores(tiny_llama, pairs, method="eap", batch_rows=8, progress=False)
    with pytest.raises(HeadsteerValueError, match=r"both batch_size= and options.max_rows"):
        edge_scores(tiny_llama, pairs, method="eap", batch_size=1, options=SweepOptions(max_rows=8))
    with pytest.raises(HeadsteerValueError, match=r"both progress= and options.progress"):
        edge_scores(tiny_llama, pairs, method="eap", progress=True, options=SweepOptions(progress=False))
    with pytest.raises(HeadsteerValueError, match="edge_scores does not take seed="):
        edge_scores(tiny_llama, pairs, method="eap", options=SweepOptions(seed=2))


def test_find_circuit_takes_options(tiny_llama, monkeypatch):
    import heads.scorers.circuits.circuit as circuit

    pairs = _circuit_pairs()
    rows = []
    real = circuit.chunked_edge_scores
    monkeypatch.setattr(circuit, "chunked_edge_scores", lambda *a: rows.append(a[6:8]) or real(*a))
    kw = {"method": "eap", "n": 3, "curve": False}
    new = circuit.find_circuit(tiny_llama, pairs, **kw, options=SweepOptions(max_rows=16, progress=False))
    with pytest.warns(DeprecationWarning, match=r"find_circuit\(batch_rows=, progress=\) is deprecated"):
        old = circuit.find_circuit(tiny_llama, pairs, **kw, batch_rows=16, progress=False)
    assert old.mask.equal(new.mask) and old.faithfulness == new.faithfulness
    default = circuit.find_circuit(tiny_llama, pairs, **kw, options=SweepOptions(progress=False))
    budget = circuit.circuit_rows(circuit.graph_of(tiny_llama), tiny_llama.d_model, pairs.width)
    assert rows == [(2, 16), (2, 16), (8, budget)]  # the default max_rows keeps the 2 GiB budget rows
    assert default.mask.equal(new.mask)
    with pytest.raises(HeadsteerValueError, match=r"circuit\(\) got both batch_rows= and options.max_rows"):
        circuit.find_circuit(tiny_llama, pairs, **kw, batch_rows=4, options=SweepOptions(max_rows=8))


def test_pattern_scores_takes_options(tiny_llama):
    from heads.scorers.roles import pattern_scores

    seqs = [[1, 5, 6, 7, 5, 6, 7], [1, 8, 9, 10, 8, 9, 10], [1, 4, 3, 2, 4, 3, 2]]
    kw = {"detectors": ("induction", "previous_token")}
    new = pattern_scores(tiny_llama, seqs, **kw, options=SweepOptions(max_rows=2))
    with pytest.warns(DeprecationWarning, match=r"pattern_scores\(batch_size=\).*SweepOptions\(max_rows="):
        old = pattern_scores(tiny_llama, seqs, **kw, batch_size=2)
    default = pattern_scores(tiny_llama, seqs, **kw)
    for name in kw["detectors"]:
        torch.testing.assert_close(old[name].scores, new[name].scores, equal_nan=True)
        torch.testing.assert_close(default[name].scores, new[name].scores, equal_nan=True)
    with pytest.raises(HeadsteerValueError, match=r"got both batch_size= and options.max_rows"):
        pattern_scores(tiny_llama, seqs, batch_size=2, options=SweepOptions(max_rows=3))
    quiet = pattern_scores(tiny_llama, seqs, **kw, options=SweepOptions(progress=False))  # never refused
    torch.testing.assert_close(quiet["induction"].scores, default["induction"].scores, equal_nan=True)
    with pytest.raises(HeadsteerValueError, match=r"pattern_scores does not take shard="):
        pattern_scores(tiny_llama, seqs, options=SweepOptions(shard=(0, 2)))


def test_train_lens_takes_options(tiny_llama):
    from heads.scorers.roles.lens import train_lens
    from heads.scorers.roles.lens_data import collect_lens_data
    from probes.datasets.corpus import load_corpus

    data = collect_lens_data(tiny_llama, load_corpus(6), [(0, 0)], max_positions=40)
    seen = []
    new = train_lens(
        tiny_llama, data, [(0, 0)], epochs=2, options=SweepOptions(progress=lambda d, t: seen.append((d, t)))
    )
    assert seen[-1] == (2, 2)  # epochs done, of 2
    with pytest.warns(DeprecationWarning, match=r"train_lens\(progress=\) is deprecated"):
        old = train_lens(tiny_llama, data, [(0, 0)], epochs=2, progress=False)
    torch.testing.assert_close(old.held_out_kl, new.held_out_kl)
    with pytest.raises(HeadsteerValueError, match=r"train_lens\(\) got both progress= and options.progress"):
        train_lens(tiny_llama, data, [(0, 0)], progress=True, options=SweepOptions(progress=False))
    with pytest.raises(HeadsteerValueError, match="train_lens does not take max_rows="):
        train_lens(tiny_llama, data, [(0, 0)], options=SweepOptions(max_rows=2))


def test_dynamic_scores_takes_options(tiny_llama):
    from heads.scorers.maps.inference import dynamic_scores

    rel = [RelationPairs("copying", [(40, 40), (41, 41)], 1, texts=[("a", "a"), ("b", "b")])]
    seen = []
    kw = {"templates": ["{x}"], "max_pairs": 2}
    new = dynamic_scores(
        tiny_llama, rel, **kw, options=SweepOptions(progress=lambda d, t: seen.append((d, t)))
    )
    assert seen and seen[-1][0] == seen[-1][1]
    with pytest.warns(DeprecationWarning, match=r"dynamic_scores\(progress=\) is deprecated"):
        old = dynamic_scores(tiny_llama, rel, **kw, progress=False)
    assert old["copying"].equal(new["copying"])
    with pytest.raises(
        HeadsteerValueError, match=r"dynamic_scores\(\) got both progress= and options.progress"
    ):
        dynamic_scores(tiny_llama, rel, progress=True, options=SweepOptions(progress=False))
    with pytest.raises(HeadsteerValueError, match="dynamic_scores does not take seed="):
        dynamic_scores(tiny_llama, rel, options=SweepOptions(seed=2))


def test_maps_analysis_takes_options(tiny_llama):
    from heads.scorers.maps.analysis import maps_analysis

    with pytest.raises(
        HeadsteerValueError, match=r"maps_analysis\(\) got both progress= and options.progress"
    ):
        maps_analysis(tiny_llama, _rel(), progress=True, options=SweepOptions(progress=False))
    with pytest.raises(HeadsteerValueError, match="maps_analysis does not take seed="):
        maps_analysis(tiny_llama, _rel(), options=SweepOptions(seed=1))
    with (
        pytest.warns(DeprecationWarning, match=r"maps_analysis\(progress=\) is deprecated"),
        pytest.raises(HeadsteerValueError, match="draws"),
    ):
        maps_analysis(tiny_llama, _rel(), draws=0, progress=False)
