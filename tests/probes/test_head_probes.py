"""Per-head activation collection and probes (probes/head_probes.py) on tiny random models."""

import math

import numpy as np
import pytest
import torch

from heads import encode_prompts, forward
from probes.head_probes import collect_head_outputs, fit_head_probes, probe_data
from probes.metrics.tasks import wilson_interval

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "A short one",
    "Paris is the capital of France and a big city",
    "Hello there",
    "Seven",
]


def _oracle(hm, prompts, pick):
    """o_proj input per head, each prompt run alone (no padding), via plain torch hooks."""
    rows = []
    for p in prompts:
        enc = encode_prompts(hm.tokenizer, [p], chat=False, markup=False)
        seen = {}
        handles = [
            m.register_forward_pre_hook(
                lambda mod, args, la=la, seen=seen: seen.__setitem__(la, args[0][0].clone())
            )
            for la, m in enumerate(hm.out_projs)
        ]
        try:
            forward(hm, enc)
        finally:
            for h in handles:
                h.remove()
        per_layer = []
        for la in range(hm.n_layers):
            z = seen[la].reshape(enc.length, hm.n_heads, hm.d_head)
            per_layer.append(pick(z, enc))
        rows.append(torch.stack(per_layer))
    return torch.stack(rows)


def test_collect_matches_unpadded_hooks(tiny_llama):
    hm = tiny_llama
    enc = encode_prompts(hm.tokenizer, PROMPTS, chat=False, markup=False)
    before = forward(hm, enc)
    got = collect_head_outputs(hm, PROMPTS, "last", batch_size=2, chat=False)
    assert got.shape == (len(PROMPTS), hm.n_layers, hm.n_heads, hm.d_head)
    want = _oracle(hm, PROMPTS, lambda z, enc: z[-1])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(forward(hm, enc), before)  # the model is left as it was


def test_positions_int_callable_span(tiny_llama):
    hm = tiny_llama
    last = collect_head_outputs(hm, PROMPTS, "last", chat=False)
    assert torch.equal(collect_head_outputs(hm, PROMPTS, -1, chat=False), last)
    first = collect_head_outputs(hm, PROMPTS, 0, chat=False)
    torch.testing.assert_close(first, _oracle(hm, PROMPTS, lambda z, enc: z[0]), atol=1e-5, rtol=1e-5)
    by_fn = collect_head_outputs(
        hm, PROMPTS, lambda enc: torch.full((enc.batch,), enc.length - 1), chat=False
    )
    assert torch.equal(by_fn, last)
    # span: the mean over the emphasized tokens
    prompts = ["The quick **brown fox** jumps", "Hello **there** friend"]
    span = collect_head_outputs(hm, prompts, "span", chat=False, markup=True)

    def mean_span(z, enc):
        t0, t1 = enc.spans[0][0]
        return z[t0:t1].mean(0)

    oracle = []
    for p in prompts:
        enc = encode_prompts(hm.tokenizer, [p], chat=False)
        seen = {}
        hs = [
            m.register_forward_pre_hook(
                lambda mod, a, la=la, seen=seen: seen.__setitem__(la, a[0][0].clone())
            )
            for la, m in enumerate(hm.out_projs)
        ]
        forward(hm, enc)
        for h in hs:
            h.remove()
        oracle.append(
            torch.stack(
                [mean_span(seen[la].reshape(enc.length, hm.n_heads, -1), enc) for la in range(hm.n_layers)]
            )
        )
    torch.testing.assert_close(span, torch.stack(oracle), atol=1e-5, rtol=1e-5)


def test_memmap_streaming(tiny_llama, tmp_path):
    hm = tiny_llama
    ram = collect_head_outputs(hm, PROMPTS, chat=False)
    spill = collect_head_outputs(hm, PROMPTS, chat=False, max_bytes=0)
    assert not spill.numpy().flags.owndata  # a view of the mapped file
    assert torch.equal(spill, ram)
    path = tmp_path / "acts.f32"
    onfile = collect_head_outputs(hm, PROMPTS, chat=False, path=path)
    assert torch.equal(onfile, ram)
    back = np.memmap(path, dtype=np.float32, mode="r", shape=tuple(ram.shape))
    assert np.array_equal(back, ram.numpy())
    with pytest.raises(ValueError, match="exists"):
        collect_head_outputs(hm, PROMPTS, chat=False, path=path)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompts=[]), "empty"),
        (dict(prompts="one string"), "list of prompts"),
        (dict(position="middle"), "position"),
        (dict(batch_size=0), "batch_size"),
        (dict(position=40), "outside prompt"),
        (dict(position=lambda enc: torch.zeros(3)), "position function"),
        (dict(position="span"), "span"),
    ],
)
def test_collect_bad_input(tiny_llama, kwargs, match):
    args = dict(prompts=PROMPTS, position="last", chat=False) | kwargs
    with pytest.raises(ValueError, match=match):
        collect_head_outputs(tiny_llama, args.pop("prompts"), **args)


