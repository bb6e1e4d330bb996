"""Bad input to the head-role API (detectors, Attention Lens, head atlas): one-line headsteer errors
raised before any work, objects left unchanged. Tiny hand-built model only (no forward where the
check comes first)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import heads.scorers.roles.atlas as atlas_mod
from heads import HeadsteerTypeError, HeadsteerValueError
from heads.results.scores import HeadScores
from heads.scorers.roles import (
    MAX_COPYING_TOKENS,
    AttentionLens,
    HeadAtlas,
    LensData,
    copying_scores,
    detect_roles,
    head_atlas,
    needle_prompts,
    pattern_scores,
    random_tokens,
    repeated_tokens,
    retrieval_scores,
    successor_scores,
    train_lens,
)
from heads.scorers.roles.atlas import pattern_thumbnails, role_labels
from tests.support.role_models import make_role_model

ERR = (HeadsteerValueError, HeadsteerTypeError)


@pytest.fixture(scope="module")
def model():
    return make_role_model()


def _scores(model, value: float = 0.0, name: str | None = None, method: str = "x") -> HeadScores:
    s = torch.full((model.n_layers, model.n_heads), value)
    return HeadScores(s, method, model=model.name if name is None else name)


@pytest.fixture(scope="module")
def det(model):
    """Cheap stand-in detector scores: induction on (1, 0), previous-token on (0, 0)."""
    ind, prev = _scores(model), _scores(model)
    ind.scores[1, 0], prev.scores[0, 0] = 1.0, 1.0
    return {"induction": ind, "previous_token": prev}


def _roles(atlas: HeadAtlas) -> dict[tuple[int, int], str]:
    return {(int(r.layer), int(r.head)): r.role for r in atlas.frame.itertuples()}


def _one_line(err: pytest.ExceptionInfo, *words: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg and msg
    for w in words:
        assert w in msg, msg


# ---------------------------------------------------------------- detectors
@pytest.mark.parametrize(
    "rows, word",
    [
        ([[1, 2.5, 3]], "2.5"),
        ([[True, 2, 3]], "True"),
        ([["a", 2, 3]], "'a'"),
        ([[math.nan, 2, 3]], "nan"),
        ([[]], "empty"),
        ([], "empty"),
        (torch.tensor([[1.0, 2.0]]), "integer"),
        (torch.tensor([[True, False]]), "integer"),
        ([torch.tensor([1.0, 2.0])], "integer"),
        (torch.tensor([[1, 99]]), "vocabulary"),
    ],
)
def test_pattern_scores_token_ids(model, rows, word):
    with pytest.raises(HeadsteerValueError) as err:
        pattern_scores(model, rows)
    _one_line(err, word)


def test_pattern_scores_numpy_ids_accepted(model):
    rows = [[0, 5, 6, 7, 5, 6, 7]]
    a = pattern_scores(model, rows, detectors="induction")["induction"]
    b = pattern_scores(model, [[np.int64(x) for x in rows[0]]], detectors="induction")["induction"]
    c = pattern_scores(model, torch.tensor(rows, dtype=torch.int16), detectors="induction")["induction"]
    assert torch.equal(a.scores, b.scores) and torch.equal(a.scores, c.scores)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"detectors": None}, "detectors"),
        ({"detectors": ()}, "detector"),
        ({"rows": ["target"]}, "rows"),
        ({"exclude_bos": 1}, "exclude_bos"),
        ({"exclude_current_token": "yes"}, "exclude_current_token"),
        ({"batch_size": 0}, "max_rows"),
        ({"batch_size": 2.0}, "max_rows"),
    ],
)
def test_pattern_scores_options(model, kwargs, word):
    with pytest.raises(ERR) as err:
        pattern_scores(model, [[0, 1, 2]], **kwargs)
    _one_line(err, word)


def _seeded(model):
    return {
        "random_tokens": lambda s: random_tokens(model, 3, seed=s),
        "repeated_tokens": lambda s: repeated_tokens(model, n_seqs=1, length=(3, 3), seed=s),
        "pattern_scores": lambda s: pattern_scores(model, seed=s),
        "copying_scores": lambda s: copying_scores(model, n_tokens=4, seed=s),
        "needle_prompts": lambda s: needle_prompts(model, n_prompts=1, n_filler=1, seed=s),
        "retrieval_scores": lambda s: retrieval_scores(model, n_prompts=1, n_filler=1, seed=s),
        "detect_roles": lambda s: detect_roles(model, seed=s),
        "pattern_thumbnails": lambda s: pattern_thumbnails(model, seed=s),
        "head_atlas": lambda s: head_atlas(model, detectors={}, seed=s),
        "train_lens": lambda s: train_lens(model, ["a", "b"], [(0, 0)], seed=s, progress=False),
    }


@pytest.mark.parametrize(
    "name",
    [
        "random_tokens",
        "repeated_tokens",
        "pattern_scores",
        "copying_scores",
        "needle_prompts",
        "retrieval_scores",
        "detect_roles",
        "pattern_thumbnails",
        "head_atlas",
        "train_lens",
    ],
)
@pytest.mark.parametrize("seed", [-1, True, 2**32, 1.0, "0"])
def test_seed_same_rule_everywhere(model, name, seed):
    """Every seeded function refuses the same seeds with the same message (negative ones too)."""
    with pytest.raises(HeadsteerValueError) as err:
        _seeded(model)[name](seed)
    _one_line(err, "seed must be an int in 0..4294967295")


def test_seed_numpy_accepted(model):
    assert torch.equal(random_tokens(model, 5, seed=np.int64(3)), random_tokens(model, 5, seed=3))
    a = repeated_tokens(model, n_seqs=2, length=(np.int32(3), np.int64(5)), seed=np.uint8(1))
    b = repeated_tokens(model, n_seqs=2, length=(3, 5), seed=1)
    assert torch.equal(a.input_ids, b.input_ids)


@pytest.mark.parametrize(
    "call, word",
    [
        (lambda m: copying_scores(m, n_tokens=10**9), "n_tokens"),
        (lambda m: copying_scores(m, n_tokens=MAX_COPYING_TOKENS + 1), "n_tokens"),
        (lambda m: copying_scores(m, k=0), "k"),
        (lambda m: copying_scores(m, k=10**9), "k"),
        (lambda m: copying_scores(m, apply_first_mlp="yes"), "apply_first_mlp"),
        (lambda m: retrieval_scores(m, n_filler=10**6), "n_filler"),
        (lambda m: retrieval_scores(m, n_filler=100), "limit of 112 positions"),
        (lambda m: retrieval_scores(m, n_prompts=10**9), "n_prompts"),
        (lambda m: retrieval_scores(m, needle_words=10**6), "needle_words"),
        (lambda m: retrieval_scores(m, batch_size=-1), "batch_size"),
        (lambda m: repeated_tokens(m, n_seqs=10**9), "n_seqs"),
        (lambda m: repeated_tokens(m, length=(56, 56)), "limit of 112 positions"),
        (lambda m: repeated_tokens(m, length=(1.0, 2)), "length"),
        (lambda m: random_tokens(m, 10**9), "n=1000000000"),
        (lambda m: detect_roles(m, retrieval="no"), "retrieval"),
        (lambda m: detect_roles(m, successor=None), "successor"),
        (lambda m: detect_roles(m, apply_first_mlp=0), "apply_first_mlp"),
        (lambda m: successor_scores(m, {"x": [1, 2, 3]}, apply_first_mlp=1), "apply_first_mlp"),
        (lambda m: successor_scores(m, {"x": "abc"}), "'abc'"),
        (lambda m: successor_scores(m, {"x": 5}), "5"),
        (lambda m: successor_scores(m, {3: [1, 2, 3]}), "3"),
        (lambda m: successor_scores(m, {"x": [1, "b", 3]}), "mixed"),
        (lambda m: successor_scores(m, {"x": [1, 2.0, 3]}), "2.0"),
        (lambda m: successor_scores(m, {"x": [1, 2, 99]}), "vocabulary"),
        (lambda m: successor_scores(m, {"x": [" one", " two", " three"]}), "tokenizer"),
        (lambda m: successor_scores(m, [[1, 2, 3]]), "mapping"),
    ],
)
def test_detector_arguments_checked_first(model, call, word, monkeypatch):
    """Huge sizes and bad flags are refused before any row is drawn or any forward runs."""
    import heads.scorers.roles.detectors as d

    def no_work(*a, **k):
        raise AssertionError("work started before the arguments were checked")

    import heads.scorers.roles.needle as needle
    import heads.scorers.roles.sequences as seqs

    monkeypatch.setattr(d, "forward", no_work)
    monkeypatch.setattr(d, "maps_scores", no_work)
    monkeypatch.setattr(d, "_pack", no_work)
    # the retrieval detector and the token rows live in their own modules (re-exported by d)
    monkeypatch.setattr(needle, "forward", no_work)
    monkeypatch.setattr(needle, "_pack", no_work)
    monkeypatch.setattr(seqs, "_pack", no_work)
    with pytest.raises(ERR) as err:
        call(model)
    _one_line(err, word)


def test_successor_numpy_ids_and_tensor(model):
    a = successor_scores(model, {"x": [3, 4, 5], "y": [7, 8, 9]}, apply_first_mlp=False)
    b = successor_scores(
        model, {"x": [np.int64(i) for i in (3, 4, 5)], "y": torch.tensor([7, 8, 9])}, apply_first_mlp=False
    )
    assert torch.equal(a.scores, b.scores)


# ---------------------------------------------------------------- Attention Lens files
@pytest.fixture(scope="module")
def lens_file(model, tmp_path_factory):
    lens = AttentionLens.init(model, [(0, 1), (1, 0)])
    lens.held_out_kl, lens.untrained_kl = torch.tensor([0.5, 0.25]), torch.tensor([1.0, 1.0])
    path = lens.save(tmp_path_factory.mktemp("lens") / "lens.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["headsteer"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return lens, path, header, tensors


def _write(path, header, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"headsteer": json.dumps(header)})
    return path


def _set(key, value):
    def f(h, t):
        h[key] = value

    return f


def _tensor(key, value):
    def f(h, t):
        if value is None:
            t.pop(key)
        else:
            t[key] = value(t[key]) if callable(value) else value

    return f


def _nan(t):
    t = t.clone()
    t[0, 0, 0] = math.nan
    return t


def _inf(t):
    t = t.clone()
    t[1, 3, 2] = math.inf
    return t


@pytest.mark.parametrize(
    "tamper, word",
    [
        (_set("heads", [[0, 1], [5, 0]]), "[5, 0]"),
        (_set("heads", [[0, 1], [1, -1]]), "[1, -1]"),
        (_set("heads", None), "heads must be"),
        (_set("heads", []), "heads must be"),
        (_set("heads", [[0, 1], [0, 1]]), "twice"),
        (_set("heads", [[0, 1], [1, 0], [1, 1]]), "weight is"),
        (_set("heads", [[0, 1], [True, 0]]), "[True, 0]"),
        (_set("form", "wide"), "form"),
        (_set("form", "full"), "weight is"),
        (_set("geometry", [2, 4, 704]), "geometry"),
        (_set("geometry", [2, 4, 704, "64"]), "geometry"),
        (_set("model", 5), "model"),
        (_set("schema_version", True), "schema_version"),
        (_set("schema_version", 2), "schema_version"),
        (_set("schema", "other"), "not a headsteer lens file"),
        (_set("params", []), "params"),
        (_set("history", {}), "history"),
        (_tensor("weight", _nan), "NaN or inf"),
        (_tensor("weight", _inf), "NaN or inf"),
        (_tensor("bias", lambda t: t[:1]), "bias is (1, 704)"),
        (_tensor("weight", lambda t: t.long()), "int64"),
        (_tensor("bias", None), "no 'bias'"),
        (_tensor("weight", None), "no 'weight'"),
        (_tensor("untrained_kl", None), "without its pair"),
        (_tensor("held_out_kl", lambda t: t[:1]), "held_out_kl"),
    ],
)
def test_lens_load_refuses_tampered_file(model, lens_file, tmp_path, tamper, word):
    _, _, header, tensors = lens_file
    h, t = json.loads(json.dumps(header)), dict(tensors)
    tamper(h, t)
    path = _write(tmp_path / "bad.safetensors", h, t)
    with pytest.raises(HeadsteerValueError) as err:
        AttentionLens.load(path)
    _one_line(err, word)


def test_lens_load_good_file_and_args(model, lens_file, tmp_path):
    lens, path, _, _ = lens_file
    with pytest.raises(HeadsteerValueError, match="is a folder"):
        AttentionLens.load(tmp_path)
    with pytest.raises(HeadsteerValueError, match="is a folder"):
        HeadAtlas.load(tmp_path)
    extra = lens.save(tmp_path / "x.safetensors", extra={"x": torch.zeros(3, 4).T})  # non-contiguous
    assert AttentionLens.load(extra).heads == lens.heads
    back = AttentionLens.load(path, model)
    assert back.heads == lens.heads and torch.equal(back.weight, lens.weight)
    with pytest.raises(HeadsteerTypeError, match="path"):
        AttentionLens.load(None)
    with pytest.raises(HeadsteerTypeError, match="model"):
        AttentionLens.load(path, "hand-built-roles")
    with pytest.raises(HeadsteerValueError, match="not a headsteer lens file"):
        AttentionLens.load(__file__)


@pytest.mark.parametrize(
    "kwargs, error, word",
    [
        ({"extra": {"weight": torch.zeros(1)}}, HeadsteerValueError, "'weight' is reserved"),
        ({"extra": {"held_out_kl": torch.zeros(1)}}, HeadsteerValueError, "reserved"),
        ({"extra": {"": torch.zeros(1)}}, HeadsteerValueError, "names"),
        ({"extra": {3: torch.zeros(1)}}, HeadsteerValueError, "names"),
        ({"extra": {"x": [1.0]}}, HeadsteerTypeError, "'x'"),
        ({"extra": [("x", torch.zeros(1))]}, HeadsteerTypeError, "extra"),
        ({"overwrite": "yes"}, HeadsteerTypeError, "overwrite"),
    ],
)
def test_lens_save_refuses(lens_file, tmp_path, kwargs, error, word):
    lens = lens_file[0]
    before = lens.weight.clone()
    with pytest.raises(error) as err:
        lens.save(tmp_path / "l.safetensors", **kwargs)
    _one_line(err, word)
    assert not (tmp_path / "l.safetensors").exists() and torch.equal(lens.weight, before)


@pytest.mark.parametrize("path", [None, 123, b"x.safetensors", ""])
def test_lens_save_path_type(lens_file, path):
    with pytest.raises(HeadsteerTypeError, match="path must be a file path"):
        lens_file[0].save(path)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"layer": True, "head": 0}, "layer must be an int"),
        ({"layer": 1, "head": False}, "head must be an int"),
        ({"layer": 7, "head": 0}, "unknown layer 7"),
        ({"layer": 0, "head": 0}, "no lens for head (0, 0)"),
        ({"layer": 1, "head": 0, "k": 0}, "k must be"),
        ({"layer": np.int64(1), "head": 0, "k": 1.5}, "k must be"),
        ({"layer": 1, "head": 0, "text": ""}, "text"),
    ],
)
def test_lens_top_tokens_checks(model, lens_file, kwargs, word):
    kw = {"text": "x", "k": 5, **kwargs}
    with pytest.raises(ERR) as err:
        lens_file[0].top_tokens(model, kw.pop("text"), kw.pop("layer"), kw.pop("head"), **kw)
    _one_line(err, word)


def test_lens_other_methods(model, lens_file):
    lens = lens_file[0]
    with pytest.raises(HeadsteerValueError, match="which"):
        lens.kl_scores("best")
    with pytest.raises(HeadsteerValueError, match="outputs must be"):
        lens.logits(model, torch.zeros(1, 3, model.d_model))
    with pytest.raises(HeadsteerTypeError, match="trained"):
        lens.logits(model, torch.zeros(2, 3, model.d_model), trained="no")
    with pytest.raises(HeadsteerTypeError, match="LensData"):
        lens.kl(model, {"outputs": 1})
    bad = LensData(
        lens.heads, torch.zeros(2, 3, 5), torch.zeros(3, 64), torch.zeros(3).long(), torch.zeros(3).long()
    )
    with pytest.raises(HeadsteerValueError, match="does not fit"):
        lens.kl(model, bad)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"lr": 1e300}, "lr must be a number in (0, 1]"),
        ({"lr": 0.0}, "lr"),
        ({"lr": math.nan}, "lr"),
        ({"lr": math.inf}, "lr"),
        ({"lr": True}, "lr"),
        ({"held_out": 1.0}, "held_out"),
        ({"held_out": 0}, "held_out"),
        ({"epochs": 0}, "epochs"),
        ({"epochs": 10**9}, "epochs"),
        ({"batch_positions": 0}, "batch_positions"),
        ({"patience": 1.5}, "patience"),
        ({"max_positions": 1}, "max_positions"),
        ({"form": ["tuned"]}, "form"),
        ({"checkpoint": 5}, "checkpoint"),
        ({"progress": "yes"}, "progress"),
    ],
)
def test_train_lens_hyper_parameters_first(model, kwargs, word, monkeypatch):
    import heads.scorers.roles.lens as lens_mod

    def no_work(*a, **k):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(lens_mod, "collect_lens_data", no_work)
    monkeypatch.setattr(lens_mod.AttentionLens, "init", no_work)
    with pytest.raises(ERR) as err:
        train_lens(model, ["a", "b"], [(0, 0)], **{"progress": False, **kwargs})
    _one_line(err, word)


def test_train_lens_lens_data_of_another_model(model):
    data = LensData(
        [(0, 0)], torch.zeros(1, 4, 8), torch.zeros(4, 64), torch.arange(4), torch.zeros(4).long()
    )
    with pytest.raises(HeadsteerValueError, match="does not fit"):
        train_lens(model, data, [(0, 0)], progress=False)


# ---------------------------------------------------------------- atlas
@pytest.mark.parametrize(
    "kwargs, error, word",
    [
        ({"scores": {"x": 1}}, HeadsteerTypeError, "'x' must be HeadScores"),
        ({"scores": [1]}, HeadsteerTypeError, "scores must be"),
        ({"detectors": "induction"}, HeadsteerTypeError, "detectors must be"),
        ({"sinks": "x"}, HeadsteerTypeError, "sinks must be a SinkStats"),
        ({"maps": {}}, HeadsteerTypeError, "maps must be a MapsScores"),
        ({"lens": "lens.safetensors"}, HeadsteerTypeError, "lens must be an AttentionLens"),
        ({"lens_text": "hi"}, HeadsteerValueError, "lens_text needs a lens"),
        ({"thumbnails": 1}, HeadsteerTypeError, "thumbnails"),
        ({"thresholds": {"bogus": 0.5}}, HeadsteerValueError, "unknown role 'bogus'"),
        ({"thresholds": {"induction": math.inf}}, HeadsteerValueError, "threshold of 'induction'"),
        ({"thresholds": {"induction": math.nan}}, HeadsteerValueError, "threshold of 'induction'"),
        ({"thresholds": {"induction": 0}}, HeadsteerValueError, "threshold of 'induction'"),
        ({"thresholds": {"induction": True}}, HeadsteerValueError, "threshold of 'induction'"),
        ({"thresholds": {"role": 0.5}}, HeadsteerValueError, "not a role name"),
        ({"thresholds": [("induction", 0.5)]}, HeadsteerTypeError, "thresholds"),
        ({"scores": {"layer": None}}, HeadsteerValueError, "reserved"),
        ({"scores": {"induction": None}}, HeadsteerValueError, "given twice"),
        ({"scores": {"": None}}, HeadsteerValueError, "names"),
    ],
)
def test_head_atlas_checks_before_detecting(model, kwargs, error, word, monkeypatch):
    """With detectors=None every other argument is checked before `detect_roles` runs."""

    def no_work(*a, **k):
        raise AssertionError("detect_roles ran before the arguments were checked")

    monkeypatch.setattr(atlas_mod, "detect_roles", no_work)
    monkeypatch.setattr(atlas_mod, "pattern_thumbnails", no_work)
    kw = dict(kwargs)
    if "scores" in kw and isinstance(kw["scores"], dict):
        kw["scores"] = {k: (_scores(model) if v is None else v) for k, v in kw["scores"].items()}
    with pytest.raises(error) as err:
        head_atlas(model, **kw)
    _one_line(err, word)


def test_head_atlas_refuses_other_models_scores(model, det):
    other = _scores(model, name="another-model")
    with pytest.raises(HeadsteerValueError) as err:
        head_atlas(model, detectors=det, scores={"other": other}, thumbnails=False)
    _one_line(err, "'another-model'", "'hand-built-roles'")
    wrong = HeadScores(torch.zeros(3, 4), "x", model=model.name)
    with pytest.raises(HeadsteerValueError, match=r"\[3, 4\]"):
        head_atlas(model, detectors={"induction": wrong}, thumbnails=False)
    with pytest.raises(HeadsteerTypeError, match="model"):
        head_atlas("hand-built-roles", detectors=det)


def test_head_atlas_thresholds_numpy_and_columns(model, det):
    extra = _scores(model, 0.0)
    extra.scores[0, 3] = 0.9
    atlas = head_atlas(
        model,
        detectors=det,
        scores={"patching": extra},
        thresholds={"induction": np.float32(0.5), "patching": np.float64(0.5), "previous_token": 1},
        thumbnails=False,
    )
    roles = _roles(atlas)
    assert roles[(1, 0)] == "induction" and roles[(0, 3)] == "patching" and roles[(0, 0)] == "previous_token"
    assert atlas.thresholds == {"induction": 0.5, "patching": 0.5, "previous_token": 1.0}
    before = dict(atlas.thresholds), atlas.frame["role"].tolist()
    with pytest.raises(HeadsteerValueError, match="unknown role"):
        atlas.relabel({"retrieval_heads": 0.3})
    assert (dict(atlas.thresholds), atlas.frame["role"].tolist()) == before  # unchanged
    with pytest.raises(HeadsteerTypeError, match="role must be a string"):
        atlas.heads_with(None)


def test_nan_scores_labelled_nan(model, det):
    """A NaN score on a role before any reached role labels the head 'nan', never 'none'."""
    ind = det["induction"].scores.clone()
    ind[0, 2] = math.nan  # (0, 2): induction unknown -> 'nan'
    ind[0, 0] = math.nan  # (0, 0): induction unknown although previous-token = 1 -> 'nan'
    prev = det["previous_token"].scores.clone()
    prev[1, 0] = math.nan  # (1, 0): induction reached first -> 'induction'
    atlas = head_atlas(
        model,
        detectors={
            "induction": HeadScores(ind, "x", model=model.name),
            "previous_token": HeadScores(prev, "x", model=model.name),
        },
        thumbnails=False,
    )
    roles = _roles(atlas)
    assert roles[(0, 2)] == "nan" and roles[(0, 0)] == "nan" and roles[(1, 0)] == "induction"
    assert roles[(0, 1)] == "none"
    with pytest.raises(HeadsteerTypeError, match="DataFrame"):
        role_labels({"induction": [1.0]})


@pytest.mark.parametrize(
    "tamper, word",
    [
        (lambda d: d.pop("model"), "model"),
        (lambda d: d.pop("rows"), "rows"),
        (lambda d: d.pop("thresholds"), "thresholds"),
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d.pop("schema_version"), "schema_version"),
        (lambda d: d["rows"][0].pop("layer"), "layer"),
        (lambda d: d["rows"][3].pop("role"), "role"),
        (lambda d: d["rows"][0].update(head=True), "head"),
        (lambda d: d["thresholds"].update(induction="high"), "induction"),
        (lambda d: d.update(sources=[]), "sources"),
        (lambda d: d.update(lens_tokens=[[0, 0]]), "lens_tokens"),
        (lambda d: d.update(thumbnails=[[1, 2], [3]]), "thumbnails"),
        (lambda d: d.update(thumbnails=[[[[0.5]]]]), "thumbnails are (1, 1, 1, 1)"),
    ],
)
def test_atlas_load_refuses_tampered_file(model, det, tmp_path, tamper, word):
    atlas = head_atlas(model, detectors=det, thumbnails=False)
    path = atlas.save(tmp_path / "a.json")
    data = json.loads(path.read_text())
    tamper(data)
    path.write_text(json.dumps(data))
    with pytest.raises(HeadsteerValueError) as err:
        HeadAtlas.load(path)
    _one_line(err, word)


def test_atlas_save_checks(model, det, tmp_path):
    atlas = head_atlas(model, detectors=det, thumbnails=False)
    with pytest.raises(HeadsteerTypeError, match="overwrite"):
        atlas.save(tmp_path / "a.json", overwrite="yes")
    with pytest.raises(HeadsteerTypeError, match="path"):
        atlas.save(None)
    assert not (tmp_path / "a.json").exists()
    with pytest.raises(HeadsteerValueError, match="size"):
        pattern_thumbnails(model, size=0)


def test_train_lens_checkpoint_checked_before_training(model, tmp_path):
    """A checkpoint of other training parameters, or with a tensor missing, is refused up front."""
    g = torch.Generator().manual_seed(0)
    n = 24
    data = LensData(
        [(0, 0)],
        torch.randn(1, n, model.d_model, generator=g),
        torch.randn(n, model.d_vocab, generator=g).half(),
        torch.arange(n) % 4,
        torch.zeros(n).long(),
    )
    ck = tmp_path / "ck.safetensors"
    train_lens(model, data, [(0, 0)], epochs=1, progress=False, checkpoint=ck)
    with pytest.raises(HeadsteerValueError) as err:
        train_lens(model, data, [(0, 0)], epochs=2, lr=1e-2, progress=False, checkpoint=ck)
    _one_line(err, "other lr")
    from safetensors import safe_open

    with safe_open(str(ck), framework="pt") as f:
        header = json.loads(f.metadata()["headsteer"])
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "m_w"}  # noqa: SIM118
    _write(ck, header, tensors)
    with pytest.raises(HeadsteerValueError) as err:
        train_lens(model, data, [(0, 0)], epochs=2, progress=False, checkpoint=ck)
    _one_line(err, "not a train_lens checkpoint", "m_w")
