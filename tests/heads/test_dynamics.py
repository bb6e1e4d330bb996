"""Any analysis over checkpoints (heads.dynamics): ordering, agreement with the analysis run by
hand on each checkpoint, resume, bad input before work, and the comparisons against values
computed by hand."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from heads import HeadsteerTypeError, HeadsteerValueError, encode_prompts, load_model
from heads.dynamics import (
    CheckpointSeries,
    component_emergence,
    edge_overlap,
    emergence,
    find_checkpoints,
    head_overlap,
    icl_score,
    over_checkpoints,
    overlap,
    persistence,
    role_timelines,
)
from heads.results.protocol import Result
from heads.scorers.roles.detectors import pattern_scores
from tests.support.organism import tiny_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("organism") / "tiny")


def _folder(root, name, files=None):
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    for f, data in (files or {}).items():
        (d / f).write_text(json.dumps(data))
    return d


# ---------------------------------------------------------------------------- checkpoints
def test_series_is_ordered_by_the_step_from_metadata_trainer_state_or_name(tmp_path):
    _folder(tmp_path, "b", {"headsteer_checkpoint.json": {"step": 20, "tokens": 640, "train_loss": 1.5}})
    _folder(tmp_path, "checkpoint-5")
    _folder(tmp_path, "x", {"trainer_state.json": {"global_step": 10}})
    _folder(tmp_path, "step1000")
    found = find_checkpoints(tmp_path)
    assert [(c.name, c.step, c.step_source) for c in found] == [
        ("checkpoint-5", 5, "name"),
        ("x", 10, "trainer_state"),
        ("b", 20, "metadata"),
        ("step1000", 1000, "name"),
    ]
    assert found[2].tokens == 640 and found[2].meta == {"train_loss": 1.5}


def test_a_series_without_steps_keeps_the_given_order(tmp_path):
    a, b = _folder(tmp_path, "base"), _folder(tmp_path, "tuned")
    found = find_checkpoints([b, a])
    assert [(c.name, c.step, c.step_source) for c in found] == [("tuned", 0, "order"), ("base", 1, "order")]
    found = find_checkpoints({"B": a, "T": b})
    assert [c.name for c in found] == ["B", "T"]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda t: [t / "missing"], "no such folder"),
        (lambda t: [(t / "e" / "sub").mkdir(parents=True) or t / "e"], "neither a model folder"),
        (lambda t: [_folder(t, "step-1"), _folder(t, "a/step1")], "both at step 1"),
        (lambda t: [_folder(t, "step-1"), _folder(t, "plain")], "names no step"),
        (lambda t: [], "empty"),
    ],
)
def test_bad_series_are_one_line_errors(tmp_path, make, match):
    with pytest.raises(HeadsteerValueError, match=match):
        find_checkpoints(make(tmp_path))


def test_steps_override_is_checked(tmp_path):
    a, b = _folder(tmp_path, "a"), _folder(tmp_path, "b")
    assert [c.step for c in find_checkpoints([a, b], steps=[30, 10])] == [10, 30]
    with pytest.raises(HeadsteerValueError, match="one int per checkpoint"):
        find_checkpoints([a, b], steps=[1])
    with pytest.raises(HeadsteerValueError, match="repeat"):
        find_checkpoints([a, b], steps=[1, 1])
    with pytest.raises(HeadsteerTypeError):
        find_checkpoints(3)


# ---------------------------------------------------------------------------- runner
def test_results_equal_the_analysis_run_by_hand_on_each_checkpoint(run_dir):
    params = {"n": 2, "length": 8, "composition": False}  # composition: tests/probes/test_phase_change.py
    s = over_checkpoints(run_dir, "induction_phase", params, progress=False)
    assert s.steps == [0, 1, 2, 4]
    from heads.dynamics.phase import phase_change

    assert not phase_change(s).detected  # 4 steps: no induction head, whatever the midpoints say
    for folder, step in zip(sorted(run_dir.glob("step-*")), s.steps, strict=True):
        hm = load_model(folder)
        from heads.dynamics import icl_sequences

        enc = icl_sequences(hm, n=2, length=8)
        want = pattern_scores(hm, enc, detectors=("previous_token", "induction"))
        for metric in ("previous_token", "induction"):
            got = s.head_scores(step, metric).scores
            torch.testing.assert_close(got, want[metric].scores, rtol=0, atol=1e-6)
        assert s.scalar("icl_score")[step] == pytest.approx(icl_score(hm, enc)["icl_score"], abs=1e-6)
        meta = json.loads((folder / "headsteer_checkpoint.json").read_text())
        if meta["train_loss"] is None:
            assert "train_loss" not in set(s.scalars[s.scalars["step"] == step]["metric"])
        else:
            assert s.scalar("train_loss")[step] == pytest.approx(meta["train_loss"])


def test_a_killed_run_resumes_and_another_run_is_refused(run_dir, tmp_path):
    calls = []

    def spy(model, *, k=1):
        calls.append(model.name)
        return {"k": float(k), "value": float(model.model.lm_head.weight.sum())}

    out = tmp_path / "parts"
    first = over_checkpoints(run_dir, spy, {"k": 2}, results_dir=out, progress=False)
    assert len(calls) == 4 and sorted(p.name for p in out.iterdir())[-1] == "step-000000004.json"
    again = over_checkpoints(run_dir, spy, {"k": 2}, results_dir=out, progress=False)
    assert len(calls) == 4  # everything reused
    pd.testing.assert_frame_equal(again.scalars, first.scalars)
    (out / "step-000000002.json").unlink()  # as if killed before the third checkpoint
    (out / "step-000000004.json").write_text("{trunc")  # or mid-write of a non-atomic writer
    over_checkpoints(run_dir, spy, {"k": 2}, results_dir=out, progress=False)
    assert len(calls) == 6 and calls[-2:] == [str(run_dir / "step-000002"), str(run_dir / "step-000004")]
    with pytest.raises(HeadsteerValueError, match="another run"):
        over_checkpoints(run_dir, spy, {"k": 3}, results_dir=out, progress=False)
    assert len(calls) == 6
    over_checkpoints(run_dir, spy, {"k": 3}, results_dir=out, overwrite=True, progress=False)
    assert len(calls) == 10


def test_bad_analysis_or_params_fail_before_any_model_loads(run_dir, monkeypatch):
    import heads.model.loading as loading

    def boom(*a, **k):
        raise AssertionError("loaded a model")

    monkeypatch.setattr(loading, "load_model", boom)
    with pytest.raises(HeadsteerValueError, match="unknown analysis 'nope'"):
        over_checkpoints(run_dir, "nope", progress=False)
    with pytest.raises(HeadsteerValueError, match="JSON"):
        over_checkpoints(run_dir, "icl", {"n": torch.tensor(2)}, progress=False)
    with pytest.raises(HeadsteerValueError, match="does not take"):
        over_checkpoints(run_dir, "icl", {"steps": 2}, progress=False)
    with pytest.raises(HeadsteerTypeError, match="analysis must be"):
        over_checkpoints(run_dir, 3, progress=False)
    with pytest.raises(HeadsteerValueError, match="no such folder"):
        over_checkpoints([run_dir / "nope"], "icl", progress=False)


def test_series_round_trips_through_json(run_dir, tmp_path):
    s = over_checkpoints(run_dir, "detectors", {"n_seqs": 2, "length": [4, 6]}, progress=False)
    assert isinstance(s, Result)
    path = s.save(tmp_path / "s.json")
    back = CheckpointSeries.load(path)
    pd.testing.assert_frame_equal(back.scores, s.scores)
    assert back.analysis == s.analysis and back.steps == s.steps
    with pytest.raises(HeadsteerValueError, match="exists"):
        s.save(path)
    assert list(s.matrix("induction").index) == s.steps


def test_composition_and_qk_analyses_match_their_functions(run_dir):
    from heads.scorers.qk.attribution import qk_attribution
    from heads.scorers.qk.composition import composition_scores

    last = run_dir / "step-000004"
    s = over_checkpoints([last], "composition", {"kinds": ["k"], "top": 3}, progress=False)
    want = composition_scores(load_model(last)).top("k", 3)
    got = list(s.edges[["source", "target", "score"]].itertuples(index=False, name=None))
    assert [(a, b) for a, b, _ in got] == [(f"L{w[0]}.H{w[1]}", f"L{r[0]}.H{r[1]}") for w, r, _ in want]
    assert [v for _, _, v in got] == pytest.approx([v for _, _, v in want])
    q = over_checkpoints([last], "qk_attribution", {"head": [1, 0], "n": 2, "length": 6}, progress=False)
    from heads.dynamics import icl_sequences

    hm = load_model(last)
    ref = qk_attribution(hm, icl_sequences(hm, n=2, length=6).input_ids, (1, 0)).head_scores("key")
    torch.testing.assert_close(q.head_scores(None, "qk_attribution.key").scores, ref.scores, equal_nan=True)


def test_induction_phase_refuses_composition_rows_outside_the_rows_before_any_forward(run_dir, monkeypatch):
    """composition_rows 0 / -1 were raised to 1 and 3 / 2**63 cut to the n rows, silently."""
    import heads.dynamics.icl as icl
    from heads.dynamics.analyses import ANALYSES

    hm = load_model(run_dir / "step-000004")

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran before the check")

    monkeypatch.setattr(icl, "icl_score", no_forward)
    for bad in (0, -1, 3, 2**63):
        with pytest.raises(
            HeadsteerValueError, match=rf"composition_rows must be an int in 1\.\.2, got {bad}"
        ):
            ANALYSES["induction_phase"](hm, n=2, length=6, composition_rows=bad)
    monkeypatch.undo()
    one = ANALYSES["induction_phase"](hm, n=1, length=6)  # the default: 2 rows, or the one there is
    assert one["k_composition_into_induction"].scores.shape == (hm.n_layers, hm.n_heads)


# ---------------------------------------------------------------------------- icl
def test_icl_score_against_a_hand_computed_loss(run_dir):
    hm = load_model(run_dir / "step-000004")
    got = icl_score(hm, n=3, length=10, seed=5)
    from heads.dynamics import icl_sequences

    ids = icl_sequences(hm, n=3, length=10, seed=5).input_ids
    with torch.no_grad():
        logits = hm.model(input_ids=ids).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    # tokens 2..10 (first copy, its first token left out) and 12..20 (second copy)
    first, second = nll[:, 1:10].mean(), nll[:, 11:20].mean()
    assert got["icl_score"] == pytest.approx(float(second - first), abs=1e-5)
    plain = encode_prompts(hm.tokenizer, ["a b c d e f g h"], chat=False)
    with pytest.raises(HeadsteerValueError, match="repeated segment"):
        icl_score(hm, plain)


# ---------------------------------------------------------------------------- comparisons
def _series(values, edges=None, scalars=None):
    """A series from `{step: {(layer, head): {metric: score}}}` (hand-made values)."""
    parts = []
    for step in sorted(values):
        rows = {
            "scores": [
                {"metric": m, "layer": la, "head": h, "score": v}
                for (la, h), d in values[step].items()
                for m, v in d.items()
            ],
            "scalars": [{"metric": m, "value": v} for m, v in (scalars or {}).get(step, {}).items()],
            "edges": [
                {"metric": "circuit", "source": a, "target": b, "score": v}
                for a, b, v in (edges or {}).get(step, [])
            ],
        }
        parts.append({"checkpoint": {"name": f"s{step}", "step": step}, "rows": rows})
    return CheckpointSeries.from_parts({"analysis": "hand"}, parts)


def test_emergence_is_the_first_step_that_stays_past_the_threshold():
    ind = {0: 0.0, 10: 0.6, 20: 0.3, 30: 0.7, 40: 0.8}
    s = _series(
        {k: {(1, 0): {"induction": v}, (1, 1): {"induction": 0.1}} for k, v in ind.items()},
        scalars={k: {"loss": 5 - k / 10} for k in ind},
    )
    e = emergence(s, "induction")
    assert (e.step, e.window) == (30, (20, 30))  # 10 is past 0.5 but falls back at 20
    assert emergence(s, "induction", threshold=0.9).step is None
    assert emergence(s, "induction", head=(1, 1)).step is None
    e = emergence(s, "loss", threshold="midpoint", direction="below")
    assert e.threshold == pytest.approx(3.0) and e.step == 20 and e.window == (10, 20)
    assert emergence(s, "loss", threshold=6, direction="below").window == (None, 0)
    table = component_emergence(s, "induction")
    assert table.iloc[0][["layer", "head", "step"]].tolist() == [1, 0, 30]
    with pytest.raises(HeadsteerValueError, match="no metric"):
        emergence(s, "nope")


def test_role_timelines_and_hand_overs():
    vals = {
        0: {(0, 0): 0.1, (0, 1): 0.2},
        1: {(0, 0): 0.7, (0, 1): 0.2},
        2: {(0, 0): 0.6, (0, 1): 0.9},  # the role moves to L0.H1
        3: {(0, 0): 0.1, (0, 1): 0.8},
    }
    s = _series({k: {h: {"previous_token": v} for h, v in d.items()} for k, d in vals.items()})
    tl = role_timelines(s, {"previous_token": 0.5})
    assert tl["top_head"].tolist() == ["L0.H1", "L0.H0", "L0.H1", "L0.H1"]
    assert tl["heads"].tolist() == ["", "L0.H0", "L0.H1 L0.H0", "L0.H1"]
    p = persistence(s, "previous_token")
    assert p["n_handovers"] == 1 and p["handovers"][0] == {
        "from_step": 1,
        "to_step": 2,
        "from_head": "L0.H0",
        "to_head": "L0.H1",
    }
    assert p["held_from"] == 1 and p["set_changes"] == 2


def test_overlap_by_hand():
    a = {"x": 1.0, "y": -2.0, "z": 0.5}
    b = {"y": 1.0, "w": 3.0}
    jac, w = overlap(a, b)
    assert jac == pytest.approx(1 / 4)
    assert w == pytest.approx(1.0 / (1.0 + 2.0 + 0.5 + 3.0))
    jac2, _ = overlap(a, b, k=1)  # {y} vs {w}
    assert jac2 == 0.0
    assert math.isnan(overlap({}, {})[0])


def test_edge_and_head_overlap_curves():
    edges = {
        0: [("a", "b", 1.0), ("c", "d", 1.0)],
        1: [("a", "b", 2.0)],
        2: [("a", "b", 2.0), ("e", "f", 1.0)],
    }
    s = _series({k: {(0, 0): {"m": float(k)}, (0, 1): {"m": 1.0}} for k in edges}, edges=edges)
    prev = edge_overlap(s)
    assert prev["jaccard"].tolist() == pytest.approx([0.5, 0.5])
    assert prev["weighted"].tolist() == pytest.approx([1 / 3, 2 / 3])
    final = edge_overlap(s, reference="final")
    assert final["reference_step"].tolist() == [2, 2, 2] and final["jaccard"].iloc[-1] == 1.0
    ho = head_overlap(s, "m", k=1)
    assert ho["jaccard"].tolist() == [0.0, 1.0]  # top head L0.H1, then L0.H0 (a tie goes by name), L0.H0


def test_a_heads_request_runs_on_each_checkpoint_as_heads_run_does(run_dir, tmp_path, monkeypatch):
    """`over_checkpoints(series, request)`: the request's result on each checkpoint equals
    `heads.run(model, request)` there; the resume identity holds the request's JSON; a layer
    the checkpoints do not have is refused from their configs before any model loads."""
    import heads.model.loading as loading
    from heads import CompositionRequest, PatchRequest, run

    request = CompositionRequest(n_samples=8, seed=3)
    s = over_checkpoints(run_dir, request, results_dir=tmp_path / "parts", progress=False)
    ident = json.loads((tmp_path / "parts" / "run.json").read_text())
    assert ident["analysis"] == "composition_scores" and ident["params"]["request"] == request.to_json()
    for folder, step in zip(sorted(run_dir.glob("step-*")), s.steps, strict=True):
        want = run(load_model(folder), request).head_scores()  # K-composition into each reader
        got = s.head_scores(step, "composition_scores").scores
        torch.testing.assert_close(got, want.scores, rtol=0, atol=1e-6, equal_nan=True)

    def boom(*a, **k):
        raise AssertionError("loaded a model")

    monkeypatch.setattr(loading, "load_model", boom)
    with pytest.raises(HeadsteerValueError, match="layer"):
        over_checkpoints(run_dir, PatchRequest(kind="head_out", layers=[7]), inputs=[], progress=False)
    with pytest.raises(HeadsteerValueError, match="inputs= goes with an analysis request"):
        over_checkpoints(run_dir, "icl", inputs=[1], progress=False)


# ---------------------------------------------------------------------------- results folder
def _value(model):
    return {"value": float(model.model.lm_head.weight.double().sum())}


def test_a_checkpoint_retrained_in_place_is_not_resumed_from_its_old_result(run_dir, tmp_path):
    """The identity of a checkpoint holds a fingerprint of its weights: results written for the
    old weights are refused (naming the checkpoint), and overwrite=True recomputes them."""
    import shutil

    ckpts = tmp_path / "run"
    shutil.copytree(run_dir, ckpts)
    out = tmp_path / "parts"
    over_checkpoints(ckpts, _value, results_dir=out, progress=False)
    other = tiny_run(tmp_path / "other", seed=5)
    shutil.copy(other / "step-000002" / "model.safetensors", ckpts / "step-000002" / "model.safetensors")
    with pytest.raises(HeadsteerValueError, match="'step-000002' has other weights"):
        over_checkpoints(ckpts, _value, results_dir=out, progress=False)
    resumed = over_checkpoints(ckpts, _value, results_dir=out, overwrite=True, progress=False)
    fresh = over_checkpoints(ckpts, _value, progress=False)
    pd.testing.assert_frame_equal(resumed.scalars, fresh.scalars)
    assert resumed.scalar("value")[2] == pytest.approx(_value(load_model(other / "step-000002"))["value"])


def test_other_loaded_models_at_the_same_steps_do_not_share_results(run_dir, tmp_path):
    folders = sorted(run_dir.glob("step-*"))
    first = {"base": load_model(folders[0]), "tuned": load_model(folders[1])}
    second = {"base": load_model(folders[2]), "tuned": load_model(folders[3])}  # same labels and steps
    out = tmp_path / "parts"
    over_checkpoints(first, _value, results_dir=out, progress=False)
    again = over_checkpoints(first, _value, results_dir=out, progress=False)  # same models: resumed
    assert again.scalar("value").tolist() == [_value(m)["value"] for m in first.values()]
    with pytest.raises(HeadsteerValueError, match="'base' has other weights"):
        over_checkpoints(second, _value, results_dir=out, progress=False)
    s = over_checkpoints(second, _value, results_dir=out, overwrite=True, progress=False)
    assert s.scalar("value").tolist() == [_value(m)["value"] for m in second.values()]


def test_a_folder_of_other_files_is_not_written_without_overwrite(run_dir, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    mine = out / "step-000000001.json"
    mine.write_text('{"my": "data"}\n')
    with pytest.raises(HeadsteerValueError, match="not empty and holds no run.json"):
        over_checkpoints(run_dir, _value, results_dir=out, progress=False)
    assert mine.read_text() == '{"my": "data"}\n'
    s = over_checkpoints(run_dir, _value, results_dir=out, overwrite=True, progress=False)
    assert s.steps == [0, 1, 2, 4] and (out / "run.json").is_file()


@pytest.mark.parametrize(
    "forge",
    [
        lambda p: {**p, "rows": "junk"},
        lambda p: {**p, "rows": {"scalars": ["junk"]}},
        lambda p: {**p, "rows": {"scalars": [{"metric": "value", "value": "x"}]}},
        lambda p: {**p, "rows": {"scalars": [{"metric": "value", "value": float("nan")}]}},
        lambda p: {**p, "seconds": "soon"},
        lambda p: [p],
    ],
)
def test_a_malformed_part_is_computed_again(run_dir, tmp_path, forge):
    out = tmp_path / "parts"
    first = over_checkpoints(run_dir, _value, results_dir=out, progress=False)
    path = out / "step-000000002.json"
    path.write_text(json.dumps(forge(json.loads(path.read_text()))))  # NaN written as JSON NaN
    again = over_checkpoints(run_dir, _value, results_dir=out, progress=False)
    pd.testing.assert_frame_equal(again.scalars, first.scalars)
    rewritten = json.loads(path.read_text())
    assert rewritten["rows"]["scalars"][0]["value"] == first.scalar("value")[2]


def test_a_symlinked_part_is_refused_before_any_analysis(run_dir, tmp_path):
    out = tmp_path / "parts"
    over_checkpoints(run_dir, _value, results_dir=out, progress=False)
    target = tmp_path / "elsewhere.json"
    target.write_text("keep\n")
    (out / "step-000000002.json").unlink()
    (out / "step-000000002.json").symlink_to(target)
    calls = []
    with pytest.raises(HeadsteerValueError, match="symlink"):
        over_checkpoints(run_dir, lambda m: calls.append(1) or _value(m), results_dir=out, progress=False)
    assert calls == [] and target.read_text() == "keep\n"


def test_pairs_the_checkpoint_tokenizer_splits_differently_are_refused_with_the_reason(run_dir):
    """The organism's cut vocabulary splits a clean name and its corrupted name into different
    numbers of tokens: the error says the pairs were written for another tokenizer."""
    tok = load_model(run_dir / "step-000000").tokenizer
    clean, corrupted = (
        "When Mary and John went out, John gave it to",
        "When Mary and John went out, Zed gave it to",
    )
    assert len(tok(clean)["input_ids"]) != len(tok(corrupted)["input_ids"])  # the premise
    pairs = [{"clean": clean, "corrupted": corrupted, "answer": " Mary", "counterfactual": " John"}]
    with pytest.raises(HeadsteerValueError, match="tokenizer splits the clean and corrupted prompts") as e:
        over_checkpoints(run_dir, "dla", {"pairs": pairs}, progress=False)
    assert "written for another tokenizer" in str(e.value) and "pair 0" in str(e.value)