def _planted(n=120, layers=2, heads=3, d=8, seed=0):
    """Random activations; head (1, 2) carries the label along a known direction."""
    g = np.random.default_rng(seed)
    x = g.normal(size=(n, layers, heads, d)).astype(np.float32)
    y = np.array([0, 1] * (n // 2))
    direction = g.normal(size=d)
    direction /= np.linalg.norm(direction)
    x[:, 1, 2, :] += (3.0 * (2 * y - 1))[:, None] * direction[None, :].astype(np.float32)
    return x, y, direction


def test_probe_finds_planted_head_and_matches_sklearn():
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import StratifiedKFold, cross_val_predict

    x, y, direction = _planted()
    res = fit_head_probes(x, y, cv=5, seed=3)
    assert res.ranked(1) == [(1, 2)]
    assert res.accuracy.scores[1, 2] > 0.95
    assert float(np.dot(res.mass_mean_directions[1, 2].numpy(), direction)) > 0.95
    assert float(np.dot(res.probe_directions[1, 2].numpy(), direction)) > 0.9
    assert torch.allclose(res.mass_mean_directions.norm(dim=-1), torch.ones(2, 3))
    # oracle: sklearn's own cross_val_predict with the same folds, on a noise head
    folds = StratifiedKFold(5, shuffle=True, random_state=3)
    xh = x[:, 0, 1, :].astype(np.float64)
    pred = cross_val_predict(LogisticRegression(max_iter=1000), xh, y, cv=folds)
    correct = int((pred == y).sum())
    assert res.accuracy.scores[0, 1].item() == pytest.approx(correct / len(y))
    low, high = wilson_interval(correct, len(y))
    assert res.accuracy_low[0, 1].item() == pytest.approx(low, abs=1e-6)
    assert res.accuracy_high[0, 1].item() == pytest.approx(high, abs=1e-6)
    dec = cross_val_predict(LogisticRegression(max_iter=1000), xh, y, cv=folds, method="decision_function")
    assert res.auc.scores[0, 1].item() == pytest.approx(roc_auc_score(y, dec), abs=1e-6)
    # sigma: the std of the activations along the direction
    mm = res.mass_mean_directions[1, 2].double().numpy()
    assert res.mass_mean_sigma[1, 2].item() == pytest.approx(
        np.std(x[:, 1, 2].astype(np.float64) @ mm), rel=1e-5
    )
    # noise heads sit near chance: the 95% interval covers 0.5 for most of them
    noise = [(la, h) for la in range(2) for h in range(3) if (la, h) != (1, 2)]
    covered = sum(res.accuracy_low[la, h] <= 0.5 <= res.accuracy_high[la, h] for la, h in noise)
    assert covered >= len(noise) - 1


def test_deterministic_and_parallel_equal():
    x, y, _ = _planted(n=60, seed=1)
    from joblib import parallel_config

    a = fit_head_probes(x, y, seed=7, n_jobs=1)
    with parallel_config(backend="threading"):  # process workers take a minute to start on 2 cores
        b = fit_head_probes(torch.from_numpy(x), torch.from_numpy(y), seed=7, n_jobs=2)
    for key in ("probe_directions", "mass_mean_directions", "probe_sigma", "auc_low"):
        assert torch.equal(getattr(a, key), getattr(b, key))
    assert torch.equal(a.accuracy.scores, b.accuracy.scores)


def test_any_estimator_and_groups():
    from sklearn.neighbors import KNeighborsClassifier

    x, y, _ = _planted(n=60, seed=2)
    res = fit_head_probes(x, y, estimator=KNeighborsClassifier(5))
    assert torch.isnan(res.probe_directions).all()  # no coef_: no probe direction
    assert not torch.isnan(res.mass_mean_directions).any()
    assert res.accuracy.scores[1, 2] > 0.9
    groups = np.arange(60) // 2  # pairs (0, 1), (2, 3), ... stay in one fold
    res = fit_head_probes(x, y, groups=groups)
    assert res.accuracy.scores[1, 2] > 0.9


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda x, y: (x[:, 0], y), "acts must be"),
        (lambda x, y: (x, y[:-1]), "labels must have shape"),
        (lambda x, y: (x, y + 1), "binary"),
        (lambda x, y: (np.where(np.arange(x.size).reshape(x.shape) == 5, np.nan, x), y), "NaN"),
        (lambda x, y: (x, np.r_[np.zeros(len(y) - 2), [1, 1]].astype(int)), "at least cv"),
    ],
)
def test_fit_bad_input(mutate, match):
    x, y, _ = _planted(n=20)
    x, y = mutate(x, y)
    with pytest.raises(ValueError, match=match):
        fit_head_probes(x, y)


def test_fit_bad_cv():
    x, y, _ = _planted(n=20)
    with pytest.raises(ValueError, match="cv"):
        fit_head_probes(x, y, cv=1)


