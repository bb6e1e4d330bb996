"""Stability of head rankings and circuits: the bootstrap over pairs and templates.

Oracles: a plain numpy re-computation of every resample (explicit index lists, nanmean,
argsort ranks, set Jaccard), scipy's Kendall tau on per-template means written out here, and
the analyses' own point results (the bootstrap's full-sample score is the analysis' score).
The `stability=` option runs no extra forward (counted with a pre-hook on the model).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import kendalltau

from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.results.stability import Stability, resample_counts, stability_of
from heads.scorers.circuits import edge_scores, find_circuit, select
from heads.scorers.patching import PromptPair, direct_logit_attribution, pairs_from_tokens
from heads.scorers.patching.activation import patch
from heads.scorers.roles.detectors import pattern_scores
from heads.scorers.safety.attribution import attribute
from heads.scorers.stability import pair_templates
from tests.support.families import tiny_family_model

torch.set_num_threads(1)


def _numpy_oracle(values: np.ndarray, counts: np.ndarray, k: int):
    """Per resample: explicit index list -> nanmean -> ranks (stable, NaN last) -> top k."""
    n, items = values.shape
    means, tops = [], []
    for row in counts:
        idx = np.repeat(np.arange(n), row.astype(int))
        with np.errstate(invalid="ignore"):
            m = np.nanmean(values[idx], axis=0)
        key = np.where(np.isnan(m), -np.inf, m)
        order = np.argsort(-key, kind="stable")
        means.append(m)
        tops.append(set(order[:k].tolist()) - set(np.nonzero(np.isnan(m))[0].tolist()))
    return np.array(means), tops


def test_bootstrap_matches_a_numpy_oracle():
    g = torch.Generator().manual_seed(3)
    v = torch.randn(12, 3, 5, generator=g) + torch.linspace(0, 2, 15).reshape(3, 5)
    v[0, 1, 2] = math.nan  # a pair without a value for one head
    st = stability_of(v, n_resamples=40, k=4, seed=7)
    counts = resample_counts(12, 40, 7).numpy()
    means, tops = _numpy_oracle(v.reshape(12, -1).numpy(), counts, 4)
    full = np.nanmean(v.reshape(12, -1).numpy(), axis=0)
    np.testing.assert_allclose(st.score.numpy(), full, atol=1e-6)
    np.testing.assert_allclose(st.low.numpy(), np.quantile(means, 0.025, axis=0), atol=1e-5)
    np.testing.assert_allclose(st.high.numpy(), np.quantile(means, 0.975, axis=0), atol=1e-5)
    full_top = set(np.argsort(-full, kind="stable")[:4].tolist())
    p = np.array([[i in t for i in range(15)] for t in tops]).mean(0)
    np.testing.assert_allclose(st.p_top_k.numpy(), p, atol=1e-6)
    jac = [len(t & full_top) / len(t | full_top) for t in tops]
    np.testing.assert_allclose(st.jaccard.numpy(), jac, atol=1e-6)
    ranks = np.argsort(np.argsort(-means, axis=1, kind="stable"), axis=1, kind="stable") + 1
    assert st.rank_low.tolist() == np.quantile(ranks, 0.025, axis=0, method="lower").astype(int).tolist()
    assert st.rank_high.tolist() == np.quantile(ranks, 0.975, axis=0, method="higher").astype(int).tolist()
    assert set(torch.nonzero(st.in_top_k).flatten().tolist()) == full_top
    assert st.names[7] == "L1.H2" and st.shape == [3, 5]
    # a head far above the rest is stable; equal heads are not
    w = torch.randn(12, 2, 3, generator=g) * 0.1
    w[:, 1, 2] += 5.0
    gap = stability_of(w, n_resamples=40, k=2)
    assert gap.stable_top() == ["L1.H2"] and gap.summary()["n_stable"] == 1


def test_templates_agreement_and_cluster_bootstrap():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(12, 2, 4, generator=g)
    tpl = ["a", "b", "c"] * 4
    st = stability_of(v, n_resamples=30, k=3, templates=tpl)
    flat = v.reshape(12, -1).numpy()
    per = [flat[[i for i in range(12) if tpl[i] == t]].mean(0) for t in ("a", "b", "c")]
    taus = [kendalltau(per[i], per[j]).statistic for i, j in ((0, 1), (0, 2), (1, 2))]
    assert st.templates is not None and st.templates["n_templates"] == 3
    assert st.templates["pairs_per_template"] == [4, 4, 4]
    assert st.templates["kendall_tau"] == pytest.approx(float(np.mean(taus)), abs=1e-6)
    by_t = stability_of(v, n_resamples=30, k=3, templates=tpl, by="templates")
    counts = resample_counts(12, 30, 0, torch.tensor([0, 1, 2] * 4))
    assert torch.equal(counts[:, :3].repeat(1, 4), counts)  # whole templates drawn together
    assert by_t.by == "templates" and "3 templates" in repr(by_t)
    with pytest.raises(HeadsteerValueError, match="at least 2 distinct templates"):
        stability_of(v, templates=["a"] * 12, by="templates")


@pytest.mark.parametrize("bad", [1, -1, True, 2.0, "10", 10_001])
def test_bad_resamples_refused(bad):
    with pytest.raises((HeadsteerValueError, HeadsteerTypeError), match="n_resamples"):
        stability_of(torch.zeros(4, 2, 2), n_resamples=bad)


def test_save_load_round_trip_and_refusals(tmp_path):
    st = stability_of(torch.randn(6, 2, 3), n_resamples=10, k=2, templates=[0, 1] * 3)
    path = st.save(tmp_path / "s.json")
    back = Stability.load(path)
    assert back.names == st.names and torch.equal(back.rank, st.rank)
    assert torch.allclose(back.p_top_k, st.p_top_k) and back.templates == st.templates
    with pytest.raises(HeadsteerValueError, match="exists"):
        st.save(path)
    text = path.read_text().replace('"schema_version": 1', '"schema_version": 2')
    (tmp_path / "v2.json").write_text(text)
    with pytest.raises(HeadsteerValueError, match="schema_version"):
        Stability.load(tmp_path / "v2.json")
    from heads.results.protocol import Result

    assert isinstance(st, Result) and Stability.SCHEMA == "headsteer/stability"
    frame = st.to_frame()
    assert list(frame["rank"]) == sorted(frame["rank"]) and {"p_top_k", "stable", "layer"} <= set(frame)


# ------------------------------------------------------------------------------ the analyses
@pytest.fixture(scope="module")
def llama():
    return tiny_family_model("llama")


def _pairs(n: int = 6, templates: bool = True):
    g = torch.Generator().manual_seed(5)
    clean = torch.randint(3, 200, (n, 6), generator=g).tolist()
    corr = torch.randint(3, 200, (n, 6), generator=g).tolist()
    meta = [PromptPair("c", "x", 1, meta={"template": i % 2}) for i in range(n)] if templates else None
    return pairs_from_tokens(clean, corr, list(range(5, 5 + n)), list(range(40, 40 + n)), pairs=meta)


def _forwards(model):
    calls: list[int] = []
    return calls, model.model.register_forward_pre_hook(lambda *a: calls.append(1))


def test_patching_dla_attribution_stability_reuse_the_pairs(llama):
    p = _pairs()
    assert pair_templates(p) == [0, 1] * 3
    calls, h = _forwards(llama)
    try:
        plain = patch(llama, p, "head_out")
        n_plain = len(calls)
        res = patch(llama, p, "head_out", stability=20)
        assert len(calls) == 2 * n_plain  # no forward beyond the sweep's own
    finally:
        h.remove()
    assert torch.equal(plain.raw, res.raw)
    st = res.stability
    assert st is not None and st.n_resamples == 20 and st.templates["n_templates"] == 2
    torch.testing.assert_close(st.score.reshape(res.mean.shape), res.mean, equal_nan=True)
    assert res.head_scores().stability is st and res.head_scores("sum").stability is None
    again = res.bootstrap(20, templates=[0, 1] * 3)
    assert torch.equal(again.p_top_k, st.p_top_k)  # seeded: the same resamples
    late = patch(llama, p, "head_out", layers=[1], stability=5).stability
    assert late.names[0] == "L1.H0"  # a sweep of some layers names them by their own index
    dla = direct_logit_attribution(llama, p, stability=15)
    assert dla.stability is not None
    torch.testing.assert_close(dla.stability.score.reshape(2, -1), dla.heads[..., -1].mean(0))
    assert dla.head_scores().stability is dla.stability and dla.head_scores(0).stability is None


def test_attribution_detectors_and_circuits_stability(llama, tokenizer):
    from tests.support import make_tiny

    tiny = make_tiny("llama", tokenizer)
    est = attribute(tiny, ["a b c", "d e f g", "h i"], stability=10)
    s = est.scores.stability
    assert s is not None and s.n_samples == 3
    torch.testing.assert_close(s.score.reshape(est.scores.scores.shape), est.scores.scores)
    roles = pattern_scores(llama, torch.randint(3, 200, (4, 8)), detectors="previous_token", stability=10)
    r = roles["previous_token"].stability
    assert r is not None and r.n_samples == 4
    torch.testing.assert_close(r.score.reshape(2, -1), roles["previous_token"].scores)
    from heads.scorers.gating.chg import gate_heads, gate_task

    task = gate_task(tiny, ["a b c", "d e"], [" f", " g"])
    gates = gate_heads(tiny, task, steps=2, n_masks=3, stability=10, progress=False)
    assert gates.remove.stability is not None and gates.remove.stability.n_samples == 3
    removal = gates.remove
    torch.testing.assert_close(removal.stability.score.reshape(removal.scores.shape), removal.scores)
    with pytest.raises(HeadsteerValueError, match="at least 2 gate fits"):
        gate_heads(tiny, task, steps=2, n_masks=1, stability=10, progress=False)
    p = _pairs(4)
    sc = edge_scores(llama, p, method="eap", progress=False)
    assert sc.per_pair is not None and sc.per_pair.shape == (4, sc.graph.n_edges)
    torch.testing.assert_close(sc.per_pair.mean(0), sc.values())
    c = find_circuit(llama, p, method="eap", n=20, curve=False, stability=10, progress=False)
    inc = c.stability.inclusion
    assert inc is not None and inc.shape == (sc.graph.n_edges,)
    assert float(inc.min()) >= 0 and float(inc.max()) <= 1
    # the full-sample circuit's edges are those the point scores select
    assert torch.equal(select(sc, 20).mask, c.mask)


def test_stability_bad_input_before_any_forward(llama):
    calls, h = _forwards(llama)
    try:
        for bad in (1, -3, True, "a"):
            with pytest.raises((HeadsteerValueError, HeadsteerTypeError), match="stability"):
                patch(llama, _pairs(), "head_out", stability=bad)
        with pytest.raises(HeadsteerValueError, match="at least 2 pairs"):
            direct_logit_attribution(llama, _pairs(1), stability=10)
        with pytest.raises(HeadsteerValueError, match="no head axis"):
            patch(llama, _pairs(), "resid_pre", stability=10)
        with pytest.raises(HeadsteerValueError, match="at least 2 pairs"):
            find_circuit(llama, _pairs(1), n=5, stability=10, progress=False)
    finally:
        h.remove()
    assert not calls
