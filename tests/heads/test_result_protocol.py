"""Every analysis result follows the written protocol (`heads.results.protocol.Result`): it is an
instance of `Result`, `save(path)` returns the path and refuses to overwrite without
`overwrite=True`, and `load(path, model)` gives back the same head scores and table, refusing a
model of another geometry. Each result is made by its analysis on the tiny GQA Llama (fast
settings), or built from scores where the analysis is slow (MAPS). A result with no per-head
number (`SinkDims`: residual-stream dimensions) says so: its `head_scores()` raises, naming the
analysis that gives one. Every `save` refuses to write through a symlink."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

import heads
from heads.errors import HeadsteerValueError
from heads.results.protocol import Result
from tests.support import make_tiny

QUIET = heads.SweepOptions(progress=False)
PROMPTS = ["When Mary and John went to the store, John gave a drink to", "The cat sat on the"]


def _pairs():
    from heads.scorers.patching import pairs_from_tokens

    return pairs_from_tokens(
        [[40, 41, 42, 43], [50, 41, 44, 43]], [[40, 49, 42, 43], [50, 48, 44, 43]], [[20], [22]], [[21], [23]]
    )


def _maps(model):
    g = torch.Generator().manual_seed(0)

    def grid():
        return heads.HeadScores(
            torch.rand(model.n_layers, model.n_heads, generator=g), "maps", n_kv_heads=model.n_kv_heads
        )

    return heads.MapsScores(
        {"copying": grid(), "capital": grid()}, {"copying": grid(), "capital": grid()}, {"k": 1}
    )


def _gating(model):
    task = heads.scorers.gating.gate_task(model, PROMPTS, [" Mary", " mat"])
    return heads.gate_heads(model, task, steps=1, reg_steps=1, progress=False)


def _lens(model):
    from heads.scorers.patching.logit import logit_inspection

    return logit_inspection(model, _pairs())  # the lens and the per-head direct logits


NO_HEAD_SCORES = {"SinkDims": "sink_stats"}
"""Results without a per-head number -> the analysis their `head_scores()` error names."""

BUILDERS = {
    "HeadScores": lambda m: heads.composition_scores(m, n_samples=4).head_scores(),
    "Circuit": lambda m: heads.find_circuit(
        m, _pairs(), method="eap", size=50.0, curve=False, progress=False
    ),
    "KnockoutResult": lambda m: heads.knockout(m, _pairs(), keys=[1], layers=[0, 1], per="layer"),
    "PatchResult": lambda m: heads.patch(m, _pairs(), "head_out", options=QUIET),
    "QKAttribution": lambda m: heads.qk_attribution(m, PROMPTS[1], (1, 1)),
    "CompositionScores": lambda m: heads.composition_scores(m, n_samples=4),
    "RoleScores": lambda m: heads.detect_roles(m, retrieval=False, successor=False),
    "HeadAtlas": lambda m: heads.head_atlas(
        m, detectors=heads.detect_roles(m, retrieval=False, successor=False), thumbnails=False
    ),
    "ShipsResult": lambda m: heads.ships(m, PROMPTS, heads=[(0, 1), (2, 3)], options=QUIET),
    "SaharaResult": lambda m: heads.sahara(
        m, PROMPTS, steps=2, heads=[(0, 1), (1, 0), (2, 3)], options=QUIET
    ),
    "SinkStats": lambda m: heads.sink_stats(m, PROMPTS, chat=False),
    "MapsScores": _maps,
    "GatingResult": _gating,
    "DLAResult": lambda m: heads.direct_logit_attribution(m, _pairs()),
    "EdgeScores": lambda m: heads.scorers.circuits.edge_scores(m, _pairs(), method="eap", options=QUIET),
    "LensResult": _lens,
    "SinkDims": lambda m: heads.find_sink_dims(m, PROMPTS, from_layer=1, min_ratio=1.001),
    "AttentionLens": lambda m: heads.train_lens(
        m, PROMPTS * 4, [(0, 1), (2, 3)], epochs=1, max_positions=64, options=QUIET
    ),
}
"""Result class name -> how the test makes one on the tiny model."""


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return make_tiny("llama", tokenizer, attn="eager")  # 3 layers, 4 query heads, 2 KV heads


@pytest.fixture(scope="module")
def other(tokenizer):
    return make_tiny("gpt2", tokenizer)


def _header(path):
    """The JSON header of a result file (a safetensors file keeps it in its metadata)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return json.loads(f.metadata()["headsteer"])
    return json.loads(path.read_text())