def test_probe_data_labelling():
    cf = probe_data("counterfact", "train", limit=10)
    assert len(cf.prompts) == 20 and sum(cf.labels) == 10
    assert cf.groups[:4] == [0, 0, 1, 1]
    from probes.datasets.tasks import load_task

    e = load_task("counterfact", "train").examples[0]
    current = e.emphasize  # "Currently, ... {new}."
    assert cf.prompts[:2] == [e.prompt + " " + e.choices[0], e.prompt + " " + e.choices[1]]
    assert cf.labels[:2] == [1, 0]  # label 1: the answer stated by the current context sentence
    assert e.choices[e.label] in current and e.choices[1 - e.label] not in current
    harm = probe_data("harmful", "test")
    assert set(harm.labels) == {0, 1} and harm.chat
    sent = probe_data("sentiment", "test")
    assert len(sent.prompts) == 80 and 0 < sum(sent.labels) < 80
    with pytest.raises(ValueError, match="unknown probe task"):
        probe_data("truthfulqa")


def test_auc_interval_uses_the_harness_quantile():
    # fit_head_probes' accuracy intervals are the harness's wilson_interval; its AUC interval
    # uses the same two-sided 95% normal quantile
    from scipy.stats import norm

    from probes.head_probes import _Z95

    assert _Z95 == pytest.approx(float(norm.ppf(0.975)), abs=1e-12)
    assert math.isclose(sum(wilson_interval(45, 90)), 1.0, abs_tol=1e-12)


def test_probes_report_and_cli(tiny_llama, tiny_llama_dir, tmp_path):
    import json

    from typer.testing import CliRunner

    from viz.cli.main import app
    from viz.reports.probes import FIT_STEPS, direction_cosines, probes_report

    out = tmp_path / "probes.html"
    seen = []
    path, summary = probes_report(
        tiny_llama,
        out,
        tasks=["sentiment", "counterfact"],
        limit=10,
        top=3,
        cv=3,
        batch_size=4,
        progress=lambda d, t: seen.append((d, t)),
    )
    total = 10 + FIT_STEPS + 20 + FIT_STEPS  # prompts collected, then a fit, per task
    # per batch of 4 prompts, then the fit a layer (4 of 12 heads) at a time: 50 * 4 // 12 = 16, ...
    collect = [4, 8, 10], [64, 68, 72, 76, 80]
    fits = [10 + 16, 10 + 33, 60], [80 + 16, 80 + 33, 130]
    assert [d for d, _ in seen] == collect[0] + fits[0] + collect[1] + fits[1]
    assert {t for _, t in seen} == {total}
    html = path.read_text()
    assert "held-out probe accuracy" in html and "direction cosine" in html
    assert summary["tasks"]["counterfact"]["rows"] == 20 and summary["tasks"]["sentiment"]["rows"] == 10
    assert 0 <= summary["cosine"]["sentiment~counterfact"] <= 1
    with pytest.raises(ValueError, match="exists"):
        probes_report(tiny_llama, out, tasks=["sentiment"], limit=10)
    x, y, _ = _planted(n=40)
    res = fit_head_probes(x, y)
    torch.testing.assert_close(direction_cosines(res, res), torch.ones(2, 3))

    runner = CliRunner()
    r = runner.invoke(app, ["report", "probes", "--out", str(tmp_path / "p.html"), "--tasks", "truth"])
    assert r.exit_code == 2 and "unknown --tasks entry 'truth'" in r.output
    cli_out = tmp_path / "cli.html"
    args = [
        "report",
        "probes",
        "--out",
        str(cli_out),
        "--tasks",
        "sentiment",
        "--limit",
        "10",
        "--cv",
        "3",
        "--json",
    ]
    r = runner.invoke(app, [*args, "--model", tiny_llama_dir, "--quiet"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["tasks"]["sentiment"]["rows"] == 10
    assert cli_out.is_file()


def test_fit_takes_the_model_for_its_kv_heads(tiny_llama):
    """`model=<HeadModel>` records the model's name and GQA grouping (the README path): the
    `kv_head` column is head // (n_heads / n_kv_heads), not the query head."""
    x, y, _ = _planted(n=40, layers=tiny_llama.n_layers, heads=tiny_llama.n_heads, d=4)
    res = fit_head_probes(x, y, seed=0, model=tiny_llama, progress=False)
    frame = res.accuracy.to_frame()
    group = tiny_llama.n_heads // tiny_llama.n_kv_heads
    assert group > 1
    assert (frame["kv_head"] == frame["head"] // group).all()
    assert res.accuracy.model == tiny_llama.name
    wrong, _, _ = _planted(n=40, layers=tiny_llama.n_layers, heads=tiny_llama.n_heads - 1, d=4)
    with pytest.raises(ValueError, match=r"acts have \[L, H\]"):
        fit_head_probes(wrong, y, model=tiny_llama, progress=False)
    with pytest.raises(ValueError, match="n_kv_heads=4"):
        fit_head_probes(x, y, model=tiny_llama, n_kv_heads=4, progress=False)
    with pytest.raises(TypeError, match="model must be a HeadModel"):
        fit_head_probes(x, y, model=3, progress=False)  # type: ignore[arg-type]
