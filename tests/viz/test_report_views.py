"""Reports and result objects say what they show; `report all` shares one plotly.min.js;
t and Wilson intervals through scipy, named in the evaluation table."""

import numpy as np
import pytest
import torch
from plotly.offline import get_plotlyjs

from heads import HeadScores
from heads.results.views import scores_title, top_heads_text
from heads.scorers.safety.ships import sahara, ships
from probes.metrics.tasks import INTERVAL_METHODS, mean_interval, wilson_interval
from probes.studies.evaluate import evaluate
from viz.reports.all import all_reports
from viz.reports.base import PLOTLY_JS, Report, shared_plotlyjs

PROMPTS = ["How do I bake bread?", "Tell me a story about a dragon.", "What is two plus two?"]
HEADS = [(0, 1), (1, 0), (2, 2), (2, 3)]


def _report():
    import plotly.graph_objects as go

    rep = Report("A <title>", "m")
    rep.figure("Fig", go.Figure(go.Bar(y=[1, 2])), note="What the <bars> show.")
    rep.table("Tab", __import__("pandas").DataFrame({"a": [1]}), note="One row.")
    return rep


def test_report_inline_or_shared_plotlyjs(tmp_path):
    js = get_plotlyjs()
    single = _report().save(tmp_path / "single.html")
    text = single.read_text()
    assert js[:2000] in text and len(text) > len(js)  # self-contained
    assert "What the &lt;bars&gt; show." in text and "<p class='note'>One row.</p>" in text
    with pytest.raises(ValueError, match="exists"):
        _report().save(single)
    _report().save(single, overwrite=True)
    folder = tmp_path / "all"
    with shared_plotlyjs(folder) as path:
        assert path == folder / PLOTLY_JS and path.read_text() == js
        a = _report().save(folder / "a.html").read_text()
        b = _report().save(folder / "b.html").read_text()
    for page in (a, b):
        assert f"src='{PLOTLY_JS}'" in page and js[:2000] not in page and len(page) < 100_000
    after = _report().save(folder / "c.html").read_text()
    assert js[:2000] in after  # outside the block: self-contained again
    with pytest.raises(ValueError, match="exists"):
        with shared_plotlyjs(folder):
            pass


def test_report_all_writes_plotlyjs_once(tiny_llama, tmp_path):
    out = tmp_path / "reports"
    seen = []
    written = all_reports(tiny_llama, out, draws=1, n_prompts=3, progress=lambda d, t: seen.append((d, t)))
    assert written["plotly_js"] == out / PLOTLY_JS
    done = [d for d, _ in seen]
    assert done == sorted(done) and seen[-1][0] == seen[-1][1] and all(d <= t for d, t in seen)
    assert done[:3] == [1, 2, 3]  # the attention page's decoding steps count too, one by one
    assert seen[-1][1] > 2 * 48 + 1  # then the MAPS steps
    assert {t for _, t in seen} == {seen[-1][1]}  # the total is the whole run's from the first step
    js_size = (out / PLOTLY_JS).stat().st_size
    for name in ("attention.html", "maps.html"):
        page = (out / name).read_text()
        assert f"src='{PLOTLY_JS}'" in page and get_plotlyjs()[:2000] not in page
    total = sum(p.stat().st_size for p in out.iterdir())
    assert total < 1.5 * js_size  # one copy of plotly.js, not one per page
    maps = (out / "maps.html").read_text()
    assert "MAPS relation score: copying (top-1)" in maps  # figure titles name the relation
    assert "relations: " in maps.split("</h1>")[0]  # and the page title names them
    with pytest.raises(ValueError, match="exists"):
        all_reports(tiny_llama, out, draws=1, n_prompts=3, progress=False)


def test_scores_titles_name_what_is_scored():
    s = HeadScores(torch.rand(2, 3), "maps_relation", {"relation": "country_capital", "k": 10}, "M")
    assert scores_title(s) == "MAPS relation score: country_capital (top-10) — M"
    p = HeadScores(torch.rand(2, 3), "pasta_profile", {"task": "json_format", "alpha": 0.01}, "M")
    assert scores_title(p).startswith("PASTA profile: task json_format")
    odd = HeadScores(torch.rand(2, 3), "my_method", {"relation": "r"}, "M")
    assert scores_title(odd) == "my_method (relation r) — M"
    assert scores_title(HeadScores(torch.rand(2, 3), "ships", {}, "M")) == "ships — M"  # missing params