def _same_frame(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(
        a.reset_index(drop=True),
        b.reset_index(drop=True),
        check_dtype=False,
        check_exact=False,
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_result_follows_the_protocol_and_round_trips(name, tiny, other, tmp_path):
    res = BUILDERS[name](tiny)
    cls = type(res)
    assert cls.__name__ == name and getattr(heads, name) is cls  # the front door exports it
    assert isinstance(res, Result)
    assert isinstance(cls.SCHEMA, str) and cls.SCHEMA.startswith("headsteer/") and cls.SCHEMA_VERSION >= 1
    save = inspect.signature(cls.save).parameters
    assert save["overwrite"].kind is inspect.Parameter.KEYWORD_ONLY and save["overwrite"].default is False
    assert "model" in inspect.signature(cls.load).parameters
    scores = None
    if name in NO_HEAD_SCORES:
        with pytest.raises(HeadsteerValueError, match=NO_HEAD_SCORES[name]):
            res.head_scores()
    else:
        scores = res.head_scores()
        assert isinstance(scores, heads.HeadScores) and tuple(scores.scores.shape) == (
            tiny.n_layers,
            tiny.n_heads,
        )
    frame = res.to_frame()
    assert isinstance(frame, pd.DataFrame) and len(frame) > 0

    path = tmp_path / f"{name}.{'safetensors' if name == 'AttentionLens' else 'json'}"
    link = tmp_path / f"link-{path.name}"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(HeadsteerValueError, match="symlink"):
        res.save(link, overwrite=True)
    assert not (tmp_path / "elsewhere").exists()
    got = res.save(path)
    assert got == path and path.is_file()
    with pytest.raises(HeadsteerValueError, match="exists"):
        res.save(path)
    assert res.save(path, overwrite=True) == path
    head = _header(path)
    assert (head["schema"], head["schema_version"]) == (cls.SCHEMA, cls.SCHEMA_VERSION)

    back = cls.load(path, tiny)
    assert type(back) is cls
    if scores is not None:
        torch.testing.assert_close(back.head_scores().scores, scores.scores, equal_nan=True)
    _same_frame(back.to_frame(), frame)
    if (other.n_layers, other.n_heads, other.n_kv_heads) != (tiny.n_layers, tiny.n_heads, tiny.n_kv_heads):
        with pytest.raises(HeadsteerValueError, match="geometry|model has"):
            cls.load(path, other)
    other_file = tmp_path / "other.json"
    other_file.write_text(json.dumps({**head, "schema": "headsteer/something-else"}))
    with pytest.raises(HeadsteerValueError):
        cls.load(other_file)


# ------------------------------------------------------------------ tampered files, versions, model
_SAVED: dict[str, object] = {}
"""Result class name -> a saved file of it, made once for the tests below."""

_JUNK = ["x", -1, None, [], {"a": None}, 1.5]


def _saved(name, tiny, tmp_path_factory):
    if name not in _SAVED:
        res = BUILDERS[name](tiny)
        ext = "safetensors" if name == "AttentionLens" else "json"
        _SAVED[name] = res.save(tmp_path_factory.mktemp("saved") / f"{name}.{ext}")
    return _SAVED[name]


def _rewrite(src, header, out):
    """A copy of result file `src` at `out` whose JSON header is `header`."""
    if src.suffix == ".safetensors":
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(src), framework="pt") as f:
            meta = dict(f.metadata())
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        save_file(tensors, str(out), metadata={**meta, "headsteer": json.dumps(header)})
    else:
        out.write_text(json.dumps(header))
    return out


def _field_paths(obj, prefix=(), depth=0):
    """Paths (key / index tuples) into the header: every dict key to depth 3, the first list item."""
    if depth >= 3:
        return
    items = obj.items() if isinstance(obj, dict) else [(0, obj[0])] if isinstance(obj, list) and obj else []
    for key, value in items:
        if prefix == () and key in ("schema", "schema_version"):
            continue
        yield (*prefix, key)
        yield from _field_paths(value, (*prefix, key), depth + 1)


def _set(obj, path, value):
    import copy

    out = copy.deepcopy(obj)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_tampered_result_file_is_one_clear_error_naming_the_file(
    name, tiny, tmp_path, tmp_path_factory, monkeypatch
):
    src = _saved(name, tiny, tmp_path_factory)
    monkeypatch.chdir(tmp_path)  # a short relative path: every message can show it whole
    head = _header(src)
    paths = list(_field_paths(head))
    paths = paths[:: max(1, len(paths) // 30)]  # at most ~30 fields, spread over the file
    out = Path(f"tampered{src.suffix}")
    refused = 0
    for path in paths:
        for junk in _JUNK:
            _rewrite(src, _set(head, path, junk), out)
            try:
                getattr(heads, name).load(out, tiny)
            except HeadsteerValueError as exc:
                assert str(out) in str(exc), (path, junk, str(exc))
                refused += 1
            except Exception as exc:  # noqa: BLE001 - the assertion names what escaped
                raise AssertionError(f"{name} field {path} = {junk!r}: {type(exc).__name__}: {exc}") from exc
    assert refused > 0


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_schema_version_is_checked_strictly_and_model_must_be_a_model(name, tiny, tmp_path, tmp_path_factory):
    from heads.errors import HeadsteerTypeError

    src = _saved(name, tiny, tmp_path_factory)
    cls = getattr(heads, name)
    head = _header(src)
    good = head["schema_version"]
    assert type(good) is int
    for bad in [float(good), True if good == 1 else good + 0.0, good + 98, None, "x", str(good)]:
        out = _rewrite(src, {**head, "schema_version": bad}, tmp_path / f"v{src.suffix}")
        with pytest.raises(HeadsteerValueError, match="schema_version"):
            cls.load(out)
    missing = {k: v for k, v in head.items() if k != "schema_version"}
    out = _rewrite(src, missing, tmp_path / f"m{src.suffix}")
    with pytest.raises(HeadsteerValueError, match="schema_version"):
        cls.load(out)
    for model in ("notamodel", 3, object()):
        with pytest.raises(HeadsteerTypeError, match="model"):
            cls.load(src, model)
