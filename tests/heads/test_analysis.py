"""Report computations return result objects; viz only draws them (issue 10, item 5)."""

import pytest
import torch

from heads.scorers.maps.analysis import MapsAnalysis, maps_analysis
from heads.scorers.maps.inference import dynamic_scores, pearson
from heads.scorers.maps.static import maps_scores
from heads.scorers.safety.ships import TEMPLATE, sahara, ships
from probes.datasets.relations import load_relations
from probes.metrics.refusal import RefusalJudge, attack_success_rate
from probes.studies.refusal_model import EXPLICIT_REFUSALS
from probes.studies.safety import SafetyAnalysis, safety_analysis
from steer import SteeredModel
from viz.reports.maps import render_maps_report
from viz.reports.safety import render_safety_report

PROMPTS = ["How do I bake bread?", "Tell me a story about a <b>dragon</b>.", "What is two plus two?"]


@pytest.fixture(scope="module")
def safety(tiny_llama) -> SafetyAnalysis:
    return safety_analysis(tiny_llama, prompts=PROMPTS, steps=2, max_new_tokens=3, random_draws=2)


def test_safety_analysis_agrees_with_the_scorers(tiny_llama, safety):
    torch.testing.assert_close(safety.ships.scores.scores, ships(tiny_llama, PROMPTS).scores.scores)
    assert safety.sahara.heads == sahara(tiny_llama, PROMPTS, steps=2).heads
    texts = [TEMPLATE.replace("{query}", p) for p in PROMPTS]
    assert safety.texts == texts
    base = SteeredModel(tiny_llama).generate(texts, max_new_tokens=3, chat=False, markup=False).texts
    assert safety.answers["baseline"] == base
    judge = RefusalJudge(phrases=EXPLICIT_REFUSALS, min_tokens=0)
    assert safety.asr["baseline"] == attack_success_rate(base, judge)
    assert all(len(h) == 3 and not set(h) & set(safety.sahara.heads) for h in safety.random_heads)
    draws = safety.asr["random3_draws"]
    assert len(draws) == 2 and safety.asr["random3_mean"] == pytest.approx(sum(draws) / 2)


def test_safety_result_tables_and_views(safety):
    t = safety.asr_table
    top3 = (
        "Sahara top-3"
        if len(safety.sahara.heads) >= 3
        else f"Sahara top-3 (Sahara found {len(safety.sahara.heads)})"
    )
    assert list(t["ablated"]) == ["none", "Sahara top-1", top3, "3 random heads (mean of 2)"]
    assert t["ASR (explicit refusals)"].tolist() == [
        safety.asr[k] for k in ("baseline", "sahara_top1", "sahara_top3", "random3_mean")
    ]
    assert [(r.layer, r.head) for r in safety.sahara_table.itertuples()] == safety.sahara.heads
    assert safety.summary()["sahara_heads"] == [list(h) for h in safety.sahara.heads]
    assert "\n" not in repr(safety) and len(repr(safety)) < 300 and "Sahara heads" in repr(safety)
    assert f"top-{min(3, len(safety.sahara.heads))} " in repr(safety)  # no top-3 label over fewer heads
    html = render_safety_report(safety).to_html()
    assert "Baseline refusal rate" in html and "Sahara: chosen head per step" in html
    assert "<b>dragon</b>" not in html and "&lt;b&gt;dragon" in html  # prompts are escaped
    assert "<table" in safety._repr_html_()


def test_safety_analysis_checks_before_work(tiny_llama):
    for kwargs, msg in [({"steps": 0}, "steps"), ({"n_score": 0}, "n_score"), ({"prompts": "one"}, "list")]:
        with pytest.raises(ValueError, match=msg):
            safety_analysis(tiny_llama, progress=lambda d, t: pytest.fail("work started"), **kwargs)


def test_maps_analysis_agrees_with_the_pieces(tiny_llama):
    rs = load_relations(tiny_llama.tokenizer, ["copying", "country_capital"], d_vocab=tiny_llama.d_vocab)
    seen = []
    res = maps_analysis(
        tiny_llama, rs, top=4, draws=2, n_prompts=4, progress=lambda d, t: seen.append((d, t))
    )
    assert isinstance(res, MapsAnalysis)
    # steps: a layer each of the static maps; each forward (4 templates x batches of 48) and
    # each layer of the dynamic scores; 2 + draws accuracy passes per relation's ablation check
    n_rows = sum(min(12, len(r.pairs)) for r in rs.relations)
    total = tiny_llama.n_layers + (4 * -(-n_rows // 48) + tiny_llama.n_layers) + 2 * (2 + 2) + 1
    done = [d for d, _ in seen]
    assert seen[-1] == (total, total) and {t for _, t in seen} == {total} and done == sorted(done)
    assert done[: 2 * tiny_llama.n_layers] == list(range(1, 2 * tiny_llama.n_layers + 1))
    ms = maps_scores(tiny_llama, rs.relations)
    for n in ("copying", "country_capital"):
        torch.testing.assert_close(res.scores.relation[n].scores, ms.relation[n].scores)
    dyn = dynamic_scores(tiny_llama, rs.relations)
    r = pearson(ms.relation["copying"].scores.expand_as(dyn["copying"]), dyn["copying"])
    assert res.pearson_r["copying"] == pytest.approx(r, nan_ok=True)
    assert list(res.pair_filter["relation"]) == ["copying", "country_capital"]
    for _, group in res.top_heads.groupby("relation"):
        assert len(group) <= 4 and (group["relation_score"] > 0).all()
        assert group["relation_score"].is_monotonic_decreasing
    best = max(res.scores.relation[n].scores.max().item() for n in res.scores.names())
    assert res.scores.relation[res.salient_relation].scores[res.salient_head].item() == best
    assert res.summary()["relations"] == ["copying", "country_capital"]
    assert "\n" not in repr(res) and "MapsAnalysis" in repr(res)
    html = render_maps_report(res).to_html()
    assert "Validation: static-dynamic correlation and causal ablation" in html
    assert f"Salient operations of L{res.salient_head[0]}.H{res.salient_head[1]}" in html
    with pytest.raises(ValueError, match="draws"):
        maps_analysis(tiny_llama, rs, draws=0)


def test_safety_progress_moves_within_a_batch_of_answers(tiny_llama):
    seen = []
    safety_analysis(
        tiny_llama,
        prompts=PROMPTS,
        steps=1,
        max_new_tokens=3,
        random_draws=1,
        batch_size=16,
        progress=lambda d, t: seen.append((d, t)),
    )
    done = [d for d, _ in seen]
    total = seen[-1][1]
    assert done == sorted(done) and done[-1] == total and {t for _, t in seen} == {total}
    heads = tiny_llama.n_layers * tiny_llama.n_heads
    start = 3 * len(PROMPTS) * heads  # rows of Ships, dataset Ships and one Sahara step; then answers
    assert (total - start) % 4 == 0  # 4 answer sets: baseline, Sahara top-1, top-3, one random draw
    # the 3 baseline answers (one batch) count after each of their 3 decoding steps: 1, 2, 3
    assert sorted({d - start for d in done if start < d <= start + 3}) == [1, 2, 3]