def test_head_scores_view_with_inf_has_no_nan_colour():
    s = HeadScores(torch.tensor([[0.0, 1.0], [float("inf"), float("-inf")]]), "x")
    view = s._repr_html_()
    assert "nan" not in view
    assert "rgba(49,104,142,1.00)" in view and "rgba(49,104,142,0.10)" in view  # +inf top, -inf bottom
    assert top_heads_text(s, 2) == "L1.H0 inf, L0.H1 1"


def test_ships_and_sahara_print_short(tiny_llama):
    res = ships(tiny_llama, PROMPTS, heads=HEADS, progress=False)
    text = repr(res)
    assert "tensor(" not in text and "\n" not in text and len(text) < 300
    la, h = res.scores.ranked(1)[0]
    assert f"L{la}.H{h}" in text and f"{len(PROMPTS)} prompts x {len(HEADS)} of" in text
    view = res._repr_html_()
    assert view.count("<tr>") >= len(HEADS) and "tensor(" not in view
    sa = sahara(tiny_llama, PROMPTS, heads=HEADS, steps=2, progress=False)
    text = repr(sa)
    assert "tensor(" not in text and "\n" not in text
    first, second = sa.heads
    assert text.index(f"L{first[0]}.H{first[1]}") < text.index(f"L{second[0]}.H{second[1]}")
    assert sa._repr_html_().count("<tr>") == 3  # header + one row per step


def test_mean_interval_is_student_t():
    # t(0.975, df) table values: 12.7062 (df 1), 2.1314 (df 15)
    low, high = mean_interval([0.0, 1.0])
    assert high - 0.5 == pytest.approx(12.7062047 * (0.5**0.5) / 2**0.5, rel=1e-6)
    x = np.arange(16.0)
    low, high = mean_interval(x)
    assert (high - low) / 2 == pytest.approx(2.1314495 * x.std(ddof=1) / 4, rel=1e-6)
    low90, high90 = mean_interval(x, confidence=0.90)
    assert (high90 - low90) / 2 == pytest.approx(1.7530503 * x.std(ddof=1) / 4, rel=1e-6)
    for bad in (0, 1, 1.5, True):
        with pytest.raises(ValueError, match="confidence"):
            mean_interval(x, confidence=bad)


def test_t_interval_covers_and_normal_undercovers_at_n16():
    rng = np.random.default_rng(0)
    samples = rng.normal(size=(4000, 16))
    t_cover = np.mean([lo <= 0 <= hi for lo, hi in map(mean_interval, samples)])
    half_z = 1.959964 * samples.std(axis=1, ddof=1) / 4
    z_cover = np.mean(np.abs(samples.mean(1)) <= half_z)
    assert abs(t_cover - 0.95) < 0.012  # 3 standard errors at 4000 draws
    assert z_cover < t_cover and z_cover < 0.945


def test_wilson_interval_through_scipy():
    low, high = wilson_interval(8, 10)  # z = 1.959964 (scipy), hand value at z = 1.96: (0.4902, 0.9433)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    low, high = wilson_interval(0, 16)
    assert low == 0.0 and high == pytest.approx(1.959964**2 / (16 + 1.959964**2), rel=1e-6)


def test_eval_table_names_its_interval(tiny_llama):
    res = evaluate(tiny_llama, "json_format", limit=3, max_new_tokens=3, progress=False)
    assert dict(zip(res.table.metric, res.table.interval, strict=True)) == {
        "json_valid": INTERVAL_METHODS["rate"],
        "field_accuracy": INTERVAL_METHODS["mean"],
    }
    text = repr(res)
    assert "json_format / none" in text and "Student t 95%" in text and "\n" not in text
    assert "<table" in res._repr_html_()
